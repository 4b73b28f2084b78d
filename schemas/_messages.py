"""The messages exchanged over NATS, besides proposals, decisions and results."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import Field, WithJsonSchema, model_validator

from schemas._base import WireModel, left_out_while_none
from schemas._canonical import DIGEST_PATTERN, Digest, canonical_json, sha256_hex
from schemas._decision import Decision
from schemas._errors import ErrorInfo
from schemas._proposal import RuntimeContext, ToolProposal
from schemas._result import ResultEnvelope
from schemas._subjects import (
    OPERATION_ID_PATTERN,
    TOKEN_PATTERN,
    preview_message_id,
    work_message_id,
)

__all__ = [
    "EVENT_TYPES",
    "FEED_ID_PATTERN",
    "OPERATION_STATES",
    "OUTCOME_SCHEMA",
    "OUTCOME_STATUSES",
    "PLAN_EVENT_TYPES",
    "PREVIEW_MAX_BYTES",
    "CancelRequest",
    "FeedEvent",
    "LeaseDecision",
    "LeaseReply",
    "LeaseRequest",
    "OperationStatus",
    "OperatorRequest",
    "PreviewReport",
    "ProposalEnvelope",
    "ProposeReply",
    "StatusRequest",
    "ToolsReply",
    "ToolsRequest",
    "WorkItem",
    "WorkPurpose",
]


OPERATION_STATES: Final = (
    "proposed",
    "rejected",
    "needs_clarification",
    "validated",
    "awaiting_approval",
    "approval_denied",
    "approval_expired",
    "ready",
    "executing",
    "cancel_requested",
    "succeeded",
    "failed",
    "outcome_unknown",
    "reconciling",
    "needs_resolution",
    "cancelled",
)
"""Every state an operation can be in, as `state` says it: the values of the ledger's
`OperationState`, in its order (a test keeps the two the same)."""

OUTCOME_STATUSES: Final = (
    "succeeded",
    "failed",
    "rejected",
    "needs_clarification",
    "approval_denied",
    "approval_expired",
    "cancelled",
)
"""How an operation ended, as `outcome.status` says it: the values of the ledger's
`OutcomeStatus`, in its order (a test keeps the two the same)."""

EVENT_TYPES: Final = (
    "Proposed",
    "Validated",
    "Rejected",
    "ClarificationNeeded",
    "ApprovalRequested",
    "PreviewRequested",
    "PreviewRecorded",
    "ApprovalGranted",
    "ApprovalRefused",
    "ApprovalDenied",
    "ApprovalExpired",
    "Readied",
    "LeaseClaimed",
    "LeaseExpired",
    "ExecutionRefused",
    "Succeeded",
    "Failed",
    "OutcomeUnknown",
    "ReconciliationStarted",
    "Reconciled",
    "ReconciliationInconclusive",
    "ResolutionNeeded",
    "RetryScheduled",
    "StaleResultRecorded",
    "ConflictingOutcomeRecorded",
    "RetryProposed",
    "CompensationProposed",
    "RepairProposed",
    "CancelRequested",
    "Cancelled",
    "CancelTooLate",
    "PublicationSetAside",
)
"""Every event type of the ledger, as a feed record's `type` (and the last token of its
subject) says it: the event classes of `Operation`, in their order (a test keeps the two
the same)."""

PLAN_EVENT_TYPES: Final = (
    "PlanProposed",
    "PlanRejected",
    "PlanValidated",
    "PlanApprovalRequested",
    "PlanApprovalGranted",
    "PlanApprovalRefused",
    "PlanDenied",
    "PlanExpired",
    "PlanStarted",
    "StepReleased",
    "StepSkipped",
    "PlanCancelRequested",
    "PlanSettled",
    "PlanRetried",
)
"""The event types of a plan (`ledger.domain.plan.Plan`), on the feed under the subject
token `_plan` (`ops.feed._plan.<type>`), in their order (a test keeps the two the same)."""

FEED_ID_PATTERN: Final = r"^(?:[A-Za-z0-9_-]{1,128}/)?[A-Za-z0-9_-]{1,128}(?:~plan)?$"
"""What a feed record's `operation_id` is: an operation's ledger ID, or a plan's
(`<host>/<plan id>~plan`)."""

# What the ledger sends, published exactly. The models read these leniently (any
# string): only the ledger writes them, and a host on an older schema must not
# fail on a state added later; the published schema says what is sent today.
_State = Annotated[str, WithJsonSchema({"type": "string", "enum": list(OPERATION_STATES)})]
_HostOperationId = Annotated[str, WithJsonSchema({"type": "string", "pattern": TOKEN_PATTERN})]
_LedgerOperationId = Annotated[
    str, WithJsonSchema({"type": "string", "pattern": OPERATION_ID_PATTERN})
]
_Timestamp = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]
_ERROR_CATEGORIES = [
    "INVALID_INPUT",
    "UNAUTHORIZED",
    "NOT_FOUND",
    "TRANSIENT",
    "CONFLICT",
    "POLICY_DENIED",
    "INTERNAL",
]

OUTCOME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "What the operation's settling event established; only the keys its"
    " `status` has. succeeded: output_hash, result_ref, attempt (envelope_hash,"
    " reconciled); failed: code, category, retryable, attempt (reconciled); rejected:"
    " category (code); needs_clarification: question; approval_denied and cancelled: by;"
    " approval_expired: (code).",
    "properties": {
        "status": {"type": "string", "enum": list(OUTCOME_STATUSES)},
        "attempt": {
            "type": ["integer", "null"],
            "description": "The attempt that decided it.",
        },
        "output_hash": {
            "type": "string",
            "description": "SHA-256 of the tool's output as recorded (empty when a person"
            " settled it without one).",
        },
        "result_ref": {
            "type": "string",
            "description": "Where the result envelope is kept: `result:<ledger operation"
            " ID>:<attempt>` (empty when none was kept).",
        },
        "envelope_hash": {
            "type": "string",
            "pattern": DIGEST_PATTERN,
            "description": "SHA-256 of the exact result envelope kept under `result_ref`.",
        },
        "code": {
            "type": "string",
            "description": "A failure's error code; for a call refused at the lease, why"
            " (`approval_expired`, `permission_changed`).",
        },
        "category": {
            "type": "string",
            "enum": _ERROR_CATEGORIES,
            "description": "The error category of a failure, or the finding category of a"
            " rejection.",
        },
        "retryable": {"type": "boolean"},
        "by": {
            "type": "string",
            "description": "Who denied or cancelled it (`host:<host>`, an approver, an"
            " executor, `operator:<name>`).",
        },
        "reconciled": {
            "type": "boolean",
            "const": True,
            "description": "Established after the fact, by a lookup or a person.",
        },
        "question": {"type": "string", "description": "What to ask the user."},
    },
    "required": ["status"],
}
"""The published shape of `OperationStatus.outcome` (the ledger's `Outcome.as_dict`)."""


class ProposalEnvelope(WireModel):
    """What a host publishes on `ops.propose.<host>`: the proposal and who is asking."""

    proposal: ToolProposal
    context: RuntimeContext


class ProposeReply(WireModel):
    """The ledger's answer to a proposal: the operation and the check's decision."""

    operation_id: _HostOperationId | None = Field(
        default=None,
        description="The host's own operation ID (minted by the ledger when the proposal"
        " had none); null when the proposal was refused before it had one.",
    )
    state: _State | None = Field(
        default=None,
        description="The operation's state after the proposal; null when it was refused.",
    )
    created: bool = Field(
        default=False,
        description="False when the same call was proposed before under this operation ID"
        " (the existing operation is answered).",
    )
    decision: Decision | None = Field(
        default=None, description="Null when the operation already existed, or on refusal."
    )
    error: ErrorInfo | None = Field(
        default=None, description="Set when the proposal itself was refused (nothing stored)."
    )


class WorkPurpose(StrEnum):
    """Why a work item was queued. The lease, not the item, decides what is done."""

    EXECUTE = "execute"
    """An attempt is ready to run."""
    RECONCILE = "reconcile"
    """An attempt's outcome is unknown: look it up at the provider, never run it again."""
    PREVIEW = "preview"
    """A call awaits approval: run the tool's preview (a dry run, no side effect) so that
    the approvers see what it would do."""


class WorkItem(WireModel):
    """A ready operation queued for executors. It carries no arguments: those come
    with the lease, from the ledger, exactly as checked and approved."""

    operation_id: str = Field(pattern=OPERATION_ID_PATTERN)
    tool: str
    tool_version: str
    attempt: int = Field(ge=1, description="The attempt this item is for.")
    purpose: WorkPurpose = Field(
        default=WorkPurpose.EXECUTE,
        description="Informational: an executor asks for the lease either way, and the"
        " lease answers `execute`, `reconcile` or `preview`.",
    )
    lookup: int = Field(
        default=0,
        ge=0,
        description="For `reconcile`: which lookup of the outcome this is (1, 2, ...).",
    )

    @property
    def message_id(self) -> str:
        """Its `Nats-Msg-Id`: one item per attempt (and per lookup of its outcome), one
        preview item per call, each deduplicated by JetStream."""
        if self.purpose is WorkPurpose.PREVIEW:
            return preview_message_id(self.operation_id)
        return work_message_id(self.operation_id, self.attempt, self.lookup)


PREVIEW_MAX_BYTES: Final = 64 * 1024
"""The largest preview report (as canonical JSON) the ledger records: it is shown to
people and stored in an event."""


class PreviewReport(WireModel):
    """What a tool's preview (a dry run) says the call would do, or why it could not say.

    Exactly one of `effect` and `error`. Its digest (`digest()`) is what an
    approval of a previewed call names, and what the executor checks again right
    before the real run. A report with an `error` cannot be approved: nothing
    was shown that an approval could stand for.
    """

    effect: dict[str, Any] | None = Field(
        default=None,
        description="The effect as the tool would cause it (resolved recipients, rendered"
        " content, amounts), for people, redacted like any output (see `redactions`);"
        " at most 64 KiB as JSON.",
    )
    effect_sha256: Digest | None = Field(
        default=None,
        pattern=DIGEST_PATTERN,
        description="With `effect`: SHA-256 of the effect as the tool produced it, before"
        " redaction (RFC 8785 canonical JSON). The digest covers it, so a change in a"
        " part not shown (a secret, hidden characters, text cut for length) is a change.",
    )
    redactions: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list,
        max_length=1000,
        description="JSON pointers into `effect` of the values changed for display:"
        " what the approvers see there is not byte for byte what the tool would use.",
    )
    error: ErrorInfo | None = Field(
        default=None, description="Why the tool could not preview the call."
    )

    @model_validator(mode="after")
    def _one_of(self) -> PreviewReport:
        if (self.effect is None) == (self.error is None):
            raise ValueError("a preview report carries exactly one of effect and error")
        return self

    def digest(self) -> str:
        """SHA-256 of the report as RFC 8785 canonical JSON: the same bytes, whichever
        process computes it (the ledger recording it, the executor checking it again)."""
        return sha256_hex(canonical_json(self.model_dump(mode="json", exclude_none=True)))


