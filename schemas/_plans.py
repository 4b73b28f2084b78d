"""Plans on the wire: several tool calls proposed as one ordered, approved unit.

A plan is a set of steps, each an ordinary tool call with its own operation
ID (its idempotency key, as for a single proposal), and `depends_on` edges
between steps. An argument of a later step may take a field of an earlier
step's result, written as a reference in place of the value:

    {"path": {"$result": {"step": "create-folder", "pointer": "/path"}}}

Only fields the earlier tool's contract lets flow (`ToolContract.flows`, seed
000's allow list of result fields that may be copied into the next call) are
accepted, and only from a step the later one depends on; the ledger puts the
value in when it releases the step, never the host.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import Field, model_validator

from schemas._base import WireModel
from schemas._canonical import canonical_json, sha256_hex
from schemas._proposal import PLAIN_TEXT_PATTERN, RuntimeContext
from schemas._subjects import TOKEN_PATTERN

__all__ = [
    "MAX_PLAN_STEPS",
    "PLAN_STEP_PATTERN",
    "REFERENCE_KEY",
    "PlanProposal",
    "PlanRequest",
    "PlanStatus",
    "PlanStep",
    "PlanStepStatus",
    "ResultReference",
    "plan_hash",
    "references_in",
]

MAX_PLAN_STEPS: Final = 32
"""The most steps one plan may hold: a plan is shown whole to the person approving it."""
PLAN_STEP_PATTERN: Final = r"^[a-z0-9][a-z0-9_-]{0,63}$"
"""A step's name: lower-case letters, digits, `-` and `_`, at most 64."""
REFERENCE_KEY: Final = "$result"
"""The one key of an argument value that stands for a field of an earlier step's result."""

_Name = Annotated[str, Field(min_length=1, max_length=128, pattern=PLAIN_TEXT_PATTERN)]
_Step = Annotated[str, Field(pattern=PLAN_STEP_PATTERN)]


class PlanStep(WireModel):
    """One step of a plan: a tool call, and the steps that must succeed before it runs."""

    step: _Step = Field(description="The step's name within the plan (unique).")
    operation_id: str = Field(
        pattern=TOKEN_PATTERN,
        description="The host's operation ID of this step's call: its idempotency key,"
        " exactly as for a single proposal.",
    )
    tool_name: str = Field(pattern=TOKEN_PATTERN)
    arguments: dict[str, Any] = Field(
        description="The call's arguments. A value may be a reference"
        ' `{"$result": {"step": NAME, "pointer": "/field"}}` to a field of the result of a'
        " step this one depends on, when that tool's contract lets the field flow."
    )
    depends_on: tuple[_Step, ...] = Field(
        default=(),
        max_length=MAX_PLAN_STEPS,
        description="Steps that must have succeeded before this one runs. Steps that do"
        " not depend on each other, directly or not, may run at the same time.",
    )


class PlanProposal(WireModel):
    """Several tool calls proposed as one unit: checked whole, approved whole, run in order."""

    plan_id: str = Field(
        pattern=TOKEN_PATTERN,
        description="The host's ID of the plan (its idempotency key; scoped per host).",
    )
    conversation_id: _Name
    requested_by_user_id: _Name
    steps: tuple[PlanStep, ...] = Field(min_length=1, max_length=MAX_PLAN_STEPS)


@dataclass(frozen=True, slots=True)
class ResultReference:
    """A reference found in a step's arguments: where it stands and what it names."""

    at: str
    """The JSON pointer, within the step's arguments, of the value it stands for."""
    step: object
    """The step it names (as written: checked by the plan check, not here)."""
    pointer: object
    """The field of that step's result it names (as written)."""


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _is_reference(value: object) -> bool:
    return isinstance(value, Mapping) and set(value) == {REFERENCE_KEY}


