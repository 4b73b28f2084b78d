"""The Operation aggregate: one proposed tool call and everything that happened to it.

Commands are imperative methods that check invariants first and only then
trigger an event; an illegal command raises `IllegalTransition` and appends
nothing. Events are past-tense classes nested in the aggregate; their `apply`
methods are the only code that changes state, so replaying the history always
rebuilds the same operation. Every event carries the hash of the previous one
(`prev_hash`), and replay checks that chain.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from eventsourcing.domain import BaseAggregate
from pydantic import Field

from ledger.domain.approval_rules import (
    Refusal,
    approval_refusal,
    check_approver_name,
    same_person,
)
from ledger.domain.errors import IllegalTransition, InvalidArgument
from ledger.domain.events import ChainedEvent, LedgerCreatedEvent, start_chain
from ledger.domain.hashing import GENESIS_HASH
from ledger.domain.states import TERMINAL_STATES, OperationState, ResultDisposition
from ledger.domain.values import (
    Approval,
    ApprovalGiven,
    Lease,
    Outcome,
    OutcomeStatus,
    ReconcilePlan,
)
from schemas import (
    CANCELLED_BEFORE_EFFECT,
    RECONCILE_UNSUPPORTED,
    TRACEPARENT_PATTERN,
    PreviewReport,
    ResultOutcome,
    RiskLevel,
    RuntimeContext,
)

__all__ = ["ALLOWED", "Operation", "Refusal", "same_person"]

S = OperationState


_DEFAULT_PLAN = ReconcilePlan()


_TRACEPARENT = re.compile(TRACEPARENT_PATTERN)

_REASON_MAX = 500
"""The longest reason a person's command records (as the wire allows)."""


_DOING = {
    "deny_approval": "deny the approval",
    "expire_approval": "expire the approval",
    "request_approval": "ask for approval",
    "claim_lease": "lease it",
    "refuse_execution": "refuse to run",
    "expire_lease": "expire the lease",
    "record_result": "record a result",
    "schedule_retry": "retry",
    "note_retry": "run it again",
    "note_compensation": "undo it (only a call that succeeded is compensated)",
    "request_cancel": "cancel",
    "confirm_cancelled": "confirm the cancel",
}
"""What each guarded command does, as a person would say it (refusals are read by people)."""


# Which states each command may start from. The aggregate enforces it and the
# table-driven test walks every (state, command) pair against it.
ALLOWED: dict[str, frozenset[OperationState]] = {
    "validate": frozenset({S.PROPOSED}),
    "reject": frozenset({S.PROPOSED}),
    "ask_clarification": frozenset({S.PROPOSED}),
    "note_repair": frozenset({S.REJECTED}),
    "request_approval": frozenset({S.VALIDATED}),
    "mark_ready": frozenset({S.VALIDATED}),
    "grant_approval": frozenset(
        {
            S.AWAITING_APPROVAL,
            S.READY,
            S.EXECUTING,
            S.CANCEL_REQUESTED,
            S.SUCCEEDED,
            S.FAILED,
            S.OUTCOME_UNKNOWN,
            S.RECONCILING,
            S.NEEDS_RESOLUTION,
        }
    ),
    "request_preview": frozenset({S.AWAITING_APPROVAL}),
    "deny_approval": frozenset({S.AWAITING_APPROVAL}),
    "expire_approval": frozenset({S.AWAITING_APPROVAL}),
    "claim_lease": frozenset({S.READY}),
    "refuse_execution": frozenset({S.READY}),
    "expire_lease": frozenset({S.EXECUTING, S.CANCEL_REQUESTED}),
    "record_result": frozenset(
        {
            S.READY,
            S.EXECUTING,
            S.CANCEL_REQUESTED,
            S.OUTCOME_UNKNOWN,
            S.RECONCILING,
            S.NEEDS_RESOLUTION,
            S.SUCCEEDED,
            S.FAILED,
            S.CANCELLED,
        }
    ),
    "start_reconciliation": frozenset({S.OUTCOME_UNKNOWN, S.RECONCILING}),
    "reconcile": frozenset({S.OUTCOME_UNKNOWN, S.RECONCILING, S.NEEDS_RESOLUTION}),
    "schedule_retry": frozenset({S.FAILED}),
    "note_retry": frozenset({S.FAILED}),
    "note_compensation": frozenset({S.SUCCEEDED}),
    "request_cancel": frozenset(
        {
            S.PROPOSED,
            S.VALIDATED,
            S.AWAITING_APPROVAL,
            S.READY,
            S.EXECUTING,
            S.CANCEL_REQUESTED,
            S.SUCCEEDED,
            S.FAILED,
            S.CANCELLED,
            S.OUTCOME_UNKNOWN,
            S.RECONCILING,
            S.NEEDS_RESOLUTION,
        }
    ),
    "confirm_cancelled": frozenset({S.CANCEL_REQUESTED}),
    # A fact about the relay, not about the call: it never changes the state.
    "note_publication_set_aside": frozenset(S),
}


