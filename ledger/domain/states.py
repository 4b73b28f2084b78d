"""The lifecycle of an operation (seed 001's persistent state machine plus cancellation)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["TERMINAL_STATES", "OperationState", "ResultDisposition"]


class OperationState(StrEnum):
    """Where an operation stands. Derived from its events, never stored on its own."""

    PROPOSED = "proposed"
    REJECTED = "rejected"
    NEEDS_CLARIFICATION = "needs_clarification"
    """Only the user can settle the call (an ambiguous reference): final, never run."""
    VALIDATED = "validated"
    AWAITING_APPROVAL = "awaiting_approval"
    APPROVAL_DENIED = "approval_denied"
    APPROVAL_EXPIRED = "approval_expired"
    READY = "ready"
    EXECUTING = "executing"
    CANCEL_REQUESTED = "cancel_requested"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    OUTCOME_UNKNOWN = "outcome_unknown"
    RECONCILING = "reconciling"
    NEEDS_RESOLUTION = "needs_resolution"
    """Reconciliation could not tell: a person must settle it (`opledger ops resolve`)."""
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """Whether nothing but auditing records can follow (FAILED may still be retried)."""
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {
        OperationState.REJECTED,
        OperationState.NEEDS_CLARIFICATION,
        OperationState.APPROVAL_DENIED,
        OperationState.APPROVAL_EXPIRED,
        OperationState.SUCCEEDED,
        OperationState.FAILED,
        OperationState.CANCELLED,
    }
)
"""States with a final outcome. FAILED leaves only through an explicit retry."""


class ResultDisposition(StrEnum):
    """What the ledger did with a result delivered by an executor."""

    ACCEPTED = "accepted"
    """It decided the outcome."""
    DUPLICATE = "duplicate"
    """The same outcome was already recorded: nothing changed, nothing appended."""
    STALE = "stale"
    """It came with an old fencing token: recorded as stale, state unchanged."""
    CONFLICTING = "conflicting"
    """A different outcome for a finished operation: recorded for auditors, outcome unchanged."""
    REFUSED = "refused"
    """It came from an executor of another tool: nothing recorded, like a refused lease."""