def references_in(arguments: object, at: str = "") -> Iterator[ResultReference]:
    """Every reference in `arguments`, depth first, with the pointer it stands at."""
    if _is_reference(arguments):
        assert isinstance(arguments, Mapping)
        body = arguments[REFERENCE_KEY]
        named = body if isinstance(body, Mapping) else {}
        yield ResultReference(at, named.get("step"), named.get("pointer"))
    elif isinstance(arguments, Mapping):
        for key, value in arguments.items():
            yield from references_in(value, f"{at}/{_escape(str(key))}")
    elif isinstance(arguments, list):
        for index, value in enumerate(arguments):
            yield from references_in(value, f"{at}/{index}")


def plan_hash(steps: Sequence[Mapping[str, Any]]) -> str:
    """SHA-256 of a plan's RFC 8785 canonical form: every step's call as checked, in the
    order proposed, with its edges. What one approval of the plan names: a changed
    argument, another tool version, a reordering, an added, dropped or rewired step
    all give another hash."""
    return sha256_hex(canonical_json({"plan": list(steps)}))


class PlanStepStatus(WireModel):
    """One row of a plan's step table."""

    step: str
    operation_id: str = Field(description="The step's operation (the host's ID to a host).")
    tool: str
    state: str = Field(
        description="`waiting` (not released yet), `skipped`, or the state of the step's"
        " operation (`ready`, `executing`, `succeeded`, `failed`, ...)."
    )
    depends_on: tuple[str, ...] = ()
    skipped_because: str | None = Field(
        default=None, description="For a skipped step: why (which step did not succeed)."
    )
    retry_needed: bool = Field(
        default=False,
        description="Whether retrying the plan runs this step again (it failed or was"
        " skipped). A succeeded step never runs again.",
    )
    compensation: str | None = Field(
        default=None,
        description="For a succeeded step: the tool that undoes it, if its contract names"
        " one (`delete_file`, `revoke_access`); null when its effect cannot be undone.",
    )


class PlanStatus(WireModel):
    """Where a plan stands, with its step table."""

    plan_id: str = Field(description="To a host, its own ID; to people, the ledger's.")
    state: str = Field(
        description="`proposed`, `rejected`, `awaiting_approval`, `approval_denied`,"
        " `approval_expired`, `running`, `succeeded`, `partially_succeeded`, `failed` or"
        " `cancelled`."
    )
    final: bool
    plan_hash: str | None = Field(
        default=None, description="What one approval of this plan names (RFC 8785, SHA-256)."
    )
    risk: str | None = None
    steps: tuple[PlanStepStatus, ...] = ()
    issues: tuple[dict[str, Any], ...] = Field(
        default=(),
        description="For a rejected plan: every finding, each naming its step"
        " (`details.step`) and where it stands in the plan (`path`).",
    )
    approvals_required: int = 0
    approvals_granted: int = 0
    cancel_requested: bool = False


class PlanRequest(WireModel):
    """What a host sends on `ops.plan.<host>`: propose a plan (with the trusted runtime
    context of its caller, as for a single proposal), ask where one stands, or cancel
    one. Answered with the plan's `PlanStatus`, or the error envelope."""

    command: Literal["propose", "status", "cancel"]
    plan: PlanProposal | None = Field(default=None, description="For `propose`.")
    context: RuntimeContext | None = Field(default=None, description="For `propose`.")
    plan_id: str | None = Field(
        default=None, pattern=TOKEN_PATTERN, description="For `status` and `cancel`."
    )
    reason: str = Field(default="", max_length=500)

    @model_validator(mode="after")
    def _what_the_command_needs(self) -> PlanRequest:
        if self.command == "propose" and (self.plan is None or self.context is None):
            raise ValueError("`propose` sends `plan` and `context`")
        if self.command != "propose" and self.plan_id is None:
            raise ValueError(f"`{self.command}` names `plan_id`")
        return self

    @property
    def asked_id(self) -> str:
        """The host's ID of the plan this request is about."""
        if self.plan is not None:
            return self.plan.plan_id
        assert self.plan_id is not None
        return self.plan_id
