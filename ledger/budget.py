"""The check's budget counter, backed by the ledger so limits hold across restarts."""

from __future__ import annotations

from datetime import datetime

from ledger.projections.operations_view import OperationsProjector

__all__ = ["LedgerBudgetCounter"]


class LedgerBudgetCounter:
    """Counts an actor's operations of a tool from the operations view.

    It first brings the view up to date, so operations recorded by another
    ledger instance on the same database are counted too.
    """

    def __init__(self, projector: OperationsProjector) -> None:
        self._projector = projector

    def count(self, *, tenant: str, actor: str, tool: str, since: datetime) -> int:
        """Operations proposed by `actor` in `tenant` for `tool` since `since`."""
        self._projector.catch_up()
        return self._projector.count_since(tenant=tenant, actor=actor, tool=tool, since=since)
