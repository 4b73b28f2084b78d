"""In-memory adapters of the check's ports, for tests, demos and the embedded default."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import orjson

from policy._ports import AmbiguousTarget, Target
from schemas import RuntimeContext

__all__ = ["InMemoryBudgetCounter", "InMemoryTargetResolver", "load_targets"]


def load_targets(path: Path) -> list[Target]:
    """The targets of a JSON file: an array of objects holding `Target`'s fields.

    How sample worlds are kept as data rather than code (`policy.catalog`).
    """
    return [Target(**fields) for fields in orjson.loads(path.read_bytes())]


class InMemoryTargetResolver:
    """Resolves targets from a fixed set, scoped to the caller's tenant like a real store."""

    def __init__(self, targets: Iterable[Target] = ()) -> None:
        self._targets: dict[tuple[str, str], list[Target]] = {}
        for target in targets:
            self.add(target)

    def add(self, target: Target) -> None:
        """Make `target` resolvable (a second one of the same kind and ID makes it ambiguous)."""
        self._targets.setdefault((target.kind, target.id), []).append(target)

    def resolve(
        self, kind: str, target_id: str, context: RuntimeContext
    ) -> Target | AmbiguousTarget | None:
        """The target, whatever its tenant: the check decides visibility."""
        del context  # a real resolver may use it to scope the query
        found = self._targets.get((kind, target_id), [])
        if len(found) > 1:
            return AmbiguousTarget(kind, target_id, tuple(found))
        return found[0] if found else None


class InMemoryBudgetCounter:
    """Counts recorded operations in memory; the ledger provides the durable one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[tuple[str, str, str], list[datetime]] = defaultdict(list)

    def record(self, *, tenant: str, actor: str, tool: str, at: datetime) -> None:
        """Note one operation."""
        with self._lock:
            self._events[(tenant, actor, tool)].append(at)

    def count(self, *, tenant: str, actor: str, tool: str, since: datetime) -> int:
        """Operations recorded at or after `since`."""
        with self._lock:
            return sum(1 for at in self._events[(tenant, actor, tool)] if at >= since)
