"""What opledger answers: the decision on a proposal, with repair feedback."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import Field, WithJsonSchema

from schemas._base import WireModel
from schemas._canonical import Digest
from schemas._errors import ErrorCategory

__all__ = [
    "JSON_VALUE_SCHEMA",
    "REPAIR_EXHAUSTED",
    "REPAIR_TARGET_INVALID",
    "ApprovalRequirement",
    "CheckStage",
    "Decision",
    "DecisionOutcome",
    "RepairStatus",
    "RiskLevel",
    "ValidationIssue",
]


REPAIR_EXHAUSTED = "repair_exhausted"
"""The finding of a repair past its contract's `max_repair_attempts`, counted by the ledger."""
REPAIR_TARGET_INVALID = "repair_target_invalid"
"""The finding of a repair that names no rejected, repairable proposal of the same host,
conversation and tool, or one another proposal already repairs."""

JSON_VALUE_SCHEMA: dict[str, Any] = {
    "type": ["array", "boolean", "null", "number", "object", "string"],
}
"""Any JSON value: what `ValidationIssue.expected` and `actual` may hold."""

_JsonValue = Annotated[Any, WithJsonSchema(JSON_VALUE_SCHEMA)]


class RiskLevel(StrEnum):
    """Argument-aware risk of a call, ordered from low to critical."""

    LOW = "low"
    MODERATE = "moderate"
    HIGH = "high"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        """Position in the order low < moderate < high < critical."""
        return _RISK_ORDER.index(self)

    def at_least(self, other: RiskLevel) -> bool:
        """Whether this level is `other` or above."""
        return self.rank >= other.rank


_RISK_ORDER = [RiskLevel.LOW, RiskLevel.MODERATE, RiskLevel.HIGH, RiskLevel.CRITICAL]


class CheckStage(StrEnum):
    """The layers of the proposal check, and the ledger's repair bound.

    They run in this order but for `authorization`, which runs before `semantics`
    (so that a caller without the capability cannot probe which targets exist).
    """

    PARSE = "parse"
    TOOL = "tool"
    STRUCTURE = "structure"
    SEMANTICS = "semantics"
    AUTHORIZATION = "authorization"
    RISK = "risk"
    APPROVAL = "approval"
    BUDGET = "budget"
    REPAIR = "repair"
    """The ledger's bound on the repair loop (checked by the ledger, from its events)."""


class DecisionOutcome(StrEnum):
    """The four answers to a proposal."""

    READY = "ready"
    NEEDS_APPROVAL = "needs_approval"
    REJECTED = "rejected"
    NEEDS_CLARIFICATION = "needs_clarification"
    """Only the user can settle it (two customers match): ask them `question`; the model
    is not invited to repair it."""


class ValidationIssue(WireModel):
    """One finding about a proposal, shaped so a model can repair it.

    `path` is a JSON pointer into the arguments. `expected` and `actual` are
    safe to show: they never include values of resources the caller cannot see.
    """

    stage: CheckStage
    code: str = Field(
        description="Stable machine-readable finding, e.g. `json_syntax`, `not_an_object`,"
        " `range`, `required`, `CAPABILITY_DENIED`, `repair_exhausted`."
    )
    message: str
    path: str = Field(
        default="", description='JSON pointer into the arguments ("": the arguments object).'
    )
    keyword: str | None = Field(
        default=None, description="The JSON Schema keyword that failed, for a structural finding."
    )
    expected: _JsonValue = Field(
        default=None, description="What was expected (any JSON value; null when not said)."
    )
    actual: _JsonValue = Field(
        default=None, description="What was given (any JSON value; null when not said)."
    )
    repairable: bool
    category: ErrorCategory = ErrorCategory.INVALID_INPUT
    details: dict[str, Any] = Field(default_factory=dict)
    question: str | None = Field(
        default=None,
        description="For a finding only the user can settle (an ambiguous reference): what"
        " to ask them. Such a finding makes the decision `needs_clarification`.",
    )


class ApprovalRequirement(WireModel):
    """Who must approve, how many of them, and why."""

    approver_roles: tuple[str, ...]
    required_approvals: int = Field(ge=1)
    required_from: dict[str, int] = Field(
        default_factory=dict,
        description="Role -> how many of the approvers must hold it (one person, one role).",
    )
    separation_of_duties: bool
    expires_in_s: int = Field(gt=0)
    reason: str


class RepairStatus(WireModel):
    """Where this call stands in its bounded repair loop."""

    attempt: int = Field(ge=0)
    max_attempts: int = Field(ge=0)
    exhausted: bool


class Decision(WireModel):
    """The answer to one proposal: ready, needs approval, or rejected."""

    outcome: DecisionOutcome
    proposal_id: str
    tool: str
    tool_version: str | None = None
    input_schema_hash: Digest | None = None
    output_schema_hash: Digest | None = None
    proposal_hash: Digest | None = Field(
        default=None,
        description="SHA-256 of the call as checked (RFC 8785 canonical JSON): what an"
        " approval binds to. Null when the check did not get that far.",
    )
    normalized_arguments: dict[str, Any] | None = None
    applied_defaults: tuple[str, ...] = ()
    risk: RiskLevel | None = None
    risk_reasons: tuple[str, ...] = ()
    issues: tuple[ValidationIssue, ...] = ()
    approval: ApprovalRequirement | None = None
    repair: RepairStatus | None = None
    category: ErrorCategory | None = Field(
        default=None, description="For a rejection: the category of its first issue."
    )
    question: str | None = Field(
        default=None, description="For `needs_clarification`: what to ask the user."
    )

    @property
    def repairable(self) -> bool:
        """Whether asking the model to repair the call could lead to a different answer."""
        if self.outcome is not DecisionOutcome.REJECTED or not self.issues:
            return False
        if self.repair is not None and self.repair.exhausted:
            return False
        return all(issue.repairable for issue in self.issues)
