"""The operation's state as frozen values: its approval request, its leases, its outcome.

Set by the events' `apply_to` only; commands read them, never change them.
`Outcome.as_dict` is the outcome as hosts receive it (`OperationStatus.outcome`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

__all__ = ["Approval", "ApprovalGiven", "Lease", "Outcome", "OutcomeStatus", "ReconcilePlan"]


@dataclass(frozen=True, slots=True)
class Approval:
    """The open approval request: who may approve, how many, until when."""

    approval_id: str
    effect_preview: Mapping[str, Any]
    """What the approvers are shown (`ledger.service.effect_preview`)."""
    approver_roles: tuple[str, ...]
    required_approvals: int
    separation_of_duties: bool
    """Whether the requester is barred from approving their own call."""
    expires_at: datetime
    reason: str
    required_from: Mapping[str, int] = field(default_factory=dict)
    """Role -> how many of the approvers must hold it (M-of-N from named roles)."""

    def quorum_met(self, given: Sequence[ApprovalGiven]) -> bool:
        """Whether `given` (distinct approvers) complete this request.

        Enough approvers, and the named roles' shares filled by distinct people:
        one person holding two named roles counts for one of them, so a contract
        that asks for a finance and a legal approver never runs on one person's
        word. Which person fills which share is a matching (bipartite, found by
        augmenting paths; a handful of people, so no library is worth it).
        """
        if len(given) < self.required_approvals:
            return False
        shares = [role for role, count in sorted(self.required_from.items()) for _ in range(count)]
        holder: dict[int, int] = {}  # share index -> index into `given`

        def assign(person: int, seen: set[int]) -> bool:
            for share, role in enumerate(shares):
                if share in seen or role not in given[person].roles:
                    continue
                seen.add(share)
                if share not in holder or assign(holder[share], seen):
                    holder[share] = person
                    return True
            return False

        for person in range(len(given)):
            assign(person, set())
        return len(holder) == len(shares)

    def still_needed(self, given: Sequence[ApprovalGiven]) -> str:
        """What the request still waits for, for people: `2 more approver(s)`, or
        `an approver holding compliance` once the count is reached but a named
        role's share is not filled."""
        if self.quorum_met(given):
            return "nothing more"
        missing = self.required_approvals - len(given)
        if missing > 0:
            return f"{missing} more approver(s)"
        roles = " or ".join(sorted(self.required_from))
        return f"an approver holding {roles}"

    def as_dict(self) -> dict[str, Any]:
        """As JSON-able data (for operators' views)."""
        return {
            "approval_id": self.approval_id,
            "effect_preview": dict(self.effect_preview),
            "approver_roles": list(self.approver_roles),
            "required_approvals": self.required_approvals,
            "required_from": dict(self.required_from),
            "separation_of_duties": self.separation_of_duties,
            "expires_at": self.expires_at,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class ApprovalGiven:
    """One approval that counts: who gave it, with which of the requested roles, and how."""

    approver: str
    roles: frozenset[str]
    """The approver's roles among those the request accepts (as the ledger knew them)."""
    via: str = ""
    """`nats` (the approver's own identity), `break_glass` (the database, directly), or
    empty for approvals recorded before the channel was."""


@dataclass(frozen=True, slots=True)
class Lease:
    """One lease of the operation to an executor, fenced by its token."""

    executor: str
    fencing_token: int
    attempt: int
    expires_at: datetime

    def as_dict(self) -> dict[str, Any]:
        """As JSON-able data (for operators' views)."""
        return {
            "executor": self.executor,
            "fencing_token": self.fencing_token,
            "attempt": self.attempt,
            "expires_at": self.expires_at,
        }


class OutcomeStatus(StrEnum):
    """How an operation ended (or, for `FAILED`, how its last attempt did)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REJECTED = "rejected"
    NEEDS_CLARIFICATION = "needs_clarification"
    APPROVAL_DENIED = "approval_denied"
    APPROVAL_EXPIRED = "approval_expired"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the operation's settling event established."""

    status: OutcomeStatus
    attempt: int | None = None
    output_hash: str = ""
    result_ref: str = ""
    """Where the result envelope is kept (a success, or a reconciled one)."""
    envelope_hash: str = ""
    """SHA-256 of the exact envelope text kept under `result_ref` ("" before it existed)."""
    code: str = ""
    """A failure's error code; for a call refused at execution, why
    (`approval_expired`, `permission_changed`)."""
    category: str = ""
    """The error category of a failure, or the finding category of a rejection."""
    retryable: bool = False
    by: str = ""
    """Who denied or cancelled it."""
    reconciled: bool = False
    """Established after the fact, by reconciliation."""
    question: str = ""
    """For `needs_clarification`: what to ask the user."""

    def as_dict(self) -> dict[str, Any]:
        """The outcome as hosts receive it: only the keys its status has."""
        status = self.status
        if status is OutcomeStatus.SUCCEEDED:
            body: dict[str, Any] = {
                "status": status.value,
                "output_hash": self.output_hash,
                "result_ref": self.result_ref,
                "attempt": self.attempt,
            }
        elif status is OutcomeStatus.FAILED:
            body = {
                "status": status.value,
                "code": self.code,
                "category": self.category,
                "retryable": self.retryable,
                "attempt": self.attempt,
            }
        elif status is OutcomeStatus.NEEDS_CLARIFICATION:
            return {"status": status.value, "question": self.question}
        elif status is OutcomeStatus.REJECTED:
            rejected = {"status": status.value, "category": self.category}
            return rejected | {"code": self.code} if self.code else rejected
        elif status is OutcomeStatus.APPROVAL_EXPIRED:
            expired = {"status": status.value}
            return expired | {"code": self.code} if self.code else expired
        else:  # denied or cancelled
            return {"status": status.value, "by": self.by}
        if self.reconciled:
            body["reconciled"] = True
        if self.envelope_hash and status is OutcomeStatus.SUCCEEDED:
            body["envelope_hash"] = self.envelope_hash
        return body


@dataclass(frozen=True, slots=True)
class ReconcilePlan:
    """How often, and how soon, an unknown outcome is looked up before a person decides.

    The service derives it from the pinned contract's `reconcile` policy; the
    aggregate uses it when an outcome becomes unknown and when a lookup is
    inconclusive. The default is the contract's default.
    """

    max_rounds: int = 5
    initial_delay: timedelta = timedelta(seconds=1)
    multiplier: float = 2.0
    max_delay: timedelta = timedelta(seconds=60)

    def delay(self, rounds_done: int) -> timedelta:
        """How long to wait before lookup round `rounds_done + 1` (capped before it is
        built: a large multiplier must not overflow a timedelta)."""
        cap = self.max_delay.total_seconds()
        try:
            seconds = self.initial_delay.total_seconds() * self.multiplier ** max(rounds_done, 0)
        except OverflowError:
            seconds = cap
        return timedelta(seconds=min(seconds, cap))
