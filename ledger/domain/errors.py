"""Domain errors of the ledger. Raising one means nothing was appended."""

from __future__ import annotations

from schemas import ErrorCategory, OpledgerError

__all__ = [
    "ApprovalRefused",
    "IllegalTransition",
    "InvalidArgument",
    "InvalidProposal",
    "LedgerError",
    "OperationConflict",
    "OperationNotFound",
    "PlanNotFound",
    "ResultIntegrityError",
    "TamperDetected",
]


class LedgerError(OpledgerError):
    """Base of the ledger's errors."""


class IllegalTransition(LedgerError):
    """The command is not allowed in the operation's current state."""

    category = ErrorCategory.CONFLICT
    code = "ILLEGAL_TRANSITION"


class InvalidArgument(LedgerError, ValueError):
    """A caller passed a value the API does not take (a programming error, not input).

    Also a `ValueError`, which is what such a mistake is in Python.
    """

    category = ErrorCategory.INVALID_INPUT
    code = "INVALID_ARGUMENT"


class OperationConflict(LedgerError):
    """The operation ID is taken by a different call, or another writer won the race."""

    category = ErrorCategory.CONFLICT
    code = "OPERATION_CONFLICT"


class InvalidProposal(LedgerError):
    """A proposal that cannot be recorded as it is (never retryable as sent).

    The layered check turns faulty arguments into findings; this is for what
    is left: a value no event can hold, an identifier that is not one.
    """

    category = ErrorCategory.INVALID_INPUT
    code = "INVALID_PROPOSAL"


class OperationNotFound(LedgerError):
    """No operation has this ID."""

    category = ErrorCategory.NOT_FOUND
    code = "OPERATION_NOT_FOUND"


class PlanNotFound(OperationNotFound):
    """No plan of this ID is visible to the caller (answered like an unknown operation)."""

    code = "PLAN_NOT_FOUND"


class ApprovalRefused(LedgerError):
    """An approval was refused; the refusal itself was recorded in the ledger."""

    category = ErrorCategory.POLICY_DENIED
    code = "APPROVAL_REFUSED"


class TamperDetected(LedgerError):
    """Stored events do not match their hash chain."""

    category = ErrorCategory.INTERNAL
    code = "TAMPER_DETECTED"


class ResultIntegrityError(LedgerError):
    """A kept result envelope does not hash to what its event recorded: never served."""

    category = ErrorCategory.INTERNAL
    code = "RESULT_INTEGRITY"
