"""Parsers shared by several sections: text as it arrives from a flag or a variable."""

from __future__ import annotations

from typing import Any


def split_commas(cls, value: Any) -> Any:
    """``"a, b"`` (a flag or a variable) → ``["a", "b"]``; a TOML list passes as it is."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value
