"""`Recent`: a mapping that keeps only its most recently remembered entries."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

__all__ = ["Recent"]

K = TypeVar("K")
V = TypeVar("V")


class Recent(OrderedDict[K, V]):
    """An ordered mapping bounded to `limit` entries (and optionally to a total weight):
    remembering past a bound drops the oldest entries.

    For in-memory knowledge that is only a shortcut (caches of what the ledger
    stores, notices not yet asked for): losing the oldest costs a lookup, never
    correctness, and memory stays bounded however long the process runs.

    A count alone does not bound memory when entries differ in size (2,000
    cached operations of 512 KiB each are a gigabyte): `max_weight` bounds the
    sum of the weights given to `remember`, e.g. bytes. An entry heavier than
    the whole budget is not kept at all.
    """

    def __init__(self, limit: int, *, max_weight: int | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.max_weight = max_weight
        self._weights: dict[K, int] = {}
        self.weight = 0
        """The sum of the weights of the entries kept."""

    def remember(self, key: K, value: V, weight: int = 1) -> None:
        """Store `value` as the newest entry, dropping the oldest beyond the bounds."""
        if self.max_weight is None:
            # Bounded by count alone (most uses): no weights to keep.
            self[key] = value
            self.move_to_end(key)
            while len(self) > self.limit:
                self.popitem(last=False)
            return
        self.pop(key, None)
        if self.max_weight is not None and weight > self.max_weight:
            return
        self[key] = value
        self._weights[key] = weight
        self.weight += weight
        while len(self) > self.limit or (
            self.max_weight is not None and self.weight > self.max_weight
        ):
            self.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        # Every removal (pop, popitem, del, clear) goes through here, so the
        # total weight stays exact whatever removes an entry.
        super().__delitem__(key)
        self.weight -= self._weights.pop(key, 0)

    def popitem(self, last: bool = True) -> tuple[K, V]:
        """Remove and return the newest (or, with `last=False`, the oldest) entry."""
        key, value = super().popitem(last=last)
        self.weight -= self._weights.pop(key, 0)
        return key, value

    def pop(self, key: K, *default: V | None) -> V | None:  # type: ignore[override]
        """Remove `key` and return its value (or `default`)."""
        if key in self:
            self.weight -= self._weights.pop(key, 0)
        return super().pop(key, *default)

    def clear(self) -> None:
        """Forget everything."""
        super().clear()
        self._weights.clear()
        self.weight = 0
