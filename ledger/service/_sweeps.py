"""Sweeps: what time alone decides (approvals and leases that ran out)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

from ledger.domain.states import OperationState
from ledger.projections.operations_view import OperationRow, OperationsProjector
from ledger.service._runner import CommandRunner

__all__ = ["Sweeps"]


class Sweeps:
    """Expire what ran out of time; the view names the candidates, the aggregate decides."""

    def __init__(
        self,
        runner: CommandRunner,
        view: OperationsProjector,
        *,
        clock: Callable[[], datetime],
        refresh: Callable[[], int],
    ) -> None:
        self._runner = runner
        self._view = view
        self._clock = clock
        self._refresh = refresh

    def expire_approvals(
        self, *, refresh: bool = True, candidates: Sequence[OperationRow] | None = None
    ) -> list[str]:
        """Expire every approval request whose time has passed (`refresh`: bring the
        view up to date first; a service whose view thread keeps it close says no,
        and what the view does not show yet is expired by the next sweep;
        `candidates`: the view's awaiting rows, asked by the caller elsewhere, as for
        `expire_leases`)."""
        if refresh:
            self._refresh()
        now = self._clock()
        expired = []
        if candidates is None:
            candidates = self._view.rows(state=OperationState.AWAITING_APPROVAL.value)
        for row in candidates:
            if row.approval_expires_at and datetime.fromisoformat(row.approval_expires_at) <= now:
                self._runner.update(row.operation_id, lambda op: op.expire_approval(now))
                expired.append(row.operation_id)
        return expired

    def expire_leases(
        self, *, refresh: bool = True, candidates: Sequence[str] | None = None
    ) -> list[str]:
        """Move every operation whose lease ran out to `outcome_unknown` (`refresh`: as
        for `expire_approvals`; `candidates`: the view's answer to
        `lease_expiry_candidates`, asked by the caller elsewhere, e.g. off the event
        loop: `ledger.server.sweep_reads`)."""
        if refresh:
            self._refresh()
        now = self._clock()
        expired = []
        # The view names the candidates, so that a sweep loads only operations
        # whose lease ran out, not every one in flight; each one's own lease decides.
        if candidates is None:
            candidates = self._view.lease_expiry_candidates(now)
        for operation_id in candidates:
            operation = self._runner.get(operation_id)
            if operation.lease is not None and operation.lease.expires_at <= now:
                self._runner.update(operation_id, lambda op: op.expire_lease(now))
                expired.append(operation_id)
        return expired