class LeaseRequest(WireModel):
    """An executor asks for the lease on one operation before any side effect."""

    operation_id: str = Field(pattern=OPERATION_ID_PATTERN)
    executor: str = Field(min_length=1, max_length=128)
    holding: int | None = Field(
        default=None,
        ge=1,
        description="A check-in while the tool runs: the fencing token of the lease held."
        " Nothing is leased; the answer says whether to go on (`execute`), stop if it"
        " still can (`cancel`), or that the lease is no longer this executor's (`done`).",
    )
    preview: PreviewReport | None = Field(
        default=None,
        exclude_if=left_out_while_none,
        description="After a `preview` answer: the preview this executor ran. Nothing is"
        " leased; the ledger records the first preview of a call and answers `done`."
        " Left out when there is none.",
    )



class LeaseDecision(StrEnum):
    """What the executor should do with the work item."""

    EXECUTE = "execute"
    """Run the tool with these arguments and this fencing token."""
    RECONCILE = "reconcile"
    """A previous attempt may have had an effect: look the outcome up, do not run."""
    DONE = "done"
    """The operation has its outcome (or will never run): acknowledge the item."""
    BUSY = "busy"
    """Another executor holds a live lease: try again later."""
    CANCEL = "cancel"
    """To a check-in: the operation was cancelled while it runs; stop if no effect
    happened yet (the tool's `cancel` hook), and report what happened either way."""
    PREVIEW = "preview"
    """The call awaits approval: run the tool's preview with these arguments (no side
    effect, no lease) and send it back (`LeaseRequest.preview`)."""


