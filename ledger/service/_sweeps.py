"""Sweeps: what time alone decides (approvals and leases that ran out)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime

from ledger.adapters.failures import is_outage
from ledger.domain.errors import LedgerError
from ledger.domain.operation import ALLOWED, Operation
from ledger.projections.operations_view import OperationsProjector
from ledger.service._runner import CommandRunner

__all__ = ["MAX_PER_SWEEP", "Sweeps"]

MAX_PER_SWEEP = 500
"""How many approvals, and how many leases, one sweep expires at most (an append each)."""

_log = logging.getLogger(__name__)


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
        self, *, refresh: bool = True, candidates: Sequence[str] | None = None
    ) -> list[str]:
        """Expire every approval request whose time has passed (`refresh`: bring the
        view up to date first; a service whose view thread keeps it close says no,
        and what the view does not show yet is expired by the next sweep;
        `candidates`: the view's answer to `approval_expiry_candidates`, asked by the
        caller elsewhere, as for `expire_leases`)."""
        if refresh:
            self._refresh()
        now = self._clock()
        expired = []
        if candidates is None:
            candidates = self._view.approval_expiry_candidates(now, limit=MAX_PER_SWEEP)
        # One sweep expires a bounded number (the oldest first), since it holds the
        # service's loop; the next sweep, two seconds later, goes on.
        for operation_id in candidates[:MAX_PER_SWEEP]:
            # The view's row may be a moment old: the call may have been approved,
            # denied or cancelled since. Its own state decides, again on every retry.
            if self._expire(operation_id, lambda op: _expire_approval(op, now)):
                expired.append(operation_id)
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
        for operation_id in candidates[:MAX_PER_SWEEP]:
            # As for approvals: a result may have come since the view's answer.
            if self._expire(operation_id, lambda op: _expire_lease(op, now)):
                expired.append(operation_id)
        return expired

    def _expire(self, operation_id: str, command: Callable[[Operation], bool]) -> bool:
        # One operation the ledger cannot load or save (gone, its events unreadable,
        # its append failing again and again) must not keep every later one from
        # expiring, sweep after sweep: say so, go on. A database that cannot be
        # reached is no one operation's fault: that ends the sweep.
        try:
            return self._runner.update(operation_id, command)
        except LedgerError as exc:
            _log.warning("sweep: %s not expired: %s", operation_id, exc)
        except Exception as exc:
            if is_outage(exc):
                raise
            _log.exception("sweep: %s cannot be expired", operation_id)
        return False


def _expire_approval(operation: Operation, now: datetime) -> bool:
    if operation.state not in ALLOWED["expire_approval"] or operation.approval is None:
        return False
    if now < operation.approval.expires_at:
        return False
    operation.expire_approval(now)
    return True


def _expire_lease(operation: Operation, now: datetime) -> bool:
    if operation.state not in ALLOWED["expire_lease"] or operation.lease is None:
        return False
    if now < operation.lease.expires_at:
        return False
    operation.expire_lease(now)
    return True
