"""The one exception hierarchy of opledger, and the errors of `schemas` itself.

Every error opledger raises on purpose derives from `OpledgerError` and knows
its category and stable code, so entry points turn any of them into an
`ErrorEnvelope` without ever showing a stack trace. Each package keeps its own
errors in one module (this one for `schemas`) and re-exports them.
"""

from __future__ import annotations

from typing import Any

from schemas._errors import ErrorCategory, ErrorEnvelope, ErrorInfo

__all__ = ["CanonicalizationError", "OpledgerError"]


class OpledgerError(Exception):
    """Base of every deliberate opledger error."""

    category: ErrorCategory = ErrorCategory.INTERNAL
    code: str = "INTERNAL_ERROR"
    retryable: bool = False
    retry_after_ms: int | None = None

    def __init__(self, message: str, **safe_details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.safe_details = safe_details

    def to_info(self) -> ErrorInfo:
        """This error as the wire's `ErrorInfo`."""
        return ErrorInfo(
            code=self.code,
            category=self.category,
            message=self.message,
            retryable=self.retryable,
            retry_after_ms=self.retry_after_ms,
            safe_details=dict(self.safe_details),
        )

    def to_envelope(self, **meta: Any) -> ErrorEnvelope:
        """This error as a complete `ErrorEnvelope`."""
        return ErrorEnvelope(error=self.to_info(), meta=meta)


class CanonicalizationError(OpledgerError, ValueError):
    """A value has no canonical JSON form (NaN, huge integer, non-JSON type).

    Still a `ValueError`, as it was before it joined the tree, so that callers
    catching `ValueError` keep working.
    """

    category = ErrorCategory.INVALID_INPUT
    code = "NOT_CANONICAL_JSON"
