"""The rules of an approval request, shared by a single call and a plan.

Who counts as one person, and in which order an approval is refused: the
order matters, because each refusal tells its approver something, and an
approver without the role must learn nothing about what the request shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from ledger.domain.errors import InvalidArgument
from ledger.domain.values import Approval, ApprovalGiven

__all__ = ["Refusal", "approval_refusal", "check_approver_name", "same_person"]


class Refusal(str):
    """The reason an approval was refused (also recorded as an event)."""


def same_person(name: str) -> str:
    """A name as compared for separation of duties and distinct approvers: without
    outer or doubled spaces and case-folded, so `Alice`, `alice` and ` alice` are
    one person whichever way their approval came (NATS identity, a token's
    subject, a break-glass `--as`). The names are recorded as given."""
    return " ".join(name.split()).casefold()


def check_approver_name(approver: str) -> None:
    """Refuse an approver without a name (only spaces, or nothing)."""
    if not same_person(approver):
        raise InvalidArgument("an approver has a name")


def approval_refusal(
    approval: Approval,
    *,
    approval_id: str,
    approver: str,
    approver_roles: frozenset[str],
    named_hash: str,
    current_hash: str | None,
    requester: str,
    given: Sequence[ApprovalGiven],
    open_: bool,
    now: datetime,
) -> Refusal | None:
    """Why this approval cannot count, or None: another request, one already decided
    (`open_` false), another call or plan than the one shown (`named_hash` against
    `current_hash`), past its expiry, the requester approving their own (separation of
    duties), someone without an accepted role, or an approver counted already."""
    if approval_id != approval.approval_id:
        return Refusal("unknown_approval")
    if not open_:
        return Refusal("approval_consumed")
    if named_hash != current_hash:
        return Refusal("proposal_hash_mismatch")
    if now >= approval.expires_at:
        return Refusal("expired")
    person = same_person(approver)
    if approval.separation_of_duties and person == same_person(requester):
        return Refusal("requester_cannot_approve")
    if not approver_roles & set(approval.approver_roles):
        return Refusal("not_an_approver")
    if person in {same_person(one.approver) for one in given}:
        return Refusal("duplicate_approver")
    return None