class LeaseReply(WireModel):
    """The ledger's answer to a lease request."""

    decision: LeaseDecision
    operation_id: _LedgerOperationId = Field(description="The ledger's ID, `<host>/<id>`.")
    tool: str | None = None
    tool_version: str | None = None
    arguments: dict[str, Any] | None = Field(
        default=None,
        description="With execute, reconcile and preview: the exact arguments as checked"
        " (and approved), normalized; an object the tool contract's `input_schema` describes.",
    )
    fencing_token: int | None = None
    attempt: int | None = None
    lease_expires_at: datetime | None = Field(
        default=None,
        description="When the lease (or, with busy, the running lookup) runs out: RFC 3339,"
        " UTC, e.g. `2026-11-29T10:00:07.402810Z`.",
    )
    timeout_ms: int | None = None
    proposal_hash: Digest | None = None
    preview_hash: Digest | None = Field(
        default=None,
        exclude_if=left_out_while_none,
        description="With execute: the digest of the preview the approvers approved; the"
        " executor previews the call again and does not run it if the effect differs."
        " Left out when the call was not previewed.",
    )
    not_before: datetime | None = Field(
        default=None,
        description="With busy: a scheduled retry may not run before this time; ask again then.",
    )
    reason: str = ""
    lookup: int | None = Field(
        default=None,
        ge=1,
        description="With reconcile: which lookup of the attempt's unknown outcome this is;"
        " the executor names it in its answer (`ResultEnvelope.lookup`).",
    )
    context: RuntimeContext | None = Field(
        default=None,
        description="With execute, reconcile and preview: who the call runs for, from the"
        " ledger's record of the proposal (never from the work item or the tool's arguments), so"
        " that the tool scopes its work by it (the tenant, above all).",
    )



