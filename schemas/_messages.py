"""The messages exchanged over NATS, besides proposals, decisions and results."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field

from schemas._base import WireModel
from schemas._canonical import DIGEST_PATTERN
from schemas._decision import Decision
from schemas._errors import ErrorInfo
from schemas._proposal import RuntimeContext, ToolProposal
from schemas._result import ResultEnvelope
from schemas._subjects import OPERATION_ID_PATTERN, TOKEN_PATTERN

__all__ = [
    "CancelRequest",
    "FeedEvent",
    "LeaseDecision",
    "LeaseReply",
    "LeaseRequest",
    "OperationStatus",
    "OperatorRequest",
    "ProposalEnvelope",
    "ProposeReply",
    "StatusRequest",
    "WorkItem",
    "WorkPurpose",
]


class ProposalEnvelope(WireModel):
    """What a host publishes on `ops.propose.<host>`: the proposal and who is asking."""

    proposal: ToolProposal
    context: RuntimeContext


class ProposeReply(WireModel):
    """The ledger's answer to a proposal: the operation and the check's decision."""

    operation_id: str | None = None
    state: str | None = None
    created: bool = False
    decision: Decision | None = Field(
        default=None, description="Absent when the operation already existed."
    )
    error: ErrorInfo | None = None


class WorkPurpose(StrEnum):
    """Why a work item was queued. The lease, not the item, decides what is done."""

    EXECUTE = "execute"
    """An attempt is ready to run."""
    RECONCILE = "reconcile"
    """An attempt's outcome is unknown: look it up at the provider, never run it again."""


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
        " lease answers `execute` or `reconcile`.",
    )
    lookup: int = Field(
        default=0,
        ge=0,
        description="For `reconcile`: which lookup of the outcome this is (1, 2, ...).",
    )


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


class LeaseReply(WireModel):
    """The ledger's answer to a lease request."""

    decision: LeaseDecision
    operation_id: str
    tool: str | None = None
    tool_version: str | None = None
    arguments: dict[str, Any] | None = None
    fencing_token: int | None = None
    attempt: int | None = None
    lease_expires_at: datetime | None = None
    timeout_ms: int | None = None
    proposal_hash: str | None = None
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
        description="With execute and reconcile: who the call runs for, from the ledger's"
        " record of the proposal (never from the work item or the tool's arguments), so"
        " that the tool scopes its work by it (the tenant, above all).",
    )


class CancelRequest(WireModel):
    """A host asks to cancel one of its own operations (answered with its status)."""

    operation_id: str = Field(pattern=TOKEN_PATTERN)
    reason: str = Field(default="", max_length=500)


class OperatorRequest(WireModel):
    """An operator settles an unknown outcome or cancels, over NATS (answered with the
    operation's status, by the ledger's ID)."""

    command: Literal["resolve", "cancel"]
    operation_id: str = Field(pattern=OPERATION_ID_PATTERN, description="The ledger's ID.")
    applied: bool | None = Field(
        default=None, description="For `resolve`: whether the effect happened (required)."
    )
    reason: str = Field(default="", max_length=500)


class ApproverRequest(WireModel):
    """An approver approves or denies one call, over NATS (answered with the operation's
    status, by the ledger's ID, or the error envelope).

    Who decides is not in the message: it is the NATS identity the subject
    `ops.approve.<name>` belongs to, and that approver's roles are the ledger's
    configuration. An approval names the proposal hash the approver was shown,
    and counts only for that exact call.
    """

    command: Literal["approve", "deny"]
    operation_id: str = Field(pattern=OPERATION_ID_PATTERN, description="The ledger's ID.")
    proposal_hash: str | None = Field(
        default=None,
        pattern=DIGEST_PATTERN,
        description="For `approve`: the hash of the call as shown (required).",
    )
    reason: str = Field(default="", max_length=500)


class StatusRequest(WireModel):
    """A host asks where one of its operations stands."""

    operation_id: str = Field(pattern=TOKEN_PATTERN)


class OperationStatus(WireModel):
    """Where an operation stands; `final` when its outcome will not change."""

    operation_id: str
    state: str
    final: bool
    tool: str | None = None
    tool_version: str | None = None
    attempts: int = 0
    outcome: dict[str, Any] | None = None
    result: ResultEnvelope | None = None
    error: ErrorInfo | None = None
    cancel: Literal["requested", "too_late"] | None = Field(
        default=None,
        description="`requested`: a cancel waits for the running executor; `too_late`: a"
        " cancel came after the effect, and `outcome` says what happened.",
    )


class FeedEvent(WireModel):
    """One ledger event as mirrored on the feed (sensitive argument values hashed)."""

    position: int
    operation_id: str
    version: int
    type: str
    timestamp: str | None = None
    event_hash: str
    prev_hash: str | None = None
    event: dict[str, Any]
    event_omitted: bool = Field(
        default=False,
        description="The event was too large for one message: `event` is empty, and"
        " `event_hash` still identifies it (its content is in the ledger's export).",
    )
