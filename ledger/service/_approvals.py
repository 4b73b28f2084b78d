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
        via: str = "",
        preview_hash: str | None = None,
    ) -> Operation:
        """Approve exactly the call that hashes to `proposal_hash` (and, for a call its
        contract previews, whose recorded preview hashes to `preview_hash`).

        `approver` and `approver_roles` come from whoever authenticated the
        approver (the NATS identity and the service's configuration), never from
        the approver's own message; `via` records which way it came.
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
                via=via,
                preview_hash=preview_hash,
            )
            return operation, refusal

        operation, refusal = self._runner.update(operation_id, command)
        if refusal is not None:
            raise _refused("approval", operation, refusal)
        return operation

    def deny(
        self,
        operation_id: str,
        *,
        approver: str,
        approver_roles: Iterable[str],
        reason: str = "",
        via: str = "",
    ) -> Operation:
        """Deny the call; it will never run. Only one of its approvers may: anyone
        else's denial is recorded, then `ApprovalRefused` (`not_an_approver`) is raised."""
        roles = frozenset(approver_roles)

        def command(operation: Operation) -> tuple[Operation, str | None]:
            refusal = operation.deny_approval(
                approval_id=_open_approval_id(operation),
                approver=approver,
                approver_roles=roles,
                reason=reason,
                now=self._clock(),
                via=via,
            )
            return operation, refusal

        operation, refusal = self._runner.update(operation_id, command)
        if refusal is not None:
            raise _refused("denial", operation, refusal)
        return operation


# What a person can do about each refusal: a refusal that names no next step
# leaves them guessing.
_NEXT_STEP = {
    "proposal_hash_mismatch": "the hash is not the one of this call: show the approval again"
    " and approve the hash it shows now",
    "not_an_approver": "this call needs an approver holding one of the roles {roles}",
    "duplicate_approver": "you approved it already; it waits for {missing}",
    "requester_cannot_approve": "the person who asked may not approve their own call:"
    " ask another approver",
    "expired": "the approval expired and the call will not run: the host must propose it again",
    "approval_consumed": "the call was decided already ({state})",
    "unknown_approval": "no such approval request for this operation",
    "preview_pending": "the tool's preview of this call has not arrived yet: show the"
    " approval again once it shows what the call would do",
    "preview_failed": "the tool could not preview this call, so there is no effect to"
    " approve: deny it (the host may propose it again)",
    "preview_hash_mismatch": "the preview is not the one of this call: show the approval"
    " again and approve the preview it shows now",
}


def _refused(what: str, operation: Operation, refusal: str) -> ApprovalRefused:
    approval = operation.approval
    hint = _NEXT_STEP.get(refusal, "").format(
        roles=", ".join(approval.approver_roles) if approval else "-",
        missing=approval.still_needed(operation.approvals_given) if approval else "-",
        state=operation.state.value,
    )
    return ApprovalRefused(
        f"{what} refused: {refusal}" + (f" ({hint})" if hint else ""),
        operation_id=operation.id,
        reason=refusal,
    )


def _open_approval_id(operation: Operation) -> str:
    return operation.approval.approval_id if operation.approval is not None else ""