class CancelRequest(WireModel):
    """A host asks to cancel one of its own operations (answered with its status)."""

    operation_id: str = Field(pattern=TOKEN_PATTERN)
    reason: str = Field(default="", max_length=500)


class ToolsRequest(WireModel):
    """A host asks for the tools a caller with `capabilities` may call, as tool
    definitions in a model API's format (answered with a `ToolsReply`)."""

    format: Literal["openai", "anthropic", "mcp"] = Field(
        default="mcp",
        description="The definitions' format: OpenAI `tools`, Anthropic `tools`, or MCP"
        " `Tool`s (name, description, inputSchema, outputSchema, annotations).",
    )
    capabilities: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(
        default=None,
        max_length=256,
        description="The capabilities of the caller the model acts for (the runtime"
        " context's): only tools they suffice for are listed. Null: every tool agents may"
        " call at all.",
    )


class ToolsReply(WireModel):
    """The tools a host may offer its model: the contracts' own schemas, so what the
    ledger checks is what the model was shown. Forbidden tools are never listed."""

    ok: Literal[True] = True
    format: Literal["openai", "anthropic", "mcp"]
    tools: list[dict[str, Any]] = Field(
        description="One definition per tool, by name, in `format` (an object each)."
    )


class OperatorRequest(WireModel):
    """An operator settles an unknown outcome, cancels, runs a failed call again, or
    proposes undoing a succeeded one, over NATS (answered with the operation's status, by
    the ledger's ID: for `retry` and `compensate`, the new operation's)."""

    command: Literal["resolve", "cancel", "retry", "compensate"]
    operation_id: str = Field(pattern=OPERATION_ID_PATTERN, description="The ledger's ID.")
    applied: bool | None = Field(
        default=None, description="For `resolve`: whether the effect happened (required)."
    )
    reason: str = Field(
        default="",
        max_length=500,
        description="Why (recorded); required for `resolve`, `retry` and `compensate`.",
    )


