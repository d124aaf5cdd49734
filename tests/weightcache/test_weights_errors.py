"""The weight pipeline's error tree: the drawing in weightcache.errors' docstring is the set of
classes the module defines, each under its parent, and each is exported."""

from __future__ import annotations

import inspect
import re

from kvstore import errors as kvstore_errors
from kvstore.errors import StrataError
from weightcache import errors

TREE = errors.__doc__.split("``DiskFull``")[0]


def defined_here() -> list[type[StrataError]]:
    return [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
            if issubclass(cls, StrataError) and cls.__module__ == errors.__name__]


def drawn_line(name: str) -> tuple[int, str]:
    lines = TREE.splitlines()
    return next((i, l) for i, l in enumerate(lines) if re.search(rf"── {name}\b", l))


def test_every_class_defined_here_is_drawn_and_exported():
    names = sorted(cls.__name__ for cls in defined_here())
    drawn = re.findall(r"[├└]── (\w+)", TREE)
    # The tree also draws the kvstore classes the weight classes hang from: each is kvstore's own.
    for name in set(drawn) - set(names):
        assert getattr(kvstore_errors, name, None) is not None, f"{name} is drawn but defined nowhere"
    assert set(names) <= set(drawn), "a class weightcache.errors defines is missing from its tree"
    assert sorted(errors.__all__) == names, "weightcache.errors.__all__ is not the set of classes it defines"


def test_each_class_is_drawn_under_its_parent():
    lines = TREE.splitlines()
    for cls in defined_here():
        index, line = drawn_line(cls.__name__)
        indent = line.index("──")
        above = [l for l in lines[:index] if re.search(r"── \w+", l)]
        owner = next(l for l in reversed(above) if l.index("──") < indent)
        assert f"── {cls.__bases__[0].__name__} " in owner + " ", f"{cls.__name__} is not drawn under its parent"