class Operation(BaseAggregate[str]):
    """A tool operation, keyed by its operation ID (the idempotency key end to end)."""

    # ------------------------------------------------------------------ events

    class Event(ChainedEvent):
        """Base of the operation's events: keeps the hash chain as they apply."""

    class Proposed(Event, LedgerCreatedEvent):
        """A host proposed a tool call. Nothing has been checked yet."""

        proposal: dict[str, Any]
        fingerprint: str
        actor: str
        tenant: str
        environment: str
        tool: str
        host: str = ""
        omitted: dict[str, Any] | None = None
        """What of the proposal's arguments was not kept, and why (`ledger.retention`)."""
        capabilities: list[str] | None = None
        """The caller's capabilities from its trusted runtime context, sorted (None in
        events stored before they were recorded)."""
        repairs: str | None = None
        """The ledger's ID of the rejected operation this proposal repairs."""
        repair_depth: int = 0
        """How many repairs precede this proposal in its chain (0: not a repair)."""
        omitted_when_none = frozenset(
            {"trace_parent", "retries", "proposed_by", "plan", "step", "compensates"}
        )

        trace_parent: str | None = None
        """The W3C `traceparent` of the ledger's check of this proposal (continuing the
        host's trace, if it sent one): the operation's later spans, on every process,
        join that trace. None when nobody traced it."""
        retries: str | None = None
        """The ledger's ID of the failed operation this one runs again (a person's
        retry: `RetryProposed` on that one); None for a host's own proposal."""
        proposed_by: str | None = None
        """Who proposed it when not the host: the person who retried (`operator:<name>`,
        `break-glass:<name>`), on behalf of `actor`."""
        plan: str | None = None
        """The ledger's ID of the plan this operation is a step of (None: a call of its
        own). Only the ledger's plan runner sets it: a host's proposal cannot."""
        step: str | None = None
        """The step of `plan` it runs."""
        compensates: str | None = None
        """The ledger's ID of the succeeded operation this one undoes (its contract's
        `compensation`); the other one records `CompensationProposed`."""

        def apply(self, aggregate: Any) -> None:
            start_chain(aggregate)
            super().apply(aggregate)

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.PROPOSED
            aggregate.proposal = self.proposal
            aggregate.fingerprint = self.fingerprint
            aggregate.actor = self.actor
            aggregate.tenant = self.tenant
            aggregate.environment = self.environment
            aggregate.tool = self.tool
            aggregate.host = self.host
            aggregate.capabilities = None if self.capabilities is None else tuple(self.capabilities)
            aggregate.repairs = self.repairs
            aggregate.repair_depth = self.repair_depth
            aggregate.trace_parent = self.trace_parent
            aggregate.retries = self.retries
            aggregate.proposed_by = self.proposed_by
            aggregate.plan = self.plan
            aggregate.step = self.step
            aggregate.compensates = self.compensates
            aggregate.compensated_by = None
            aggregate.retried_as = None
            aggregate.success_reported_late = False
            aggregate.repaired_by = None
            aggregate.repairable = False
            aggregate.tool_version = None
            aggregate.input_schema_hash = None
            aggregate.output_schema_hash = None
            aggregate.proposal_hash = None
            aggregate.arguments = None
            aggregate.risk = None
            aggregate.max_attempts = 1
            aggregate.retry_on = []
            aggregate.issues = []
            aggregate.approval = None
            aggregate.approvers = []
            aggregate.approvals_given = ()
            aggregate.approval_consumed = False
            aggregate.preview_requested = False
            aggregate.preview = None
            aggregate.preview_hash = None
            aggregate.attempt = 0
            aggregate.fencing_token = 0
            aggregate.lease = None
            aggregate.leases = ()
            aggregate.outcome = None
            aggregate.cancel_requested = False
            aggregate.cancel_requested_by = ""
            aggregate.cancel_too_late = False
            aggregate.not_before = None
            aggregate.reconcile_rounds = 0
            aggregate.lookup_expires_at = None

    class Validated(Event):
        """The layered check passed: the call is well-formed, allowed, and its risk known."""

        tool_version: str
        input_schema_hash: str
        output_schema_hash: str
        proposal_hash: str
        arguments: dict[str, Any]
        applied_defaults: list[str]
        risk: str
        risk_reasons: list[str]
        max_attempts: int
        retry_on: list[str]

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.VALIDATED
            aggregate.tool_version = self.tool_version
            aggregate.input_schema_hash = self.input_schema_hash
            aggregate.output_schema_hash = self.output_schema_hash
            aggregate.proposal_hash = self.proposal_hash
            aggregate.arguments = self.arguments
            aggregate.risk = RiskLevel(self.risk)
            aggregate.max_attempts = self.max_attempts
            aggregate.retry_on = self.retry_on

    class Rejected(Event):
        """The layered check refused the call."""

        reason_codes: list[str]
        category: str
        repairable: bool
        issues: list[dict[str, Any]]
        tool_version: str | None = None

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.REJECTED
            aggregate.issues = self.issues
            aggregate.tool_version = self.tool_version
            aggregate.repairable = self.repairable
            aggregate.outcome = Outcome(OutcomeStatus.REJECTED, category=self.category)

    class ClarificationNeeded(Event):
        """Only the user can settle the call (an ambiguous reference): it will not run."""

        question: str
        reason_codes: list[str]
        issues: list[dict[str, Any]]
        tool_version: str | None = None

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.NEEDS_CLARIFICATION
            aggregate.issues = self.issues
            aggregate.tool_version = self.tool_version
            aggregate.outcome = Outcome(OutcomeStatus.NEEDS_CLARIFICATION, question=self.question)

    class ApprovalRequested(Event):
        """A human must approve this exact call before it can run."""

        approval_id: str
        effect_preview: dict[str, Any]
        approver_roles: list[str]
        required_approvals: int
        separation_of_duties: bool
        expires_at: datetime
        reason: str
        required_from: dict[str, int] = Field(default_factory=dict)
        """Role -> how many of the approvers must hold it (empty before M-of-N by role)."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.AWAITING_APPROVAL
            aggregate.approval = Approval(
                approval_id=self.approval_id,
                effect_preview=self.effect_preview,
                approver_roles=tuple(self.approver_roles),
                required_approvals=self.required_approvals,
                separation_of_duties=self.separation_of_duties,
                expires_at=self.expires_at,
                reason=self.reason,
                required_from=dict(self.required_from),
            )

    class PreviewRequested(Event):
        """The contract asks for the tool's own preview (a dry run on its executor)
        before anyone approves: approvals wait for it and name its digest."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.preview_requested = True

    class PreviewRecorded(Event):
        """An executor ran the tool's preview: what the call would do, as the approvers
        are shown it (`report`: a `schemas.PreviewReport`, `preview_hash` its digest)."""

        executor: str
        report: dict[str, Any]
        preview_hash: str

        def apply_to(self, aggregate: Any) -> None:
            aggregate.preview = self.report
            aggregate.preview_hash = self.preview_hash

    class ApprovalGranted(Event):
        """One approver approved the call bound to `proposal_hash` (and, for a previewed
        call, to `preview_hash`: the effect the approver was shown)."""

        approval_id: str
        approver: str
        proposal_hash: str
        approver_roles: list[str] = Field(default_factory=list)
        """The approver's roles among those requested, as the ledger knew them."""
        via: str = ""
        """`nats`: the approver's own NATS identity said so; `break_glass`: someone with
        the database wrote it directly. Empty in events from before it was recorded."""
        preview_hash: str | None = None
        """The digest of the tool's preview the approver was shown (`PreviewRecorded`);
        None for a call its contract does not preview."""
        omitted_when_none = frozenset({"preview_hash"})

        def apply_to(self, aggregate: Any) -> None:
            aggregate.approvers = [*aggregate.approvers, self.approver]
            given = ApprovalGiven(self.approver, frozenset(self.approver_roles), self.via)
            aggregate.approvals_given = (*aggregate.approvals_given, given)

    class ApprovalRefused(Event):
        """An approval or denial was refused; recorded so auditors see every attempt."""

        approval_id: str
        approver: str
        proposal_hash: str
        reason: str
        decision: str = "approve"
        """What was refused: `approve` or `deny`."""
        via: str = ""
        preview_hash: str | None = None
        """The preview digest the refused approval named, if any."""
        omitted_when_none = frozenset({"preview_hash"})

    class ApprovalDenied(Event):
        """An approver denied the call."""

        approval_id: str
        approver: str
        reason: str = ""
        approver_roles: list[str] = Field(default_factory=list)
        via: str = ""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.APPROVAL_DENIED
            aggregate.outcome = Outcome(OutcomeStatus.APPROVAL_DENIED, by=self.approver)

    class ApprovalExpired(Event):
        """Nobody approved in time."""

        approval_id: str

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.APPROVAL_EXPIRED
            aggregate.outcome = Outcome(OutcomeStatus.APPROVAL_EXPIRED)

    class Readied(Event):
        """The call may run: auto-approved, or its approvals are complete."""

        approval_id: str | None = None
        approvers: list[str] = Field(default_factory=list)

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.READY
            if self.approval_id is not None:
                aggregate.approval_consumed = True

    class LeaseClaimed(Event):
        """An executor holds the operation. Only results with this fencing token count."""

        executor: str
        fencing_token: int
        attempt: int
        lease_expires_at: datetime
        checked: dict[str, Any] = Field(default_factory=dict)
        """What the lease re-checked before handing the call out (contract version in
        force, until when the approval held); empty before these checks existed."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.EXECUTING
            aggregate.attempt = self.attempt
            aggregate.fencing_token = self.fencing_token
            aggregate.lease = Lease(
                executor=self.executor,
                fencing_token=self.fencing_token,
                attempt=self.attempt,
                expires_at=self.lease_expires_at,
            )
            aggregate.leases = (*aggregate.leases, aggregate.lease)

    class LeaseExpired(Event):
        """The executor did not report in time; the side effect may have happened."""

        fencing_token: int
        attempt: int = 0
        """The attempt whose lease ran out (0 in events stored before it was recorded)."""

        def apply_to(self, aggregate: Any) -> None:
            # Looked up at once: the lease already waited out the call.
            aggregate.state = S.OUTCOME_UNKNOWN
            aggregate.lease = None
            aggregate.not_before = None
            aggregate.reconcile_rounds = 0

    class ExecutionRefused(Event):
        """At the lease, the call no longer holds and will not run: its approval expired
        (`approval_expired`) or the contract it was checked against is no longer in
        force (`permission_changed`)."""

        code: Literal["approval_expired", "permission_changed"]
        reason: str

        def apply_to(self, aggregate: Any) -> None:
            if self.code == "approval_expired":
                aggregate.state = S.APPROVAL_EXPIRED
                aggregate.outcome = Outcome(OutcomeStatus.APPROVAL_EXPIRED, code=self.code)
            else:
                aggregate.state = S.REJECTED
                aggregate.outcome = Outcome(
                    OutcomeStatus.REJECTED, category="POLICY_DENIED", code=self.code
                )

    class Succeeded(Event):
        """The tool reported success with a result that passed its output contract."""

        fencing_token: int
        attempt: int
        executor: str
        output_hash: str
        result_ref: str
        envelope_hash: str = ""
        """SHA-256 of the exact envelope text kept under `result_ref` ("" before it existed)."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.SUCCEEDED
            aggregate.lease = None
            aggregate.outcome = Outcome(
                OutcomeStatus.SUCCEEDED,
                attempt=self.attempt,
                output_hash=self.output_hash,
                result_ref=self.result_ref,
                envelope_hash=self.envelope_hash,
            )

    class Failed(Event):
        """The tool reported a failure (or its result broke the output contract)."""

        fencing_token: int
        attempt: int
        executor: str
        code: str
        category: str
        retryable: bool
        result_ref: str = ""
        envelope_hash: str = ""
        """SHA-256 of the exact envelope text kept under `result_ref` ("" before it existed)."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.FAILED
            aggregate.lease = None
            aggregate.outcome = Outcome(
                OutcomeStatus.FAILED,
                attempt=self.attempt,
                code=self.code,
                category=self.category,
                retryable=self.retryable,
            )

    class OutcomeUnknown(Event):
        """The executor cannot tell whether the side effect happened."""

        fencing_token: int
        attempt: int
        executor: str
        reason: str
        not_before: datetime | None = None
        """The first lookup waits until then (a hung call may still land meanwhile)."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.OUTCOME_UNKNOWN
            aggregate.lease = None
            aggregate.not_before = self.not_before
            aggregate.reconcile_rounds = 0

    class ReconciliationStarted(Event):
        """Someone is looking the outcome up at the provider."""

        by: str
        lookup_expires_at: datetime | None = None
        """Until then the lookup is `by`'s alone (None in events stored before)."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.RECONCILING
            aggregate.lookup_expires_at = self.lookup_expires_at

    class Reconciled(Event):
        """The outcome was established after the fact."""

        outcome: str
        by: str
        output_hash: str = ""
        result_ref: str = ""
        code: str = ""
        category: str = ""
        retryable: bool = False
        envelope_hash: str = ""
        """SHA-256 of the exact envelope text kept under `result_ref`, when one was kept."""
        reason: str = ""
        """Why, when a person settled it (`opledger ops resolve`); "" for a lookup."""

        def apply_to(self, aggregate: Any) -> None:
            if self.outcome == "succeeded":
                aggregate.state = S.SUCCEEDED
                aggregate.outcome = Outcome(
                    OutcomeStatus.SUCCEEDED,
                    attempt=aggregate.attempt,
                    output_hash=self.output_hash,
                    result_ref=self.result_ref,
                    envelope_hash=self.envelope_hash,
                    reconciled=True,
                )
            else:
                aggregate.state = S.FAILED
                aggregate.outcome = Outcome(
                    OutcomeStatus.FAILED,
                    attempt=aggregate.attempt,
                    code=self.code,
                    category=self.category,
                    retryable=self.retryable,
                    reconciled=True,
                )

    class ReconciliationInconclusive(Event):
        """A lookup could not tell what happened; a later round (or a person) must."""

        by: str
        reason: str = ""
        round: int = 0
        """Which lookup of this attempt's outcome this was (1, 2, ...); 0 before rounds."""
        not_before: datetime | None = None
        """The next round is not leased before this."""
        code: str = ""
        """The executor's error code (`RECONCILE_INCONCLUSIVE`, `RECONCILE_FAILED`)."""
        attempt: int = 0
        """The attempt whose outcome was looked up (0 in events stored before it was)."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.OUTCOME_UNKNOWN
            aggregate.not_before = self.not_before
            aggregate.reconcile_rounds = self.round

    class ResolutionNeeded(Event):
        """Reconciliation gave up: a person must say what happened (`ops resolve`).

        It stands for the last, inconclusive lookup too (who made it, its code),
        so that no lookup is left waiting for a round that will not come.
        """

        by: str
        reason: str
        rounds: int
        """How many lookups could not tell."""
        code: str = ""
        lookup_reason: str = ""
        """What the last lookup said."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.NEEDS_RESOLUTION
            aggregate.not_before = None

    class RetryScheduled(Event):
        """A failed attempt will be retried; the operation is ready again."""

        after_attempt: int
        not_before: datetime

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.READY
            aggregate.outcome = None
            aggregate.not_before = self.not_before

    class StaleResultRecorded(Event):
        """A result arrived with an old fencing token; it changes nothing."""

        fencing_token: int
        current_token: int
        executor: str
        outcome: str

    class ConflictingOutcomeRecorded(Event):
        """A different outcome arrived for a finished operation; the outcome stands."""

        fencing_token: int
        executor: str
        outcome: str
        output_hash: str = ""

        def apply_to(self, aggregate: Any) -> None:
            if self.outcome == "succeeded":
                aggregate.success_reported_late = True

    class RetryProposed(Event):
        """A person runs this failed call again, as a new operation (`retry_id`): this
        one's outcome, already announced as final, stands."""

        retry_id: str
        """The ledger's ID of the new operation."""
        by: str
        """Who retried it: `operator:<name>` over NATS, `break-glass:<name>` without."""
        reason: str
        via: str
        """How the request came: `nats` (an operator's own identity) or `break_glass`."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.retried_as = self.retry_id

    class CompensationProposed(Event):
        """Someone proposed undoing this succeeded call, as an operation of its own
        (`compensation_id`: checked, approved and run like any call). This one's outcome
        stands: it happened."""

        compensation_id: str
        by: str
        reason: str

        def apply_to(self, aggregate: Any) -> None:
            aggregate.compensated_by = self.compensation_id

    class RepairProposed(Event):
        """A new proposal repairs this rejected one (at most one may: the chain is linear)."""

        by: str
        """The ledger's ID of the repairing operation."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.repaired_by = self.by

    class CancelRequested(Event):
        """Someone asked to cancel the operation."""

        by: str
        reason: str = ""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.cancel_requested = True
            aggregate.cancel_requested_by = self.by
            if aggregate.state in (S.EXECUTING,):
                aggregate.state = S.CANCEL_REQUESTED

    class Cancelled(Event):
        """The operation will never run (or its executor confirmed it did not)."""

        by: str

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = S.CANCELLED
            aggregate.lease = None
            aggregate.outcome = Outcome(OutcomeStatus.CANCELLED, by=self.by)

    class CancelTooLate(Event):
        """A cancellation arrived after the side effect had happened."""

        by: str
        outcome: str

        def apply_to(self, aggregate: Any) -> None:
            aggregate.cancel_too_late = True

    class PublicationSetAside(Event):
        """The relay could not publish this operation's event at `version` and moved on.

        Recorded so that the gap in the feed is explained in the ledger itself
        (an auditor comparing store and feed sees why), while one event no
        message can carry never stops the feed, outcomes and work for everyone.
        """

        position: int
        version: int
        reason: str

    # ---------------------------------------------------------------- state
    # Set only by the events' apply methods. Declared for readers and mypy under
    # TYPE_CHECKING: class-level annotations would make the library turn the
    # aggregate into a dataclass with a generated __init__.
    if TYPE_CHECKING:
        state: OperationState
        head_hash: str
        history_bytes: int
        proposal: dict[str, Any]
        fingerprint: str
        actor: str
        tenant: str
        environment: str
        tool: str
        host: str
        capabilities: tuple[str, ...] | None
        """The caller's capabilities as proposed (None: not recorded, an old operation)."""
        repairs: str | None
        """The rejected operation this one repairs (`Proposed.repairs`)."""
        repair_depth: int
        trace_parent: str | None
        """The traceparent this operation's spans continue (`Proposed.trace_parent`)."""
        retries: str | None
        """The failed operation this one runs again (`Proposed.retries`)."""
        proposed_by: str | None
        plan: str | None
        """The plan this operation is a step of (`Proposed.plan`), and which step."""
        step: str | None
        compensates: str | None
        """The operation this one undoes (`Proposed.compensates`)."""
        compensated_by: str | None
        """The operation proposed to undo this one (`CompensationProposed`)."""
        retried_as: str | None
        """The operation that runs this failed one again, once a person retried it."""
        success_reported_late: bool
        """An executor reported success after the outcome was settled otherwise
        (`ConflictingOutcomeRecorded`): evidence the effect happened after all."""
        repaired_by: str | None
        """The operation that repairs this rejected one, once one does."""
        repairable: bool
        """Rejected with findings a model may repair."""
        tool_version: str | None
        input_schema_hash: str | None
        output_schema_hash: str | None
        proposal_hash: str | None
        arguments: dict[str, Any] | None
        risk: RiskLevel | None
        max_attempts: int
        retry_on: list[str]
        issues: list[dict[str, Any]]
        approval: Approval | None
        approvers: list[str]
        approvals_given: tuple[ApprovalGiven, ...]
        """The approvals that count, with each approver's roles (`ApprovalGranted`)."""
        approval_consumed: bool
        preview_requested: bool
        """The contract asked for the tool's preview before approval (`PreviewRequested`)."""
        preview: dict[str, Any] | None
        """The recorded preview report (`PreviewRecorded`), None until one arrives."""
        preview_hash: str | None
        """Its digest: what an approval of this call names, and the executor checks."""
        attempt: int
        fencing_token: int
        lease: Lease | None
        leases: tuple[Lease, ...]
        outcome: Outcome | None
        cancel_requested: bool
        cancel_requested_by: str
        """Who asked to cancel (`CancelRequested.by`), "" if nobody did."""
        cancel_too_late: bool
        """A cancel came after the effect (`CancelTooLate`): the outcome says what happened."""
        lookup_expires_at: datetime | None
        """While reconciling: the running lookup is its executor's alone until then."""
        not_before: datetime | None
        """A scheduled retry, or the next lookup of an unknown outcome, is not leased
        before this time (`RetryScheduled`, `OutcomeUnknown`, `ReconciliationInconclusive`)."""
        reconcile_rounds: int
        """How many lookups of the current attempt's unknown outcome were inconclusive."""

    # ------------------------------------------------------------- commands

    @classmethod
    def propose(
        cls,
        operation_id: str,
        *,
        proposal: dict[str, Any],
        fingerprint: str,
        actor: str,
        tenant: str,
        environment: str,
        tool: str,
        now: datetime,
        host: str = "",
        omitted: dict[str, Any] | None = None,
        capabilities: Iterable[str] | None = None,
        repairs: str | None = None,
        repair_depth: int = 0,
        trace_parent: str | None = None,
        retries: str | None = None,
        proposed_by: str | None = None,
        plan: str | None = None,
        step: str | None = None,
        compensates: str | None = None,
    ) -> Operation:
        """Record a new proposal under `operation_id` (`omitted`: what of it was not kept;
        `capabilities`: the caller's, from its trusted runtime context; `trace_parent`:
        the W3C traceparent its later spans continue; `retries` and `proposed_by`: the
        failed operation a person runs again, and who; `plan` and `step`: the plan
        step it runs)."""
        if (plan is None) != (step is None):
            raise InvalidArgument("a plan step names its plan and its step")
        if trace_parent is not None and not _TRACEPARENT.match(trace_parent):
            raise InvalidArgument("trace_parent is not a W3C traceparent")
        return cls._create(
            cls.Proposed,
            id=operation_id,
            timestamp=now,
            prev_hash=GENESIS_HASH,
            proposal=proposal,
            fingerprint=fingerprint,
            actor=actor,
            tenant=tenant,
            environment=environment,
            tool=tool,
            host=host,
            omitted=omitted,
            capabilities=None if capabilities is None else sorted(capabilities),
            repairs=repairs,
            repair_depth=repair_depth,
            trace_parent=trace_parent,
            retries=retries,
            proposed_by=proposed_by,
            plan=plan,
            step=step,
            compensates=compensates,
        )

    def _guard(self, command: str) -> None:
        if self.state not in ALLOWED[command]:
            doing = _DOING.get(command, command.replace("_", " "))
            waits = "" if self.state in TERMINAL_STATES else " (it is still under way)"
            raise IllegalTransition(
                f"cannot {doing} now: the operation is {self.state.value}{waits};"
                " `opledger ops show` says what happened",
                operation_id=self.id,
                state=self.state.value,
                command=command,
            )

    def _trigger(self, event_class: type[Event], now: datetime, **kwargs: Any) -> None:
        self.trigger_event(event_class, timestamp=now, prev_hash=self.head_hash, **kwargs)

    def validate(
        self,
        *,
        tool_version: str,
        input_schema_hash: str,
        output_schema_hash: str,
        proposal_hash: str,
        arguments: dict[str, Any],
        applied_defaults: list[str],
        risk: str,
        risk_reasons: list[str],
        max_attempts: int,
        retry_on: list[str],
        now: datetime,
    ) -> None:
        """Record that the layered check passed."""
        self._guard("validate")
        self._trigger(
            self.Validated,
            now,
            tool_version=tool_version,
            input_schema_hash=input_schema_hash,
            output_schema_hash=output_schema_hash,
            proposal_hash=proposal_hash,
            arguments=arguments,
            applied_defaults=applied_defaults,
            risk=risk,
            risk_reasons=risk_reasons,
            max_attempts=max_attempts,
            retry_on=retry_on,
        )

    def reject(
        self,
        *,
        issues: list[dict[str, Any]],
        category: str,
        repairable: bool,
        tool_version: str | None,
        now: datetime,
    ) -> None:
        """Record that the layered check refused the call."""
        self._guard("reject")
        self._trigger(
            self.Rejected,
            now,
            reason_codes=[str(issue["code"]) for issue in issues],
            category=category,
            repairable=repairable,
            issues=issues,
            tool_version=tool_version,
        )

    def ask_clarification(
        self,
        *,
        question: str,
        issues: list[dict[str, Any]],
        tool_version: str | None,
        now: datetime,
    ) -> None:
        """Record that the check found a question only the user can answer."""
        self._guard("ask_clarification")
        self._trigger(
            self.ClarificationNeeded,
            now,
            question=question[:1000],
            reason_codes=[str(issue["code"]) for issue in issues],
            issues=issues,
            tool_version=tool_version,
        )

    def note_repair(self, *, by: str, now: datetime) -> None:
        """Record that operation `by` repairs this rejected one; a second repair is refused."""
        self._guard("note_repair")
        if self.repaired_by is not None and self.repaired_by != by:
            raise IllegalTransition(f"already repaired by {self.repaired_by}", operation_id=self.id)
        if self.repaired_by == by:
            return  # the same repair again: converge, append nothing
        self._trigger(self.RepairProposed, now, by=by)

    def request_approval(
        self,
        *,
        approval_id: str,
        effect_preview: dict[str, Any],
        approver_roles: list[str],
        required_approvals: int,
        separation_of_duties: bool,
        expires_at: datetime,
        reason: str,
        now: datetime,
        required_from: dict[str, int] | None = None,
    ) -> None:
        """Ask for human approval of exactly this call."""
        self._guard("request_approval")
        shares = dict(required_from or {})
        if required_approvals < 1:
            raise InvalidArgument("required_approvals must be at least 1")
        if any(role not in approver_roles or n < 1 for role, n in shares.items()):
            raise InvalidArgument("required_from names a role that may not approve, or none")
        if sum(shares.values()) > required_approvals:
            raise InvalidArgument("required_from asks for more approvers than required")
        self._trigger(
            self.ApprovalRequested,
            now,
            approval_id=approval_id,
            effect_preview=effect_preview,
            approver_roles=approver_roles,
            required_approvals=required_approvals,
            separation_of_duties=separation_of_duties,
            expires_at=expires_at,
            reason=reason,
            required_from=shares,
        )

    def request_preview(self, now: datetime) -> None:
        """Ask the tool's executor for a preview of this call before anyone approves it."""
        self._guard("request_preview")
        if not self.preview_requested:
            self._trigger(self.PreviewRequested, now)

    def record_preview(self, *, executor: str, report: PreviewReport, now: datetime) -> bool:
        """Record the first preview of a call that awaits approval; returns whether it did.

        A second preview (a redelivered item, a second executor) and one arriving after
        the approval was decided converge on the first: approvers may already have
        approved what it showed, so it never changes.
        """
        if (
            not self.preview_requested
            or self.preview_hash is not None
            or self.state is not S.AWAITING_APPROVAL
        ):
            return False
        self._trigger(
            self.PreviewRecorded,
            now,
            executor=executor,
            report=report.model_dump(mode="json", exclude_none=True),
            preview_hash=report.digest(),
        )
        return True

    def mark_ready(self, now: datetime) -> None:
        """Auto-approved: the call may run."""
        self._guard("mark_ready")
        self._trigger(self.Readied, now)

    def mark_ready_in_plan(self, *, approval_id: str, approvers: list[str], now: datetime) -> None:
        """The call may run: it is a step of a plan whose one approval covers it
        (`approval_id`, `approvers`: the plan's)."""
        self._guard("mark_ready")
        if self.plan is None:
            raise IllegalTransition("only a plan's step is approved with its plan",
                                    operation_id=self.id)
        self._trigger(self.Readied, now, approval_id=approval_id, approvers=approvers)

    def grant_approval(
        self,
        *,
        approval_id: str,
        approver: str,
        approver_roles: frozenset[str],
        proposal_hash: str,
        now: datetime,
        via: str = "",
        preview_hash: str | None = None,
    ) -> Refusal | None:
        """Approve; returns the refusal reason (recorded as an event) when refused.

        `via` says how the approver's word reached the ledger (`nats`, `web`,
        `break_glass`). A call whose contract asks for a preview is approved only
        once its preview is recorded, and only by naming that preview's digest.
        """
        check_approver_name(approver)
        if self.state not in ALLOWED["grant_approval"] or self.approval is None:
            raise IllegalTransition(
                f"cannot grant approval to an operation that is {self.state.value}",
                operation_id=self.id,
                state=self.state.value,
                command="grant_approval",
            )
        refusal = self._approval_refusal(
            approval_id, approver, approver_roles, proposal_hash, preview_hash, now
        )
        if refusal is not None:
            self._trigger(
                self.ApprovalRefused,
                now,
                approval_id=approval_id,
                approver=approver,
                proposal_hash=proposal_hash,
                reason=refusal,
                via=via,
                preview_hash=preview_hash,
            )
            if refusal == "expired":
                self._trigger(self.ApprovalExpired, now, approval_id=self.approval.approval_id)
            return refusal
        self._trigger(
            self.ApprovalGranted,
            now,
            approval_id=approval_id,
            approver=approver,
            proposal_hash=proposal_hash,
            approver_roles=sorted(approver_roles & set(self.approval.approver_roles)),
            via=via,
            preview_hash=self.preview_hash,
        )
        if self.approval.quorum_met(self.approvals_given):
            self._trigger(
                self.Readied, now, approval_id=approval_id, approvers=list(self.approvers)
            )
        return None

    def _approval_refusal(
        self,
        approval_id: str,
        approver: str,
        approver_roles: frozenset[str],
        proposal_hash: str,
        preview_hash: str | None,
        now: datetime,
    ) -> Refusal | None:
        assert self.approval is not None
        refusal = approval_refusal(
            self.approval,
            approval_id=approval_id,
            approver=approver,
            approver_roles=approver_roles,
            named_hash=proposal_hash,
            current_hash=self.proposal_hash,
            requester=self.actor,
            given=self.approvals_given,
            open_=not self.approval_consumed and self.state is S.AWAITING_APPROVAL,
            now=now,
        )
        if refusal is not None:
            return refusal
        # Last, so that only one of its approvers learns anything of the preview.
        # The approver approves the effect they were shown, not only the arguments:
        # none was shown yet, the tool could show none, or another one was shown.
        unapprovable = self.preview_unapprovable
        if unapprovable is not None:
            return unapprovable
        if self.preview_requested and preview_hash != self.preview_hash:
            return Refusal("preview_hash_mismatch")
        return None

    @property
    def caller_context(self) -> RuntimeContext:
        """The trusted runtime context it was proposed under, for a call made on the
        caller's behalf later (a retry, a compensation): no capabilities when they were
        not recorded (an old operation)."""
        return RuntimeContext(
            principal=self.actor,
            tenant=self.tenant,
            capabilities=frozenset(self.capabilities or ()),
            environment=self.environment,
        )

    @property
    def preview_unapprovable(self) -> Refusal | None:
        """Why no approval of this call can count now for want of a preview it can name
        (`preview_pending`, `preview_failed`); None when there is none to wait for."""
        if not self.preview_requested:
            return None
        if self.preview is None:
            return Refusal("preview_pending")
        if "error" in self.preview:
            return Refusal("preview_failed")
        return None

    def deny_approval(
        self,
        *,
        approval_id: str,
        approver: str,
        approver_roles: frozenset[str],
        reason: str,
        now: datetime,
        via: str = "",
    ) -> Refusal | None:
        """Deny the call; it will never run. Only an approver of this request may:
        anyone else's denial is refused, recorded, and its reason returned."""
        check_approver_name(approver)
        self._guard("deny_approval")
        assert self.approval is not None
        if approval_id != self.approval.approval_id:
            raise IllegalTransition("no such approval request", operation_id=self.id)
        if now >= self.approval.expires_at:
            # Past its expiry the request is over whoever speaks first: it expired,
            # as it would have at the next sweep, and was not denied.
            self._trigger(self.ApprovalExpired, now, approval_id=self.approval.approval_id)
            return Refusal("expired")
        held = approver_roles & set(self.approval.approver_roles)
        if not held:
            refusal = Refusal("not_an_approver")
            self._trigger(
                self.ApprovalRefused,
                now,
                approval_id=approval_id,
                approver=approver,
                proposal_hash=self.proposal_hash or "",
                reason=refusal,
                decision="deny",
                via=via,
            )
            return refusal
        self._trigger(
            self.ApprovalDenied,
            now,
            approval_id=approval_id,
            approver=approver,
            reason=reason,
            approver_roles=sorted(held),
            via=via,
        )
        return None

    def expire_approval(self, now: datetime) -> None:
        """Expire the approval request, if its time has passed."""
        self._guard("expire_approval")
        assert self.approval is not None
        if now < self.approval.expires_at:
            raise IllegalTransition("the approval has not expired yet", operation_id=self.id)
        self._trigger(self.ApprovalExpired, now, approval_id=self.approval.approval_id)

    def claim_lease(
        self,
        *,
        executor: str,
        ttl: timedelta,
        now: datetime,
        checked: dict[str, Any] | None = None,
    ) -> int:
        """Hand the operation to `executor`; returns the new, larger fencing token.

        `checked`: what the caller re-checked first, recorded with the lease.
        An approval that lapsed is refused here too: `refuse_execution` first.
        """
        self._guard("claim_lease")
        if self.approval_lapsed(now):
            raise IllegalTransition("the approval has expired", operation_id=self.id)
        token = self.fencing_token + 1
        self._trigger(
            self.LeaseClaimed,
            now,
            executor=executor,
            fencing_token=token,
            attempt=self.attempt + 1,
            lease_expires_at=now + ttl,
            checked=dict(checked or {}),
        )
        return token

    def approval_lapsed(self, now: datetime) -> bool:
        """Whether this call was approved and its approval no longer holds at `now`."""
        return self.approval is not None and now >= self.approval.expires_at

    def refuse_execution(
        self,
        *,
        code: Literal["approval_expired", "permission_changed"],
        reason: str,
        now: datetime,
    ) -> None:
        """The call will not run: what it was approved or checked against lapsed."""
        self._guard("refuse_execution")
        self._trigger(self.ExecutionRefused, now, code=code, reason=reason[:500])

    def expire_lease(self, now: datetime) -> None:
        """The lease ran out without a result: the outcome is now unknown."""
        self._guard("expire_lease")
        assert self.lease is not None
        if now < self.lease.expires_at:
            raise IllegalTransition("the lease has not expired yet", operation_id=self.id)
        self._trigger(
            self.LeaseExpired, now, fencing_token=self.fencing_token, attempt=self.attempt
        )

    def record_result(
        self,
        *,
        fencing_token: int,
        executor: str,
        outcome: ResultOutcome | str,
        now: datetime,
        output_hash: str = "",
        result_ref: str = "",
        code: str = "",
        category: str = "",
        retryable: bool = False,
        reason: str = "",
        envelope_hash: str = "",
        reconcile: ReconcilePlan = _DEFAULT_PLAN,
        lookup: int | None = None,
    ) -> ResultDisposition:
        """Take an executor's report; duplicates converge, stale and late ones are only noted.

        `envelope_hash` binds the envelope kept under `result_ref` to the event
        that settles the outcome (Succeeded, Failed or Reconciled). `reconcile`
        (from the pinned contract) says when an unknown outcome is looked up
        and after how many inconclusive lookups a person must settle it;
        `lookup` is the lookup an answer names (None: an executor that names none).
        """
        self._guard("record_result")
        # Events store the plain value (their bytes are hashed), never the enum.
        if outcome not in tuple(ResultOutcome):
            raise InvalidArgument(f"not a result outcome: {outcome!r}")
        outcome = ResultOutcome(outcome).value
        if fencing_token != self.fencing_token or self.fencing_token == 0:
            self._trigger(
                self.StaleResultRecorded,
                now,
                fencing_token=fencing_token,
                current_token=self.fencing_token,
                executor=executor,
                outcome=outcome,
            )
            return ResultDisposition.STALE
        if self.state in TERMINAL_STATES or self.state is S.READY:
            return self._late_result(fencing_token, executor, outcome, output_hash, now)
        if self.state is S.NEEDS_RESOLUTION and outcome == ResultOutcome.UNKNOWN:
            return ResultDisposition.DUPLICATE  # still unknown: the person decides
        if self.state in (S.OUTCOME_UNKNOWN, S.RECONCILING, S.NEEDS_RESOLUTION):
            if outcome == ResultOutcome.UNKNOWN:
                if self.state is not S.RECONCILING or (
                    lookup is not None and lookup != self.reconcile_rounds + 1
                ):
                    # No lookup is outstanding, or this answers an earlier one: a
                    # redelivered copy, which must not count as another lookup.
                    return ResultDisposition.DUPLICATE
                self._inconclusive(executor, reason, code, reconcile, now)
                return ResultDisposition.ACCEPTED
            self._reconcile(
                outcome,
                executor,
                now,
                output_hash,
                result_ref,
                code,
                category,
                retryable,
                envelope_hash=envelope_hash,
            )
            return ResultDisposition.ACCEPTED
        if outcome == ResultOutcome.SUCCEEDED:
            if self.cancel_requested:
                self._trigger(self.CancelTooLate, now, by=executor, outcome=outcome)
            self._trigger(
                self.Succeeded,
                now,
                fencing_token=fencing_token,
                attempt=self.attempt,
                executor=executor,
                output_hash=output_hash,
                result_ref=result_ref,
                envelope_hash=envelope_hash,
            )
        elif (
            outcome == ResultOutcome.FAILED
            and code == CANCELLED_BEFORE_EFFECT
            and self.state is S.CANCEL_REQUESTED
        ):
            # The executor stopped the call on the cancel request, before any effect.
            self._trigger(self.Cancelled, now, by=executor)
        elif outcome == ResultOutcome.FAILED:
            self._trigger(
                self.Failed,
                now,
                fencing_token=fencing_token,
                attempt=self.attempt,
                executor=executor,
                code=code,
                category=category,
                retryable=retryable,
                result_ref=result_ref,
                envelope_hash=envelope_hash,
            )
            self._cancel_instead_of_retry(now)
        else:
            self._trigger(
                self.OutcomeUnknown,
                now,
                fencing_token=fencing_token,
                attempt=self.attempt,
                executor=executor,
                reason=reason,
                not_before=now + reconcile.delay(0),
            )
        return ResultDisposition.ACCEPTED

    def _inconclusive(
        self, by: str, reason: str, code: str, plan: ReconcilePlan, now: datetime
    ) -> None:
        """One more lookup could not tell: another round later, or a person now.

        An executor that cannot look anything up (`RECONCILE_UNSUPPORTED`) ends
        the rounds at once: asking it again would only wait longer.
        """
        rounds = self.reconcile_rounds + 1
        reason = reason[:500]
        if code == RECONCILE_UNSUPPORTED or rounds >= plan.max_rounds:
            why = (
                "the executor cannot look the outcome up"
                if code == RECONCILE_UNSUPPORTED
                else f"{rounds} lookup(s) could not tell whether it took effect"
            )
            self._trigger(
                self.ResolutionNeeded,
                now,
                by=by,
                reason=why,
                rounds=rounds,
                code=code,
                lookup_reason=reason,
            )
            return
        self._trigger(
            self.ReconciliationInconclusive,
            now,
            by=by,
            reason=reason,
            round=rounds,
            not_before=now + plan.delay(rounds),
            code=code,
            attempt=self.attempt,
        )

    def _late_result(
        self, token: int, executor: str, outcome: str, output_hash: str, now: datetime
    ) -> ResultDisposition:
        recorded = self.outcome
        same = (
            recorded is not None
            and recorded.status == outcome
            and (outcome != "succeeded" or recorded.output_hash == output_hash)
        )
        if same:
            return ResultDisposition.DUPLICATE
        self._trigger(
            self.ConflictingOutcomeRecorded,
            now,
            fencing_token=token,
            executor=executor,
            outcome=outcome,
            output_hash=output_hash,
        )
        return ResultDisposition.CONFLICTING

    def start_reconciliation(self, *, by: str, now: datetime, ttl: timedelta | None = None) -> None:
        """Begin looking the outcome up at the provider; with `ttl`, the lookup is `by`'s
        alone until then (another executor is answered busy), and a lookup whose
        executor vanished may be started again once it ran out."""
        self._guard("start_reconciliation")
        if self.state is S.RECONCILING and self.lookup_live(now):
            raise IllegalTransition("a lookup is already running", operation_id=self.id)
        self._trigger(
            self.ReconciliationStarted,
            now,
            by=by,
            lookup_expires_at=None if ttl is None else now + ttl,
        )

    def lookup_live(self, now: datetime) -> bool:
        """Whether a started lookup still holds (its executor has not run out of time)."""
        expires = self.lookup_expires_at
        return self.state is S.RECONCILING and expires is not None and now < expires

    def reconcile(
        self,
        *,
        outcome: Literal["succeeded", "failed"],
        by: str,
        now: datetime,
        output_hash: str = "",
        result_ref: str = "",
        code: str = "",
        category: str = "",
        retryable: bool = False,
        envelope_hash: str = "",
        reason: str = "",
    ) -> None:
        """Settle an unknown outcome with what the provider, or a person, says happened."""
        self._guard("reconcile")
        self._reconcile(
            outcome,
            by,
            now,
            output_hash,
            result_ref,
            code,
            category,
            retryable,
            envelope_hash=envelope_hash,
            reason=reason,
        )

    def _reconcile(
        self,
        outcome: str,
        by: str,
        now: datetime,
        output_hash: str,
        result_ref: str,
        code: str,
        category: str,
        retryable: bool,
        *,
        envelope_hash: str = "",
        reason: str = "",
    ) -> None:
        if outcome not in ("succeeded", "failed"):
            raise IllegalTransition("reconciliation needs a definite outcome", operation_id=self.id)
        self._trigger(
            self.Reconciled,
            now,
            outcome=outcome,
            by=by,
            output_hash=output_hash,
            result_ref=result_ref,
            code=code,
            category=category,
            retryable=retryable,
            envelope_hash=envelope_hash,
            reason=reason[:500],
        )
        self._cancel_instead_of_retry(now)

    def _cancel_instead_of_retry(self, now: datetime) -> None:
        """A failure (or a not-applied lookup) that the retry policy would run again,
        under a cancel request: the cancel is why it ends, so it ends `cancelled`.
        A failure that would have been final anyway stays `failed`."""
        if self.state is S.FAILED and self.cancel_requested and self._retry_allowed():
            self._trigger(self.Cancelled, now, by=self.cancel_requested_by or "cancel")

    def _retry_allowed(self) -> bool:
        outcome = self.outcome
        return (
            outcome is not None
            and outcome.retryable
            and outcome.category in self.retry_on
            and self.attempt < self.max_attempts
        )

    @property
    def can_retry(self) -> bool:
        """Whether a failed attempt may be retried under the contract's retry policy."""
        return (
            self.state is S.FAILED
            # A cancelled call is never run again, whatever its failure allows.
            and not self.cancel_requested
            and self._retry_allowed()
        )

    def schedule_retry(self, *, not_before: datetime, now: datetime) -> None:
        """Make a failed operation ready again, if its retry policy allows it."""
        self._guard("schedule_retry")
        if not self.can_retry:
            raise IllegalTransition(
                "this failure may not be retried", operation_id=self.id, attempt=self.attempt
            )
        self._trigger(self.RetryScheduled, now, after_attempt=self.attempt, not_before=not_before)

    def note_retry(self, *, retry_id: str, by: str, reason: str, via: str, now: datetime) -> None:
        """A person runs this failed call again as a new operation, `retry_id`.

        Not by reopening this one: its failure was announced to the host as final,
        and a host may have acted on it. The new operation carries the same call
        for the same caller and is checked, approved and budgeted afresh. Refused
        for a cancelled call, for one retried already (retry the retry if that
        failed too), and for one an executor reported as succeeded after all.
        """
        self._guard("note_retry")
        if not reason.strip():
            raise InvalidArgument("a retry needs a reason (what changed since it failed)")
        if len(reason) > _REASON_MAX:
            raise InvalidArgument(f"a reason has at most {_REASON_MAX} characters")
        if self.cancel_requested or self.cancel_too_late:
            # Asked to cancel after it failed is still asked: nobody wants it run again.
            raise IllegalTransition(
                "this call was cancelled; a cancelled call is never run again",
                operation_id=self.id,
            )
        if self.retried_as is not None:
            raise IllegalTransition(
                f"already run again as {self.retried_as}: look at that one (and retry it,"
                " if it failed too)",
                operation_id=self.id,
            )
        if self.success_reported_late:
            raise IllegalTransition(
                "an executor reported that this call succeeded after all"
                " (ConflictingOutcomeRecorded): check with the provider before running it"
                " again, and propose it anew if it really did not happen",
                operation_id=self.id,
            )
        self._trigger(self.RetryProposed, now, retry_id=retry_id, by=by, reason=reason, via=via)

    def note_compensation(
        self, *, compensation_id: str, by: str, reason: str, now: datetime
    ) -> None:
        """Someone proposed undoing this succeeded call as operation `compensation_id`.

        Only a call that succeeded has an effect to undo. One compensation per call:
        proposing the same one again converges, another one is refused (look at the
        first, and retry it if it failed).
        """
        self._guard("note_compensation")
        if len(reason) > _REASON_MAX:
            raise InvalidArgument(f"a reason has at most {_REASON_MAX} characters")
        if self.compensated_by == compensation_id:
            return
        if self.compensated_by is not None:
            raise IllegalTransition(
                f"already compensated by {self.compensated_by}: look at that one",
                operation_id=self.id,
            )
        self._trigger(
            self.CompensationProposed, now, compensation_id=compensation_id, by=by, reason=reason
        )

    def request_cancel(self, *, by: str, reason: str, now: datetime) -> None:
        """Cancel: at once if nothing runs yet, by request if running, noted if too late."""
        self._guard("request_cancel")
        if self.state in (S.CANCELLED, S.CANCEL_REQUESTED):
            return  # already cancelled or asked: converge, append nothing
        if self.state in (S.SUCCEEDED, S.FAILED):
            self._trigger(self.CancelTooLate, now, by=by, outcome=self.state.value)
            return
        running = self.state is S.EXECUTING
        self._trigger(self.CancelRequested, now, by=by, reason=reason)
        if self.state in (S.OUTCOME_UNKNOWN, S.RECONCILING, S.NEEDS_RESOLUTION):
            # The call may have had its effect: only the lookups (or a person) can
            # say. The cancel stands: a not-applied outcome is never retried.
            return
        if not running:
            self._trigger(self.Cancelled, now, by=by)

    def note_publication_set_aside(
        self, *, position: int, version: int, reason: str, now: datetime
    ) -> None:
        """Record that the relay set aside the event at `version` (see `PublicationSetAside`)."""
        self._guard("note_publication_set_aside")
        self._trigger(
            self.PublicationSetAside, now, position=position, version=version, reason=reason[:500]
        )

    def confirm_cancelled(self, *, by: str, now: datetime) -> None:
        """The executor confirms it stopped before any side effect."""
        self._guard("confirm_cancelled")
        self._trigger(self.Cancelled, now, by=by)