class ApproverRequest(WireModel):
    """An approver approves or denies one call, over NATS (answered with the operation's
    status, by the ledger's ID, or the error envelope).

    Who decides is not in the message: it is the NATS identity the subject
    `ops.approve.<name>` belongs to, and that approver's roles are the ledger's
    configuration. An approval names the proposal hash the approver was shown,
    and counts only for that exact call.
    """

    command: Literal["approve", "deny"]
    operation_id: str | None = Field(
        default=None,
        pattern=OPERATION_ID_PATTERN,
        description="The ledger's ID of the call decided on (or `plan_id`: exactly one).",
    )
    plan_id: str | None = Field(
        default=None,
        exclude_if=left_out_while_none,
        pattern=OPERATION_ID_PATTERN,
        description="For a plan: the ledger's `<host>/<plan id>`; one approval decides every"
        " step of it. Left out when deciding on a single call.",
    )
    proposal_hash: str | None = Field(
        default=None,
        pattern=DIGEST_PATTERN,
        description="For `approve`: the hash of the call (or of the plan: `plan_hash`) as"
        " shown (required).",
    )
    preview_hash: str | None = Field(
        default=None,
        exclude_if=left_out_while_none,
        pattern=DIGEST_PATTERN,
        description="For `approve` of a call whose contract asks for a preview: the digest"
        " of the preview as shown (required for such a call, refused for a different one;"
        " ignored for a call that has no preview). Left out when there is none.",
    )
    reason: str = Field(default="", max_length=500)


    @model_validator(mode="after")
    def _one_subject(self) -> ApproverRequest:
        if (self.operation_id is None) == (self.plan_id is None):
            raise ValueError("name exactly one of `operation_id` and `plan_id`")
        return self

    @property
    def decided_id(self) -> str:
        """The ledger's ID of the call or plan decided on."""
        decided = self.operation_id or self.plan_id
        assert decided is not None
        return decided


class StatusRequest(WireModel):
    """A host asks where one of its operations stands."""

    operation_id: str = Field(pattern=TOKEN_PATTERN)


class OperationStatus(WireModel):
    """Where an operation stands; `final` when its outcome will not change."""

    operation_id: _LedgerOperationId = Field(
        description="To a host, its own ID; to an operator or approver, the ledger's `<host>/<id>`."
    )
    state: _State
    final: bool = Field(description="True when the outcome will not change.")
    tool: str | None = None
    tool_version: str | None = None
    attempts: int = Field(default=0, ge=0, description="Attempts started so far.")
    outcome: Annotated[dict[str, Any], WithJsonSchema(OUTCOME_SCHEMA)] | None = Field(
        default=None, description="Once the operation has an outcome: what it is."
    )
    result: ResultEnvelope | None = Field(
        default=None,
        description="The stored result envelope of the attempt that decided the outcome,"
        " exactly as its executor published it (its `operation_id` is the ledger's).",
    )
    error: ErrorInfo | None = Field(
        default=None, description="Not written by this version of the ledger (always null)."
    )
    cancel: Literal["requested", "too_late"] | None = Field(
        default=None,
        description="`requested`: a cancel waits for the running executor; `too_late`: a"
        " cancel came after the effect, and `outcome` says what happened.",
    )


class FeedEvent(WireModel):
    """One ledger event as mirrored on the feed (sensitive argument values hashed)."""

    position: int = Field(description="The event's place in the ledger's global order.")
    operation_id: Annotated[
        str, WithJsonSchema({"type": "string", "pattern": FEED_ID_PATTERN})
    ] = Field(description="The ledger's ID, `<host>/<id>`, or a plan's `<host>/<id>~plan`.")
    version: int = Field(description="The event's place among its operation's events (1, 2, ...).")
    type: Annotated[
        str, WithJsonSchema({"type": "string", "enum": [*EVENT_TYPES, *PLAN_EVENT_TYPES]})
    ]
    timestamp: _Timestamp | None = Field(
        default=None,
        description="When the event was recorded: RFC 3339, UTC, with microseconds"
        " (`2026-11-29T10:00:01.402810Z`; without a fraction when it is zero).",
    )
    event_hash: Digest = Field(
        description="SHA-256 of the stored event (its topic, a newline, its stored JSON),"
        " before any redaction: what `opledger audit verify` checks."
    )
    prev_hash: Digest | None = Field(
        default=None,
        description="The `event_hash` of the operation's previous event (64 zeros for its first).",
    )
    event: dict[str, Any] = Field(
        description="The stored event, the values of the contract's `sensitive_arguments`"
        ' replaced by `{"sha256": "<hex>"}`; its fields depend on `type`.'
    )
    event_omitted: bool = Field(
        default=False,
        description="The event was too large for one message: `event` is empty, and"
        " `event_hash` still identifies it (its content is in the ledger's export).",
    )
