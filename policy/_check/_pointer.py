"""Reading values out of arguments by JSON pointer, and replacing them in a copy."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["MISSING", "replace_at_pointers", "resolve_pointer"]

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


def replace_at_pointers(
    document: Any, pointers: Iterable[str], replace: Callable[[Any], Any]
) -> Any:
    """A deep copy of `document` with the value at each RFC 6901 pointer that resolves
    replaced by `replace(value)`; a pointer to nothing (or to the whole document) is
    skipped. `document` itself when there are no pointers.

    How the ledger hashes sensitive arguments on the feed and an executor masks them
    on a span: one walk, so the two can never disagree on what a pointer names.
    """
    pointers = tuple(pointers)
    if not pointers:
        return document
    result = copy.deepcopy(document)
    for pointer in pointers:
        if "/" not in pointer:
            continue
        parent_pointer, _, raw = pointer.rpartition("/")
        parent = resolve_pointer(result, parent_pointer)
        last = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(parent, dict) and last in parent:
            parent[last] = replace(parent[last])
        elif isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
            parent[int(last)] = replace(parent[int(last)])
    return result
