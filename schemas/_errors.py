"""The error envelope: how every failure is described to a caller."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import Field

from schemas._base import WireModel

__all__ = ["ErrorCategory", "ErrorEnvelope", "ErrorInfo"]


class ErrorCategory(StrEnum):
    """What kind of failure this is, which decides what the caller should do next."""

    INVALID_INPUT = "INVALID_INPUT"
    """Schema or semantic error: a bounded repair may help."""
    UNAUTHORIZED = "UNAUTHORIZED"
    """A capability is missing: stop, or ask for approval."""
    NOT_FOUND = "NOT_FOUND"
    """The target does not exist (or is not visible to the caller)."""
    TRANSIENT = "TRANSIENT"
    """Timeout or rate limit: retry with backoff."""
    CONFLICT = "CONFLICT"
    """A revision or idempotency conflict: re-read the current state."""
    POLICY_DENIED = "POLICY_DENIED"
    """A business rule forbids this: choose another action or stop safely."""
    INTERNAL = "INTERNAL"
    """Contract violation or bug: fail without exposing internals."""

    @property
    def retryable_by_default(self) -> bool:
        """Whether this category is retryable unless a contract says otherwise."""
        return self is ErrorCategory.TRANSIENT


class ErrorInfo(WireModel):
    """One error: a stable code, its category, and only details safe to show."""

    code: str = Field(
        description="Stable machine-readable code, e.g. OPERATION_NOT_FOUND or a tool's own"
        " UPSTREAM_RATE_LIMITED (an open set: tools name their own)."
    )
    category: ErrorCategory
    message: str = Field(description="Short human-readable text; never a stack trace.")
    retryable: bool = False
    retry_after_ms: int | None = Field(
        default=None, ge=0, description="Wait at least this long before retrying."
    )
    safe_details: dict[str, Any] = Field(
        default_factory=dict,
        description="Details safe to show the caller (never values of resources it may"
        " not see); their keys depend on `code`.",
    )


class ErrorEnvelope(WireModel):
    """A failed result, as returned by tools and by opledger itself."""

    ok: Literal[False] = Field(default=False, description="Always false for an error envelope.")
    error: ErrorInfo
    meta: dict[str, Any] = Field(
        default_factory=dict,
        description="Context of the failure; on the ledger's request subjects,"
        " `operation_id`: the operation the request asked about (absent when the request"
        " could not be read).",
    )
