"""The messages exchanged over NATS, besides proposals, decisions and results."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import Field

from schemas._base import WireModel
from schemas._decision import Decision
from schemas._errors import ErrorInfo
from schemas._proposal import RuntimeContext, ToolProposal
from schemas._result import ResultEnvelope
from schemas._subjects import OPERATION_ID_PATTERN, TOKEN_PATTERN

__all__ = [
    "FeedEvent",
    "LeaseDecision",
    "LeaseReply",
    "LeaseRequest",
    "OperationStatus",
    "ProposalEnvelope",
    "ProposeReply",
    "StatusRequest",
    "WorkItem",
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


class WorkItem(WireModel):
    """A ready operation queued for executors. It carries no arguments: those come
    with the lease, from the ledger, exactly as checked and approved."""

    operation_id: str = Field(pattern=OPERATION_ID_PATTERN)
    tool: str
    tool_version: str
    attempt: int = Field(ge=1, description="The attempt this item is for.")


class LeaseRequest(WireModel):
    """An executor asks for the lease on one operation before any side effect."""

    operation_id: str = Field(pattern=OPERATION_ID_PATTERN)
    executor: str = Field(min_length=1, max_length=128)


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
