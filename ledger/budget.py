"""The check's budget counter, backed by the ledger so limits hold across restarts."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import datetime

from ledger.projections.operations_view import OperationsProjector

__all__ = ["LedgerBudgetCounter"]


class LedgerBudgetCounter:
    """Counts an actor's accepted operations of a tool from the operations view.

    It first brings the view up to date, so operations recorded by another
    ledger instance on the same database count too. Operations of a batch
    that is being checked but not yet saved are added from `pending`, or a
    batch of a hundred proposals would all see the same old count.
    """

    def __init__(self, projector: OperationsProjector) -> None:
        self._projector = projector
        self._pending: Counter[tuple[str, str, str]] = Counter()
        self._lock = threading.Lock()

    def count(self, *, tenant: str, actor: str, tool: str, since: datetime) -> int:
        """Operations accepted for `actor` in `tenant` and `tool` since `since`."""
        self._projector.catch_up()
        stored = self._projector.count_since(tenant=tenant, actor=actor, tool=tool, since=since)
        with self._lock:
            return stored + self._pending[(tenant, actor, tool)]

    def note_pending(self, *, tenant: str, actor: str, tool: str) -> None:
        """Count one accepted operation that is not saved yet."""
        with self._lock:
            self._pending[(tenant, actor, tool)] += 1

    def clear_pending(self) -> None:
        """The batch was saved (or abandoned): the view will count it from now on."""
        with self._lock:
            self._pending.clear()
