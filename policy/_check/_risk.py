"""Stage 6, risk: argument-aware, from the trusted contract's rules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policy._check._pointer import MISSING, resolve_pointer
from policy._contract import RiskCondition, ToolContract
from policy._ports import Target
from schemas import RiskLevel, RuntimeContext

__all__ = ["assess_risk"]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _holds(
    condition: RiskCondition,
    arguments: Mapping[str, Any],
    context: RuntimeContext,
    targets: Mapping[str, Target],
) -> bool:
    if condition.environment is not None and condition.environment != context.environment:
        return False
    if condition.target_owned_by_other is not None:
        other = any(t.owner is not None and t.owner != context.principal for t in targets.values())
        if other != condition.target_owned_by_other:
            return False
    if condition.argument is None:
        return True
    value = resolve_pointer(arguments, condition.argument)
    if value is MISSING:
        return False
    number = _number(value)
    if condition.gt is not None and (number is None or not number > condition.gt):
        return False
    if condition.gte is not None and (number is None or not number >= condition.gte):
        return False
    if condition.lt is not None and (number is None or not number < condition.lt):
        return False
    if condition.count_gt is not None and (
        not isinstance(value, list | str | dict) or len(value) <= condition.count_gt
    ):
        return False
    if condition.equals is not None and not _same(value, condition.equals):
        return False
    return not (
        condition.one_of is not None and not any(_same(value, o) for o in condition.one_of)
    )


def _same(left: Any, right: Any) -> bool:
    """JSON equality: `true` is not `1`, unlike Python's `==`."""
    return (type(left) is type(right) and left == right) or (
        _number(left) is not None and _number(right) is not None and left == right
    )


def assess_risk(
    contract: ToolContract,
    arguments: Mapping[str, Any],
    context: RuntimeContext,
    targets: Mapping[str, Target],
) -> tuple[RiskLevel, tuple[str, ...]]:
    """The highest level among the base and every rule that holds, with the rules' reasons."""
    level = contract.risk.base
    reasons: list[str] = []
    for rule in contract.risk.rules:
        if _holds(rule.when, arguments, context, targets):
            reasons.append(rule.reason)
            if rule.level.rank > level.rank:
                level = rule.level
    return level, tuple(reasons)
