"""Approvals: a person approves or denies exactly the call they were shown."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime

from ledger.domain.errors import ApprovalRefused
from ledger.domain.operation import Operation
from ledger.service._runner import CommandRunner

__all__ = ["Approvals"]


class Approvals:
    """The approval use cases (expiry is a sweep, see `Sweeps`)."""

    def __init__(self, runner: CommandRunner, *, clock: Callable[[], datetime]) -> None:
        self._runner = runner
        self._clock = clock

    def approve(
        self,
        operation_id: str,
        *,
        approver: str,
        approver_roles: Iterable[str],
        proposal_hash: str,
        approval_id: str | None = None,
    ) -> Operation:
        """Approve exactly the call that hashes to `proposal_hash`.

        A refused approval is recorded in the ledger, then `ApprovalRefused` is raised.
        """
        roles = frozenset(approver_roles)

        def command(operation: Operation) -> tuple[Operation, str | None]:
            given = approval_id or _open_approval_id(operation)
            refusal = operation.grant_approval(
                approval_id=given,
                approver=approver,
                approver_roles=roles,
                proposal_hash=proposal_hash,
                now=self._clock(),
            )
            return operation, refusal

        operation, refusal = self._runner.update(operation_id, command)
        if refusal is not None:
            raise ApprovalRefused(
                f"approval refused: {refusal}", operation_id=operation_id, reason=str(refusal)
            )
        return operation

    def deny(self, operation_id: str, *, approver: str, reason: str = "") -> Operation:
        """Deny the call; it will never run."""

        def command(operation: Operation) -> Operation:
            operation.deny_approval(
                approval_id=_open_approval_id(operation),
                approver=approver,
                reason=reason,
                now=self._clock(),
            )
            return operation

        return self._runner.update(operation_id, command)


def _open_approval_id(operation: Operation) -> str:
    return operation.approval.approval_id if operation.approval is not None else ""
