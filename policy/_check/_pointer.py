"""Reading values out of arguments by JSON pointer."""

from __future__ import annotations

from typing import Any

__all__ = ["MISSING", "resolve_pointer"]

MISSING: Any = object()
"""Returned by `resolve_pointer` when nothing is at the pointer."""


def resolve_pointer(document: Any, pointer: str) -> Any:
    """The value at RFC 6901 `pointer` in `document`, or `MISSING`."""
    if pointer == "":
        return document
    current = document
    for raw in pointer.split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(current, dict):
            if part not in current:
                return MISSING
            current = current[part]
        elif isinstance(current, list) and part.isdigit() and int(part) < len(current):
            current = current[int(part)]
        else:
            return MISSING
    return current
