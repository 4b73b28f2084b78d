"""One registry of the operation's event types, keyed by class.

Whatever the rest of the system needs to know about an event type, apart from
how it changes the aggregate (its `apply_to`), is declared here once: the
state it moves the operation to, as read models see it; whether it puts a
work item on the tool's queue (`dispatches`) or gives the host its outcome
(`settles`); and its one-line summary for people. The operations view, the
relay and the CLI read this registry, and a test fails when an event type of
`Operation` is missing from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ledger.domain.operation import Operation
from ledger.domain.states import OperationState
from schemas import WorkPurpose

__all__ = ["EVENT_KINDS", "EventKind", "event_kind", "event_types", "when_text"]

S = OperationState

StateAfter = Callable[[Mapping[str, Any], OperationState], OperationState]
"""The state after an event, from the event's stored fields and the state before it."""


@dataclass(frozen=True, slots=True)
class EventKind:
    """What one event type means outside the aggregate."""

    event: type[Operation.Event]
    summary: Callable[[Any], str]
    """A one-line account of one event of this type, for people."""
    state: OperationState | StateAfter | None = None
    """The state the operation is in after it; None: unchanged."""
    dispatches: WorkPurpose | None = None
    """After it, the operation needs a work item on its tool's queue: to run an attempt
    (it became ready) or to look an attempt's outcome up (it became unknown)."""
    settles: bool = False
    """After it, the operation has an outcome its host is told of."""
    notifies: bool = False
    """After it, the host is told of a state that is not final (it needs a person)."""

    @property
    def name(self) -> str:
        """The event type's name (the last part of its stored topic)."""
        return self.event.__name__

    def state_after(self, fields: Mapping[str, Any], before: OperationState) -> OperationState:
        """The operation's state after an event of this type with these stored fields."""
        if self.state is None:
            return before
        if isinstance(self.state, OperationState):
            return self.state
        return self.state(fields, before)


def _short(digest: str | None) -> str:
    return digest[:12] if digest else "-"


def when_text(value: str | datetime | None) -> str:
    """A timestamp as `YYYY-MM-DD HH:MM:SS` UTC (the ledger stores UTC)."""
    if value is None:
        return "-"
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _via(channel: str) -> str:
    """How an approver's word came (`ApprovalGranted.via`): said where it is not NATS."""
    return {"web": " on the approval page", "break_glass": " (break glass)"}.get(channel, "")


def _as_roles(roles: list[str]) -> str:
    return f" as {', '.join(roles)}" if roles else ""


def _reconciled(fields: Mapping[str, Any], _before: OperationState) -> OperationState:
    return S.SUCCEEDED if fields["outcome"] == "succeeded" else S.FAILED


def _execution_refused(fields: Mapping[str, Any], _before: OperationState) -> OperationState:
    return S.APPROVAL_EXPIRED if fields["code"] == "approval_expired" else S.REJECTED


def _cancel_requested(_fields: Mapping[str, Any], before: OperationState) -> OperationState:
    # Only a running operation waits for its executor; anything else is
    # cancelled by the `Cancelled` that follows in the same append.
    return S.CANCEL_REQUESTED if before is S.EXECUTING else before


Op = Operation

