"""A config section, and the names each of its settings goes by.

Every setting has one place of definition, a field of a :class:`Section`
model, and four names derived from it:

- its path in the config file: ``[tiers.ram] bytes``;
- a flag of ``strata serve``: ``--ram-bytes`` (the section's ``flag_prefix``
  plus the field name, or the field's own ``flag`` where today's flag has a
  shorter or older name);
- the flat environment variable of that flag: ``STRATA_RAM_BYTES``;
- a nested environment variable of the path: ``STRATA_TIERS__RAM__BYTES``.

The flat names are the daemon's public interface since its first release,
so they are fixed per field (``flag=``) rather than recomputed from the
path: moving a field to another section must not rename its flag.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ENV_PREFIX = "STRATA_"
ENV_NESTING = "__"


class Section(BaseModel):
    """One component's settings: a TOML table, a group of flags.

    A component adds its section by subclassing this in its own module and
    naming it as a field of its parent section; flags, environment names,
    ``--help`` groups and error messages follow from the field.
    """

    model_config = ConfigDict(extra="forbid", validate_default=True)

    # Put before a field's name to make its flag, unless the field says ``flag``.
    flag_prefix: ClassVar[str] = ""
    # One line for the --help group and the README.
    title: ClassVar[str] = ""


def setting(default: Any = PydanticUndefined, description: str = "", *, flag: str | None = None,
            repeatable: bool = False, **kwargs: Any) -> Any:
    """A field of a section; ``flag`` fixes its flat name (flag and environment variable);
    ``repeatable``: the flag is given once per list item (``--arena A --arena B``)."""
    extra: dict[str, Any] = {"flag": flag} if flag else {}
    if repeatable:
        extra["repeatable"] = True
    extra = extra or None
    return Field(default, description=description, json_schema_extra=extra, **kwargs)


@dataclass(frozen=True)
class SettingName:
    """The names of one setting, and its field."""

    path: tuple[str, ...]  # ("tiers", "ram", "bytes")
    flag: str  # "ram_bytes": the argparse dest and the flat name
    field: FieldInfo
    section: type[Section]

    @property
    def repeatable(self) -> bool:
        extra = self.field.json_schema_extra
        return isinstance(extra, dict) and bool(extra.get("repeatable"))

    @property
    def option(self) -> str:
        return "--" + self.flag.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.upper()

    @property
    def nested_env(self) -> str:
        return ENV_PREFIX + ENV_NESTING.join(self.path).upper()

    @property
    def toml(self) -> str:
        return f"[{'.'.join(self.path[:-1])}] {self.path[-1]}" if len(self.path) > 1 else self.path[0]

    def where(self) -> str:
        """Every name under which this setting can be changed, for error messages."""
        return f"{self.flag} (flag {self.option}, env {self.env}), config {self.toml}"


def subsection(field: FieldInfo) -> type[Section] | None:
    annotation = field.annotation
    return annotation if inspect.isclass(annotation) and issubclass(annotation, Section) else None


def iter_settings(model: type[Section], path: tuple[str, ...] = ()) -> Iterator[SettingName]:
    """Every leaf setting under ``model``, in declaration order."""
    for name, field in model.model_fields.items():
        child = subsection(field)
        if child is not None:
            yield from iter_settings(child, (*path, name))
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flag = extra.get("flag") or model.flag_prefix + name
        yield SettingName((*path, name), str(flag), field, model)


def iter_sections(model: type[Section], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], type[Section]]]:
    """``model`` and every section under it, parents first."""
    yield path, model
    for name, field in model.model_fields.items():
        child = subsection(field)
        if child is not None:
            yield from iter_sections(child, (*path, name))


def section_at(model: type[Section], path: tuple[str | int, ...]) -> type[Section] | None:
    """The section model at ``path`` below ``model``, or None when the path leaves the sections."""
    for part in path:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        child = subsection(field) if field is not None else None
        if child is None:
            return None
        model = child
    return model
