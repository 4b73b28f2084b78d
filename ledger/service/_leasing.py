"""Leasing: the executor's question "may I run this work item now?", answered once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from ledger.domain.errors import InvalidArgument, LedgerError, OperationNotFound
from ledger.domain.operation import Operation
from ledger.domain.states import OperationState
from ledger.service._contracts import PinnedContracts
from ledger.service._runner import CommandRunner
from policy import DEFAULT_LIMITS, ToolContract, json_value_issue
from schemas import (
    PREVIEW_MAX_BYTES,
    CanonicalizationError,
    LeaseDecision,
    LeaseReply,
    PreviewReport,
    RuntimeContext,
    canonical_json,
)

__all__ = ["LeaseRequest", "Leasing"]

LeaseRequest = tuple[str, str, str | None]
"""(operation ID, executor, the tool the executor is authenticated for, if known)."""


class Leasing:
    """Grants leases with fencing tokens; answers redeliveries and stale work."""

    def __init__(
        self,
        runner: CommandRunner,
        contracts: PinnedContracts,
        *,
        clock: Callable[[], datetime],
        lease_grace: timedelta,
    ) -> None:
        self._runner = runner
        self._contracts = contracts
        self._clock = clock
        # A lease lasts the contract's timeout plus this grace, so that a
        # result sent at the last moment of the timeout still arrives in time.
        self._lease_grace = lease_grace

    def lease_many(self, requests: Sequence[LeaseRequest]) -> list[LeaseReply | LedgerError]:
        """Answer many lease requests with one append.

        `tool` is the tool the executor is authenticated for (from its subject);
        an operation of another tool is answered `OperationNotFound`, exactly
        as an unknown ID is, and nothing is appended.
        READY: a new lease and fencing token, with the exact approved arguments;
        a scheduled retry before its `not_before`: BUSY with `not_before`.
        READY but its approval lapsed, or its contract no longer in force: the
        call is refused (`ExecutionRefused`) and answered DONE.
        A live lease held by someone: BUSY (try later). An expired lease or an
        unknown outcome: RECONCILE (look the outcome up, never run again), but
        BUSY with `not_before` until its next lookup is due. Anything final, or
        waiting for a person (`needs_resolution`): DONE, which is how
        redelivered work items converge. Awaiting an approval that waits for the
        tool's preview: PREVIEW (run it and send it back, `record_preview`).
        """
        now = self._clock()
        return self._runner.batch(
            [
                (operation_id, partial(self._lease, executor=executor, tool=tool, now=now))
                for operation_id, executor, tool in requests
            ]
        )

    def check_in(self, operation_id: str, *, tool: str | None, holding: int) -> LeaseReply:
        """An executor running the call under fencing token `holding` asks whether to go on.

        Nothing is appended. CANCEL: the operation was cancelled while it runs
        (stop if nothing happened yet, and report either way); EXECUTE: go on;
        DONE: the lease is no longer this executor's (another token, or settled).
        An operation of another tool is `OperationNotFound`, as for a lease.
        """
        operation = self._runner.current(operation_id)
        if tool is not None and operation.tool != tool:
            raise OperationNotFound("no such operation", operation_id=operation_id)
        if operation.fencing_token != holding or operation.state not in (
            OperationState.EXECUTING,
            OperationState.CANCEL_REQUESTED,
        ):
            return _done(operation)
        decision = (
            LeaseDecision.CANCEL
            if operation.state is OperationState.CANCEL_REQUESTED
            else LeaseDecision.EXECUTE
        )
        lease = operation.lease
        return LeaseReply(
            decision=decision,
            operation_id=operation.id,
            tool=operation.tool,
            tool_version=operation.tool_version,
            fencing_token=holding,
            attempt=operation.attempt,
            lease_expires_at=lease.expires_at if lease is not None else None,
            reason="cancel requested" if decision is LeaseDecision.CANCEL else "",
        )

    def record_preview(
        self, operation_id: str, *, tool: str | None, executor: str, report: PreviewReport
    ) -> LeaseReply:
        """An executor sends the preview it ran after a `preview` answer; answered DONE.

        The first preview of a call awaiting approval is recorded (`PreviewRecorded`);
        any later one converges on it and appends nothing. An operation of another
        tool is `OperationNotFound`, as for a lease. A report that is not plain JSON
        or is over `PREVIEW_MAX_BYTES` is refused (`InvalidArgument`) before anything
        is stored: approvers are shown it, and the event must stay storable.
        """
        # The values as sent (JSON mode would write a NaN as null, and hide it).
        issue = json_value_issue(report.effect, DEFAULT_LIMITS.max_depth) or (
            json_value_issue(report.error.safe_details, DEFAULT_LIMITS.max_depth)
            if report.error is not None
            else None
        )
        if issue is not None:
            raise InvalidArgument(f"the preview is not plain JSON: {issue.message}")
        try:
            size = len(canonical_json(report.model_dump(mode="json", exclude_none=True)))
        except CanonicalizationError:
            raise InvalidArgument("the preview is not plain JSON") from None
        if size > PREVIEW_MAX_BYTES:
            raise InvalidArgument(f"the preview is over {PREVIEW_MAX_BYTES} bytes")

        def command(operation: Operation) -> tuple[Operation, LeaseReply]:
            if tool is not None and operation.tool != tool:
                raise OperationNotFound("no such operation", operation_id=operation.id)
            recorded = operation.record_preview(executor=executor, report=report, now=self._clock())
            reply = _done(operation)
            if recorded:
                reply = reply.model_copy(update={"reason": "preview recorded"})
            return operation, reply

        _, reply = self._runner.update(operation_id, command)
        return reply

    def _permission_change(self, operation: Operation, contract: ToolContract | None) -> str | None:
        """Why the call no longer holds under the contract in force (None: it does)."""
        if contract is None:
            current = self._contracts.get(operation.tool)
            return (
                f"checked against {operation.tool} {operation.tool_version}, in force"
                f" now: {current.version if current is not None else 'no contract'}"
            )
        missing = _missing_capabilities(operation, contract)
        if missing:
            # The caller's recorded capabilities no longer cover what the contract in
            # force requires (a catalog reloaded under the same version with a wider
            # requirement): not run.
            return (
                f"{operation.tool} {contract.version} now requires"
                f" {', '.join(missing)}, which the caller did not hold"
            )
        return None

    def _lease(
        self, operation: Operation, *, executor: str, tool: str | None, now: datetime
    ) -> LeaseReply:
        if tool is not None and operation.tool != tool:
            # Exactly the answer for an ID nobody used: an executor of one tool
            # must not learn which operations other tools have.
            raise OperationNotFound("no such operation", operation_id=operation.id)
        state = operation.state
        contract = self._contracts.of(operation)
        timeout_ms = (
            contract.timeout_ms if contract else int(self._lease_grace.total_seconds() * 1000)
        )
        lookup_ttl = timedelta(milliseconds=timeout_ms) + self._lease_grace
        if (
            state is OperationState.AWAITING_APPROVAL
            and operation.preview_requested
            and operation.preview_hash is None
        ):
            # A dry run for the approvers: no lease and nothing appended (it has no
            # side effect, so two executors previewing at once is harmless).
            reply = _lease_reply(LeaseDecision.PREVIEW, operation, None, timeout_ms)
            return reply.model_copy(update={"attempt": 1, "lease_expires_at": None})
        if state is OperationState.READY:
            # Checked again now, not only at the proposal: the approval's window
            # and the contract in force (seed 001's permission_changed).
            approval = operation.approval
            if approval is not None and operation.approval_lapsed(now):
                operation.refuse_execution(
                    code="approval_expired",
                    reason=f"approved until {approval.expires_at}, leased at {now}",
                    now=now,
                )
                return _done(operation)
            changed = self._permission_change(operation, contract)
            if changed is not None:
                operation.refuse_execution(code="permission_changed", reason=changed, now=now)
                return _done(operation)
            assert contract is not None  # no change means the pinned contract is in force
            if operation.not_before is not None and now < operation.not_before:
                # A scheduled retry's backoff: the executor waits (a delayed nak)
                # until then, rather than asking again and again.
                return _busy_until(operation, operation.not_before, "retry")
            ttl = timedelta(milliseconds=timeout_ms) + self._lease_grace
            checked: dict[str, Any] = {"contract_version": contract.version}
            if operation.approval is not None:
                checked["approval_valid_until"] = operation.approval.expires_at.isoformat()
            token = operation.claim_lease(executor=executor, ttl=ttl, now=now, checked=checked)
            return _lease_reply(LeaseDecision.EXECUTE, operation, token, timeout_ms)
        if state in (OperationState.EXECUTING, OperationState.CANCEL_REQUESTED):
            lease = operation.lease
            if lease is not None and lease.expires_at > now:
                return LeaseReply(
                    decision=LeaseDecision.BUSY,
                    operation_id=operation.id,
                    reason=f"leased to {lease.executor} until {lease.expires_at}",
                )
            operation.expire_lease(now)
        if operation.state is OperationState.OUTCOME_UNKNOWN:
            if operation.not_before is not None and now < operation.not_before:
                # The next lookup's time has not come (a hung call may still land,
                # or the last lookup was inconclusive): back then, not spinning.
                return _busy_until(operation, operation.not_before, "look the outcome up")
            operation.start_reconciliation(by=executor, now=now, ttl=lookup_ttl)
        elif operation.state is OperationState.RECONCILING:
            if operation.lookup_live(now):
                # One lookup at a time: a second executor (a redelivered item beside
                # the lookup item) waits, so that one lookup counts as one round.
                return LeaseReply(
                    decision=LeaseDecision.BUSY,
                    operation_id=operation.id,
                    lease_expires_at=operation.lookup_expires_at,
                    reason=f"being looked up until {operation.lookup_expires_at}",
                )
            # The last lookup's executor ran out of time without an answer: again.
            operation.start_reconciliation(by=executor, now=now, ttl=lookup_ttl)
        if operation.state is OperationState.RECONCILING:
            reply = _lease_reply(
                LeaseDecision.RECONCILE, operation, operation.fencing_token, timeout_ms
            )
            return reply.model_copy(update={"lookup": operation.reconcile_rounds + 1})
        return _done(operation)


def _missing_capabilities(operation: Operation, contract: ToolContract) -> list[str]:
    if operation.capabilities is None:
        return []  # proposed before capabilities were recorded: checked at the proposal only
    return sorted(contract.required_capabilities - set(operation.capabilities))


def _context(operation: Operation) -> RuntimeContext:
    """The trusted runtime context the call runs for, from the ledger's own record."""
    return RuntimeContext(
        principal=operation.actor,
        tenant=operation.tenant,
        capabilities=frozenset(operation.capabilities or ()),
        environment=operation.environment,
    )


def _busy_until(operation: Operation, not_before: datetime, what: str) -> LeaseReply:
    return LeaseReply(
        decision=LeaseDecision.BUSY,
        operation_id=operation.id,
        not_before=not_before,
        reason=f"{what} not before {not_before}",
    )


def _done(operation: Operation) -> LeaseReply:
    return LeaseReply(
        decision=LeaseDecision.DONE, operation_id=operation.id, reason=operation.state.value
    )


def _lease_reply(
    decision: LeaseDecision, operation: Operation, token: int | None, timeout_ms: int
) -> LeaseReply:
    lease = operation.lease
    return LeaseReply(
        decision=decision,
        operation_id=operation.id,
        tool=operation.tool,
        tool_version=operation.tool_version,
        arguments=dict(operation.arguments or {}),
        fencing_token=token,
        attempt=operation.attempt,
        lease_expires_at=lease.expires_at if lease is not None else None,
        timeout_ms=timeout_ms,
        proposal_hash=operation.proposal_hash,
        preview_hash=operation.preview_hash,
        context=_context(operation),
    )