_KINDS = (
    EventKind(
        Op.Proposed,
        lambda e: (
            f"{e.actor} proposed {e.tool} ({e.tenant}, {e.environment})"
            + (f"; run again by {e.proposed_by}, retrying {e.retries}" if e.retries else "")
        ),
        state=S.PROPOSED,
    ),
    EventKind(
        Op.Validated,
        lambda e: (
            f"checked against {e.tool_version}: risk {e.risk}, proposal {_short(e.proposal_hash)}"
        ),
        state=S.VALIDATED,
    ),
    EventKind(
        Op.Rejected,
        lambda e: f"rejected ({e.category}): {', '.join(e.reason_codes) or '-'}",
        state=S.REJECTED,
        settles=True,
    ),
    EventKind(
        Op.ClarificationNeeded,
        lambda e: f"needs the user: {e.question}",
        state=S.NEEDS_CLARIFICATION,
        settles=True,
    ),
    EventKind(
        Op.ApprovalRequested,
        lambda e: (
            f"approval {e.approval_id} requested: {e.required_approvals} from "
            f"{', '.join(e.approver_roles)}, expires {when_text(e.expires_at)}"
        ),
        state=S.AWAITING_APPROVAL,
    ),
    EventKind(
        Op.PreviewRequested,
        lambda _e: "preview requested from the tool's executor",
        dispatches=WorkPurpose.PREVIEW,
    ),
    EventKind(
        Op.PreviewRecorded,
        lambda e: (
            f"previewed by {e.executor}"
            + (f": {e.report['error'].get('code')}" if "error" in e.report else "")
            + f", preview {_short(e.preview_hash)}"
        ),
    ),
    EventKind(
        Op.ApprovalGranted,
        lambda e: f"approved by {e.approver}{_as_roles(e.approver_roles)}{_via(e.via)}",
    ),
    EventKind(
        Op.ApprovalRefused,
        lambda e: (
            f"{'denial' if e.decision == 'deny' else 'approval'} by {e.approver}"
            f"{_via(e.via)} refused: {e.reason}"
        ),
    ),
    EventKind(
        Op.ApprovalDenied,
        lambda e: f"denied by {e.approver}{_via(e.via)}" + (f": {e.reason}" if e.reason else ""),
        state=S.APPROVAL_DENIED,
        settles=True,
    ),
    EventKind(
        Op.ApprovalExpired,
        lambda e: f"approval {e.approval_id} expired",
        state=S.APPROVAL_EXPIRED,
        settles=True,
    ),
    EventKind(
        Op.Readied,
        lambda e: (
            f"ready to run (approved by {', '.join(e.approvers)})"
            if e.approvers
            else "ready to run"
        ),
        state=S.READY,
        dispatches=WorkPurpose.EXECUTE,
    ),
    EventKind(
        Op.LeaseClaimed,
        lambda e: (
            f"leased to {e.executor}: attempt {e.attempt}, token {e.fencing_token}, "
            f"until {when_text(e.lease_expires_at)}"
        ),
        state=S.EXECUTING,
    ),
    EventKind(
        Op.LeaseExpired,
        lambda e: f"lease {e.fencing_token} expired; outcome unknown",
        state=S.OUTCOME_UNKNOWN,
        dispatches=WorkPurpose.RECONCILE,
    ),
    EventKind(
        Op.ExecutionRefused,
        lambda e: f"refused at execution ({e.code}): {e.reason}",
        state=_execution_refused,
        settles=True,
    ),
    EventKind(
        Op.Succeeded,
        lambda e: f"succeeded on attempt {e.attempt}, output {_short(e.output_hash)}",
        state=S.SUCCEEDED,
        settles=True,
    ),
    EventKind(
        Op.Failed,
        lambda e: (
            f"failed on attempt {e.attempt}: {e.code} ({e.category})"
            + (", retryable" if e.retryable else "")
        ),
        state=S.FAILED,
        settles=True,
    ),
    EventKind(
        Op.OutcomeUnknown,
        lambda e: (
            f"outcome unknown on attempt {e.attempt}: {e.reason or '-'}"
            + (f"; looked up from {when_text(e.not_before)}" if e.not_before else "")
        ),
        state=S.OUTCOME_UNKNOWN,
        dispatches=WorkPurpose.RECONCILE,
    ),
    EventKind(
        Op.ReconciliationStarted,
        lambda e: f"reconciliation started by {e.by}",
        state=S.RECONCILING,
    ),
    EventKind(
        Op.Reconciled,
        lambda e: f"reconciled by {e.by}: {e.outcome}" + (f" ({e.reason})" if e.reason else ""),
        state=_reconciled,
        settles=True,
    ),
    EventKind(
        Op.ReconciliationInconclusive,
        lambda e: (
            f"lookup {e.round} by {e.by} inconclusive: {e.reason or '-'}"
            + (f"; next not before {when_text(e.not_before)}" if e.not_before else "")
        ),
        state=S.OUTCOME_UNKNOWN,
        dispatches=WorkPurpose.RECONCILE,
    ),
    EventKind(
        Op.ResolutionNeeded,
        lambda e: (
            f"needs a person: {e.reason}" + (f" ({e.lookup_reason})" if e.lookup_reason else "")
        ),
        state=S.NEEDS_RESOLUTION,
        notifies=True,
    ),
    EventKind(
        Op.RetryScheduled,
        lambda e: f"retry after attempt {e.after_attempt}, not before {when_text(e.not_before)}",
        state=S.READY,
        dispatches=WorkPurpose.EXECUTE,
    ),
    EventKind(
        Op.StaleResultRecorded,
        lambda e: (
            f"stale {e.outcome} from {e.executor} (token {e.fencing_token} < {e.current_token})"
        ),
    ),
    EventKind(
        Op.ConflictingOutcomeRecorded,
        lambda e: f"conflicting {e.outcome} from {e.executor} ignored; the outcome stands",
    ),
    EventKind(Op.RepairProposed, lambda e: f"repaired by {e.by}"),
    EventKind(
        Op.RetryProposed,
        lambda e: f"run again as {e.retry_id}, by {e.by} ({e.via}): {e.reason}",
    ),
    EventKind(
        Op.CompensationProposed,
        lambda e: f"to be undone by {e.compensation_id}, proposed by {e.by}"
        + (f": {e.reason}" if e.reason else ""),
    ),
    EventKind(
        Op.CancelRequested,
        lambda e: f"cancel requested by {e.by}" + (f": {e.reason}" if e.reason else ""),
        state=_cancel_requested,
    ),
    EventKind(
        Op.Cancelled,
        lambda e: f"cancelled by {e.by}",
        state=S.CANCELLED,
        settles=True,
    ),
    EventKind(
        Op.CancelTooLate,
        lambda e: f"cancel by {e.by} came too late: already {e.outcome}",
    ),
    EventKind(
        Op.PublicationSetAside,
        lambda e: f"the relay set aside version {e.version}: {e.reason}",
    ),
)

EVENT_KINDS: Mapping[type[Operation.Event], EventKind] = {kind.event: kind for kind in _KINDS}
"""Every event type of `Operation`, by class."""

_BY_NAME: Mapping[str, EventKind] = {kind.name: kind for kind in _KINDS}


def event_kind(name_or_topic: str) -> EventKind | None:
    """The kind of a stored event, by its type name or its full topic."""
    return _BY_NAME.get(name_or_topic.rsplit(".", 1)[-1])


def event_types() -> frozenset[type[Operation.Event]]:
    """Every concrete event class nested in `Operation` (for the registry's own test)."""
    return frozenset(
        value
        for value in vars(Operation).values()
        if isinstance(value, type)
        and issubclass(value, Operation.Event)
        and value is not Operation.Event
    )
