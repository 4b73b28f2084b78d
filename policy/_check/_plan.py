"""The checks a plan gets as a whole, beside each step's own layered check (seed 001).

- its shape: step names and operation IDs unique, every dependency a step of
  the plan, no cycle;
- its references: each names a step the referring step depends on (directly
  or not, so that the value exists when the step is released) and a result
  field that step's contract lets flow (`ToolContract.flows`);
- its writes: two steps that may run at the same time (neither depends on
  the other) never write the same (kind, value) (`ToolContract.write_keys`);
- its approval: one requirement for the whole plan, at least as strict as
  that of every step that needs one.

Every finding names its step (`details.step`) and where it stands in the plan
(`path`, a JSON pointer into the plan proposal). Nothing here does I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policy._check._pointer import MISSING, resolve_pointer
from policy._registry import ToolCatalog
from schemas import (
    PLAN_STEP_PATTERN,
    ApprovalRequirement,
    CheckStage,
    ErrorCategory,
    PlanProposal,
    RiskLevel,
    ValidationIssue,
    canonical_json,
    references_in,
)

_STEP_NAME = re.compile(PLAN_STEP_PATTERN)

__all__ = [
    "PlanShape",
    "merge_approvals",
    "parallel_writes",
    "plan_shape",
    "riskiest",
]


@dataclass(frozen=True, slots=True)
class PlanShape:
    """What the plan's edges say, once they are sound."""

    order: tuple[str, ...]
    """Every step, each after all it depends on (stable: the proposal's order otherwise)."""
    ancestors: Mapping[str, frozenset[str]]
    """For each step, every step it depends on, directly or not."""


def _issue(
    code: str, message: str, step: str, path: str, *, repairable: bool = True, **details: Any
) -> ValidationIssue:
    return ValidationIssue(
        stage=CheckStage.STRUCTURE,
        code=code,
        message=message,
        path=path,
        repairable=repairable,
        details={"step": step, **details},
    )


def plan_shape(
    plan: PlanProposal, catalog: ToolCatalog
) -> tuple[PlanShape | None, list[ValidationIssue]]:
    """The plan's order and dependencies, or the findings that leave it without one."""
    issues: list[ValidationIssue] = []
    seen_steps: dict[str, int] = {}
    seen_ids: dict[str, str] = {}
    for index, step in enumerate(plan.steps):
        if step.step in seen_steps:
            issues.append(_issue(
                "plan_duplicate_step", f"step {step.step!r} is named twice in the plan",
                step.step, f"/steps/{index}/step",
            ))
        seen_steps.setdefault(step.step, index)
        if step.operation_id in seen_ids:
            issues.append(_issue(
                "plan_duplicate_operation_id",
                f"step {step.step!r} reuses the operation ID of step"
                f" {seen_ids[step.operation_id]!r}: each step is an operation of its own",
                step.step, f"/steps/{index}/operation_id",
            ))
        seen_ids.setdefault(step.operation_id, step.step)
    for index, step in enumerate(plan.steps):
        for at, needed in enumerate(step.depends_on):
            if needed not in seen_steps:
                issues.append(_issue(
                    "plan_unknown_dependency",
                    f"step {step.step!r} depends on {needed!r}, which is no step of this plan",
                    step.step, f"/steps/{index}/depends_on/{at}",
                    expected=sorted(seen_steps),
                ))
            elif needed == step.step:
                issues.append(_issue(
                    "plan_cycle", f"step {step.step!r} depends on itself",
                    step.step, f"/steps/{index}/depends_on/{at}", cycle=[needed, needed],
                ))
    if issues:
        return None, issues
    order, cycle = _order(plan)
    if cycle:
        first = cycle[0]
        return None, [_issue(
            "plan_cycle",
            "the steps depend on each other in a circle: " + " -> ".join(cycle),
            first, f"/steps/{seen_steps[first]}/depends_on", cycle=cycle,
        )]
    ancestors: dict[str, frozenset[str]] = {}
    by_name = {step.step: step for step in plan.steps}
    for name in order:
        above: set[str] = set()
        for needed in by_name[name].depends_on:
            above.add(needed)
            above |= ancestors[needed]
        ancestors[name] = frozenset(above)
    shape = PlanShape(tuple(order), ancestors)
    return shape, _reference_issues(plan, shape, catalog)


def _order(plan: PlanProposal) -> tuple[list[str], list[str]]:
    """(every step after its dependencies, []) or ([], one cycle as a list of steps)."""
    waiting = {step.step: set(step.depends_on) for step in plan.steps}
    order: list[str] = []
    while waiting:
        free = [name for name, needs in waiting.items() if not needs]
        if not free:
            return [], _a_cycle(waiting)
        for name in free:
            order.append(name)
            del waiting[name]
        for needs in waiting.values():
            needs.difference_update(free)
    return order, []


def _a_cycle(waiting: Mapping[str, set[str]]) -> list[str]:
    # Every step left waits for another left: walking "waits for" edges from
    # any of them must come back to a step already walked.
    path: list[str] = []
    name = min(waiting)
    while name not in path:
        path.append(name)
        name = min(waiting[name])
    return [*path[path.index(name):], name]


