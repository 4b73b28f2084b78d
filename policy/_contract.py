"""The tool contract: the twelve fields a trusted registry holds for every tool.

A contract is loaded from an operator-edited file, never from a tool's own
self-description: risk, limits and approval rules are decided by the host.
"""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas import ErrorCategory, RiskLevel, canonical_json, sha256_hex

__all__ = [
    "ApprovalMode",
    "ApprovalPolicy",
    "Compensation",
    "EffectClass",
    "ErrorModelEntry",
    "Idempotency",
    "Limits",
    "RetryPolicy",
    "RiskCondition",
    "RiskPolicy",
    "RiskRule",
    "TargetRule",
    "ToolContract",
    "ToolDescription",
    "ToolVersion",
    "WriteKey",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EffectClass(StrEnum):
    """What running the tool does to the world."""

    PURE_READ = "pure_read"
    EXTERNAL_READ = "external_read"
    REVERSIBLE_WRITE = "reversible_write"
    IRREVERSIBLE_WRITE = "irreversible_write"

    @property
    def writes(self) -> bool:
        """Whether the tool changes state outside opledger."""
        return self in (EffectClass.REVERSIBLE_WRITE, EffectClass.IRREVERSIBLE_WRITE)


class ApprovalMode(StrEnum):
    """When a human must approve a call before it runs."""

    NEVER = "never"
    ALWAYS = "always"
    RISK_AT_LEAST = "risk_at_least"
    TWO_PERSON = "two_person"
    FORBIDDEN = "forbidden"


class ToolDescription(_Frozen):
    """A decision-oriented description: when to use the tool, when not, and its neighbours."""

    summary: str = Field(min_length=10)
    use_when: str = Field(min_length=5)
    avoid_when: str = Field(min_length=5)
    differs_from: dict[str, str] = Field(
        default_factory=dict, description="Neighbouring tool name → how this one differs."
    )
    limitations: str = ""

    def render(self) -> str:
        """The description as one text, for model-facing tool definitions."""
        parts = [self.summary, f"Use when: {self.use_when}", f"Do not use when: {self.avoid_when}"]
        parts += [f"Unlike {name}: {text}" for name, text in sorted(self.differs_from.items())]
        if self.limitations:
            parts.append(f"Limitations: {self.limitations}")
        return "\n".join(parts)


class ErrorModelEntry(_Frozen):
    """One error a tool may return, and how callers should treat it."""

    code: str = Field(pattern=r"^[A-Z][A-Z0-9_]*$")
    category: ErrorCategory
    description: str = ""


class ApprovalPolicy(_Frozen):
    """Who must approve which calls, and for how long an approval stays valid."""

    mode: ApprovalMode = ApprovalMode.NEVER
    risk_threshold: RiskLevel | None = Field(
        default=None, description="With mode risk_at_least: the lowest risk that needs approval."
    )
    two_person_from: RiskLevel | None = Field(
        default=None,
        description=(
            "With mode always or risk_at_least: from this risk on, two distinct approvers. "
            "Risk rules over the arguments make this 'two-person above an amount'."
        ),
    )
    approver_roles: tuple[str, ...] = ("approver",)
    required_approvals: int = Field(
        default=1,
        ge=1,
        le=20,
        description="M-of-N: how many distinct approvers, each holding one of approver_roles.",
    )
    required_from: dict[str, int] = Field(
        default_factory=dict,
        description=(
            "Named roles a share of the approvers must come from: role -> how many distinct"
            " approvers holding it. One person counts for one role only."
        ),
    )
    separation_of_duties: bool = Field(
        default=True, description="The requester may not approve their own call."
    )
    expires_after_s: int = Field(default=900, gt=0)
    preview: bool = Field(
        default=False,
        description=(
            "Before anyone approves, the tool's executor runs its preview hook (a dry run,"
            " no side effect) and the approvers see what the call would do: approvals name"
            " the preview's digest, and the executor refuses to run a call whose effect no"
            " longer previews the same."
        ),
    )

    @model_validator(mode="after")
    def _thresholds_match_mode(self) -> ApprovalPolicy:
        if (self.mode is ApprovalMode.RISK_AT_LEAST) != (self.risk_threshold is not None):
            raise ValueError("risk_threshold is required with mode risk_at_least, and only then")
        if self.two_person_from is not None:
            if self.mode not in (ApprovalMode.ALWAYS, ApprovalMode.RISK_AT_LEAST):
                raise ValueError("two_person_from applies only with mode always or risk_at_least")
            # Below the approval threshold nobody approves, so a lower
            # two-person level would silently mean nothing in between.
            if self.risk_threshold is not None and not self.two_person_from.at_least(
                self.risk_threshold
            ):
                raise ValueError("two_person_from must not be below risk_threshold")
        if self.preview and self.mode in (ApprovalMode.NEVER, ApprovalMode.FORBIDDEN):
            raise ValueError("preview applies only to calls someone approves (not mode never"
                             " or forbidden)")
        for role, count in self.required_from.items():
            if role not in self.approver_roles:
                raise ValueError(f"required_from names {role!r}, which is not an approver role")
            if count < 1:
                raise ValueError(f"required_from asks for {count} approvers of {role!r}")
        if sum(self.required_from.values()) > 20:
            raise ValueError("required_from asks for more than 20 approvers")
        return self

    def approvals_for(self, risk: RiskLevel) -> int:
        """How many distinct approvers a call of this risk needs, when it needs any.

        The largest of `required_approvals`, the named roles' shares added up, and
        two where the mode or `two_person_from` asks for two people.
        """
        floor = max(self.required_approvals, sum(self.required_from.values()))
        if self.mode is ApprovalMode.TWO_PERSON:
            return max(floor, 2)
        if self.two_person_from is not None and risk.at_least(self.two_person_from):
            return max(floor, 2)
        return floor


class RetryPolicy(_Frozen):
    """How often and how soon a failed attempt is retried, and for which categories."""

    max_attempts: int = Field(default=1, ge=1, le=20)
    initial_backoff_ms: int = Field(default=200, ge=0)
    backoff_multiplier: float = Field(default=2.0, ge=1.0)
    max_backoff_ms: int = Field(default=10_000, ge=0)
    retry_on: frozenset[ErrorCategory] = frozenset({ErrorCategory.TRANSIENT})

    def backoff_ms(self, attempt: int) -> int:
        """Delay before attempt number `attempt + 1`, after `attempt` has failed."""
        try:
            delay = self.initial_backoff_ms * self.backoff_multiplier ** max(attempt - 1, 0)
        except OverflowError:
            return self.max_backoff_ms
        return int(min(delay, self.max_backoff_ms))


class ReconcilePolicy(_Frozen):
    """How an unknown outcome is looked up at the provider before a person must decide.

    Round 1 waits `initial_delay_ms` after the outcome became unknown (a hung
    call may still land meanwhile); each inconclusive round waits longer, and
    after `max_rounds` inconclusive rounds the operation `needs_resolution`.
    """

    max_rounds: int = Field(default=5, ge=1, le=20)
    initial_delay_ms: int = Field(default=1_000, ge=0)
    backoff_multiplier: float = Field(default=2.0, ge=1.0)
    max_delay_ms: int = Field(default=60_000, ge=0)

    def delay_ms(self, rounds_done: int) -> int:
        """Delay before reconcile round `rounds_done + 1` (never above `max_delay_ms`)."""
        try:
            delay = self.initial_delay_ms * self.backoff_multiplier ** max(rounds_done, 0)
        except OverflowError:
            return self.max_delay_ms
        return int(min(delay, self.max_delay_ms))


class Idempotency(_Frozen):
    """Whether the tool must deduplicate by key. The key is always the operation ID."""

    required: bool = True
    key: Literal["operation_id"] = "operation_id"


class Limits(_Frozen):
    """Budgets enforced before a call runs, per actor and tool."""

    max_per_hour: int | None = Field(default=None, ge=1)
    max_per_minute: int | None = Field(default=None, ge=1)


class RiskCondition(_Frozen):
    """A predicate over the arguments or the context. All given fields must hold.

    `argument` is a JSON pointer into the normalized arguments. Comparisons
    apply to the value there; `count_*` to the length of an array or string.
    """

    argument: str | None = Field(default=None, pattern=r"^(/[^/]*)*$")
    gt: float | None = None
    gte: float | None = None
    lt: float | None = None
    equals: Any = None
    one_of: tuple[Any, ...] | None = None
    count_gt: int | None = None
    environment: str | None = None
    target_owned_by_other: bool | None = Field(
        default=None, description="A resolved target belongs to another principal."
    )


class RiskRule(_Frozen):
    """Raise the risk to `level` when `when` holds."""

    when: RiskCondition
    level: RiskLevel
    reason: str = Field(min_length=3)


class RiskPolicy(_Frozen):
    """A base risk for the tool plus argument-aware escalations."""

    base: RiskLevel
    rules: tuple[RiskRule, ...] = ()


class TargetRule(_Frozen):
    """An argument that names a resource, checked through the host's resolver.

    The target must exist and be visible in the caller's tenant. With
    `same_source_as`, its source must equal the value of that other argument;
    with `expected_version_from`, its version must equal that argument.
    """

    argument: str = Field(
        pattern=r"^(/[^/]+)+$",
        description="JSON pointer; a `*` segment ranges over every item of an array.",
    )
    kind: str = Field(min_length=1)
    same_source_as: str | None = Field(default=None, pattern=r"^(/[^/]+)+$")
    expected_version_from: str | None = Field(default=None, pattern=r"^(/[^/]+)+$")
    must_be_owned_by_actor: bool = False


class WriteKey(_Frozen):
    """An argument that names what a write changes, by kind (`ToolContract.writes`).

    Two steps of a plan that may run at the same time conflict when they
    write the same (kind, value): a plan orders them, or it is refused.
    Unlike a `TargetRule`, the resource need not exist yet (a folder a step
    creates).
    """

    argument: str = Field(pattern=r"^(/[^/]+)+$", description="JSON pointer into the arguments.")
    kind: str = Field(min_length=1)


class Compensation(_Frozen):
    """How a succeeded call of this tool is undone: another tool, with arguments built
    from the original call and its result (seeds 001 and 003). Proposing it is always a
    person's or a host's decision, checked and approved as a call of its own."""

    tool: str = Field(pattern=r"^[a-z][a-z0-9_]{1,63}$")
    arguments: dict[str, str] = Field(
        description="Argument name -> where its value comes from: `call:/pointer` (the"
        " original call's arguments) or `result:/pointer` (its result).",
    )

    @model_validator(mode="after")
    def _sources_are_pointers(self) -> Compensation:
        for name, source in self.arguments.items():
            origin, _, pointer = source.partition(":")
            if origin not in ("call", "result") or not (pointer == "" or pointer.startswith("/")):
                raise ValueError(
                    f"compensation argument {name!r}: {source!r} is neither call:/pointer"
                    " nor result:/pointer"
                )
        return self


class ToolVersion(_Frozen):
    """The version record: a changed schema is a changed version."""

    name: str
    version: str
    input_schema_hash: str
    output_schema_hash: str


class ToolContract(_Frozen):
    """All twelve fields of a tool contract, plus the host's policy knobs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{1,63}$", description="Stable verb_object name.")
    version: str = Field(pattern=r"^\d+\.\d+\.\d+$")
    description: ToolDescription
    input_schema: dict[str, Any]
    output_schema: dict[str, Any]
    errors: tuple[ErrorModelEntry, ...] = ()
    effect: EffectClass
    required_capabilities: frozenset[str] = frozenset()
    approval: ApprovalPolicy = ApprovalPolicy()
    timeout_ms: int = Field(gt=0, le=3_600_000)
    retry: RetryPolicy = RetryPolicy()
    reconcile: ReconcilePolicy = ReconcilePolicy()
    idempotency: Idempotency = Idempotency()
    risk: RiskPolicy
    limits: Limits = Limits()
    targets: tuple[TargetRule, ...] = ()
    sensitive_arguments: tuple[str, ...] = Field(
        default=(), description="JSON pointers whose values are never exported in clear."
    )
    max_repair_attempts: int = Field(default=2, ge=0, le=10)
    flows: tuple[str, ...] = Field(
        default=(),
        description="JSON pointers into the output whose values a later step of a plan may"
        " take as an argument (seed 000's allow list of result fields copied into the next"
        " call). Nothing else of a result ever flows into another call.",
    )
    writes: tuple[WriteKey, ...] = Field(
        default=(),
        description="What a call of this tool changes, by kind, for a plan's check of writes"
        " that may run at the same time; empty: its `targets`.",
    )
    compensation: Compensation | None = Field(
        default=None,
        description="The tool that undoes a succeeded call, and its arguments; none: the"
        " effect is not undone by a tool.",
    )

    @model_validator(mode="after")
    def _irreversible_writes_are_not_retried(self) -> ToolContract:
        # A failed attempt of an irreversible write may still have had its
        # effect; retrying it is a human's or reconciliation's call, never a policy's.
        if self.effect is EffectClass.IRREVERSIBLE_WRITE and self.retry.max_attempts > 1:
            raise ValueError(
                "an irreversible write is never retried automatically: retry.max_attempts"
                f" must be 1, not {self.retry.max_attempts}"
            )
        return self

    @cached_property
    def input_schema_hash(self) -> str:
        """SHA-256 of the canonical input schema."""
        return sha256_hex(canonical_json(self.input_schema))

    @cached_property
    def output_schema_hash(self) -> str:
        """SHA-256 of the canonical output schema."""
        return sha256_hex(canonical_json(self.output_schema))

    @property
    def write_keys(self) -> tuple[WriteKey, ...]:
        """What a call writes, by kind (`writes`, else its `targets`); none for a read."""
        if not self.effect.writes:
            return ()
        if self.writes:
            return self.writes
        return tuple(WriteKey(argument=rule.argument, kind=rule.kind) for rule in self.targets)

    @property
    def version_record(self) -> ToolVersion:
        """Name, version and schema hashes: what the ledger records with a proposal."""
        return ToolVersion(
            name=self.name,
            version=self.version,
            input_schema_hash=self.input_schema_hash,
            output_schema_hash=self.output_schema_hash,
        )

    @property
    def key(self) -> tuple[str, str]:
        """(name, version): unique within a registry."""
        return (self.name, self.version)

    def error_category(self, code: str) -> ErrorCategory | None:
        """The category the error model assigns to `code`, if declared."""
        for entry in self.errors:
            if entry.code == code:
                return entry.category
        return None
