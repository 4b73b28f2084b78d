"""`Recent`: a mapping that keeps only its most recently remembered entries."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

__all__ = ["Recent"]

K = TypeVar("K")
V = TypeVar("V")


class Recent(OrderedDict[K, V]):
    """An ordered mapping bounded to `limit` entries: remembering past it drops the oldest.

    For in-memory knowledge that is only a shortcut (caches of what the ledger
    stores, notices not yet asked for): losing the oldest costs a lookup, never
    correctness, and memory stays bounded however long the process runs.
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def remember(self, key: K, value: V) -> None:
        """Store `value` as the newest entry, dropping the oldest beyond the limit."""
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)