def _reference_issues(
    plan: PlanProposal, shape: PlanShape, catalog: ToolCatalog
) -> list[ValidationIssue]:
    issues: list[ValidationIssue] = []
    by_name = {step.step: step for step in plan.steps}
    for index, step in enumerate(plan.steps):
        for ref in references_in(step.arguments):
            path = f"/steps/{index}/arguments{ref.at}"
            if (
                not isinstance(ref.step, str)
                or not isinstance(ref.pointer, str)
                or not (ref.pointer == "" or ref.pointer.startswith("/"))
                or not _is_step_name(ref.step)
            ):
                issues.append(_issue(
                    "plan_bad_reference",
                    'a reference is {"$result": {"step": NAME, "pointer": "/field"}}',
                    step.step, path,
                ))
                continue
            if ref.step not in shape.ancestors[step.step]:
                issues.append(_issue(
                    "plan_reference_not_a_dependency",
                    f"step {step.step!r} takes a result of {ref.step!r} without depending on"
                    " it: add it to depends_on",
                    step.step, path, expected=sorted(shape.ancestors[step.step]),
                    actual=ref.step,
                ))
                continue
            source = catalog.get(by_name[ref.step].tool_name)
            allowed = source.flows if source is not None else ()
            if ref.pointer not in allowed:
                issues.append(_issue(
                    "plan_result_field_not_allowed",
                    f"the result field {ref.pointer!r} of {by_name[ref.step].tool_name} may not"
                    " flow into another call (its contract's `flows`)",
                    step.step, path, repairable=False, expected=list(allowed),
                    actual=ref.pointer,
                ))
    return issues


def _is_step_name(name: str) -> bool:
    return _STEP_NAME.fullmatch(name) is not None


def parallel_writes(
    plan: PlanProposal,
    shape: PlanShape,
    catalog: ToolCatalog,
    arguments: Mapping[str, Mapping[str, Any]],
) -> list[ValidationIssue]:
    """Two steps that may run at the same time and write the same (kind, value).

    `arguments`: each step's arguments as checked. A value that is still a
    reference is not compared: what it will be is not known, and the
    release-time check of each step sees it then.
    """
    written: list[tuple[int, str, str, bytes, Any]] = []
    for index, step in enumerate(plan.steps):
        contract = catalog.get(step.tool_name)
        if contract is None or step.step not in arguments:
            continue
        for key in contract.write_keys:
            value = resolve_pointer(arguments[step.step], key.argument)
            if value is MISSING or any(True for _ in references_in(value)):
                continue
            written.append((index, step.step, key.kind, canonical_json(value), value))
    issues = []
    for i, (_, a, kind_a, value_a, value) in enumerate(written):
        for index_b, b, kind_b, value_b, _ in written[i + 1:]:
            ordered = a in shape.ancestors[b] or b in shape.ancestors[a]
            if a != b and not ordered and (kind_a, value_a) == (kind_b, value_b):
                issues.append(_issue(
                    "plan_parallel_writes",
                    f"steps {a!r} and {b!r} may run at the same time and both write {kind_a}"
                    f" {value!r}: make one depend on the other",
                    b, f"/steps/{index_b}", kind=kind_a, other_step=a,
                ))
    return issues


def riskiest(levels: Sequence[RiskLevel]) -> RiskLevel:
    """The plan's risk: at least its riskiest step's."""
    return max(levels, key=lambda level: level.rank, default=RiskLevel.LOW)


def merge_approvals(
    requirements: Mapping[str, ApprovalRequirement],
) -> ApprovalRequirement | ValidationIssue | None:
    """One approval for the whole plan, at least as strict as every step's that needs one:
    the approvers must hold a role each of those steps accepts, as many of them as the
    strictest step asks, the shares of each, separation of duties if any asks it, and
    the shortest expiry. An issue when no role may approve every such step."""
    if not requirements:
        return None
    roles: set[str] | None = None
    shares: dict[str, int] = {}
    for requirement in requirements.values():
        held = set(requirement.approver_roles)
        roles = held if roles is None else roles & held
        for role, count in requirement.required_from.items():
            shares[role] = max(shares.get(role, 0), count)
    assert roles is not None
    if not roles or any(role not in roles for role in shares):
        steps = sorted(requirements)
        return ValidationIssue(
            stage=CheckStage.APPROVAL,
            code="plan_no_common_approver",
            message="no approver role may approve every step that needs approval: propose"
            " those steps as plans or calls of their own",
            repairable=False,
            category=ErrorCategory.POLICY_DENIED,
            details={"step": steps[0], "steps": steps},
        )
    required = max(r.required_approvals for r in requirements.values())
    required = max(required, sum(shares.values()))
    return ApprovalRequirement(
        approver_roles=tuple(sorted(roles)),
        required_approvals=required,
        required_from=shares,
        separation_of_duties=any(r.separation_of_duties for r in requirements.values()),
        expires_in_s=min(r.expires_in_s for r in requirements.values()),
        reason="; ".join(f"{step}: {r.reason}" for step, r in sorted(requirements.items())),
    )
