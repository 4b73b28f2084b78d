"""The result envelope an executor publishes for one attempt of an operation."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import Field

from schemas._base import WireModel
from schemas._errors import ErrorInfo
from schemas._subjects import OPERATION_ID_PATTERN

__all__ = [
    "CANCELLED_BEFORE_EFFECT",
    "RECONCILE_UNSUPPORTED",
    "Provenance",
    "ResultEnvelope",
    "ResultOutcome",
    "TrustLabel",
]

CANCELLED_BEFORE_EFFECT = "CANCELLED"
"""The error code of a result that says: cancelled while running, stopped before any
side effect (the tool's `cancel` hook said so). It settles a cancel request."""
RECONCILE_UNSUPPORTED = "RECONCILE_UNSUPPORTED"
"""The error code of an unknown outcome from an executor that cannot look earlier
attempts up (its tool has no `reconcile`): the ledger asks a person at once."""


class ResultOutcome(StrEnum):
    """What one attempt's result envelope says happened, named once for every reader."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    """The side effect may or may not have happened (`outcome_unknown`)."""


class TrustLabel(StrEnum):
    """How far a result may be trusted: a closed set, and tool output is only ever data."""

    UNTRUSTED = "untrusted"


class Provenance(WireModel):
    """Where a result came from. Results are data, never instructions."""

    tool: str
    tool_version: str
    executor: str = Field(description="The executor process that ran the attempt.")
    attempt: int = Field(ge=1)
    latency_ms: float = Field(ge=0)
    completed_at: datetime = Field(
        description="When the attempt ended: an RFC 3339 date-time (the executor writes"
        " UTC, `2026-11-29T10:00:01.402810Z`)."
    )
    trust: TrustLabel = Field(
        default=TrustLabel.UNTRUSTED,
        description="Always untrusted: tool output is data. Any other value is malformed.",
    )


class ResultEnvelope(WireModel):
    """One attempt's outcome: `data` when ok, `error` otherwise."""

    operation_id: str = Field(
        pattern=OPERATION_ID_PATTERN,
        description="The ledger's operation ID (`<host>/<id>`), as the lease named it.",
    )
    fencing_token: int = Field(ge=1)
    ok: bool
    data: dict[str, Any] | None = Field(
        default=None,
        description="When ok: the tool's output, an object its contract's `output_schema`"
        " describes (untrusted data, never instructions).",
    )
    error: ErrorInfo | None = None
    outcome_unknown: bool = Field(
        default=False, description="The side effect may or may not have happened."
    )
    provenance: Provenance
    lookup: int | None = Field(
        default=None,
        ge=1,
        description="For the answer of a lookup (a `reconcile` lease): which lookup of the"
        " attempt's unknown outcome it answers, as the lease named it.",
    )
    redactions: tuple[str, ...] = Field(
        default=(), description="JSON pointers of fields that were redacted or truncated."
    )

    @property
    def outcome(self) -> ResultOutcome:
        """Succeeded (`ok`), unknown (`outcome_unknown`), or else failed."""
        if self.ok:
            return ResultOutcome.SUCCEEDED
        return ResultOutcome.UNKNOWN if self.outcome_unknown else ResultOutcome.FAILED
