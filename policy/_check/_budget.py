"""Stage 8, budget: per actor and tool rate limits from the contract."""

from __future__ import annotations

from datetime import datetime, timedelta

from policy._contract import ToolContract
from policy._ports import BudgetCounter
from schemas import CheckStage, ErrorCategory, RuntimeContext, ValidationIssue

__all__ = ["check_budget"]


def check_budget(
    contract: ToolContract,
    context: RuntimeContext,
    counter: BudgetCounter,
    now: datetime,
) -> list[ValidationIssue]:
    """A finding for the first window whose limit is already used up."""
    windows = (
        (contract.limits.max_per_minute, timedelta(minutes=1), "minute"),
        (contract.limits.max_per_hour, timedelta(hours=1), "hour"),
    )
    for limit, window, name in windows:
        if limit is None:
            continue
        used = counter.count(
            tenant=context.tenant, actor=context.principal, tool=contract.name, since=now - window
        )
        if used >= limit:
            return [
                ValidationIssue(
                    stage=CheckStage.BUDGET,
                    code="BUDGET_EXCEEDED",
                    message=f"at most {limit} calls of this tool per {name}",
                    expected=limit,
                    actual=used,
                    repairable=False,
                    category=ErrorCategory.TRANSIENT,
                    details={"retry_after_ms": int(window.total_seconds() * 1000)},
                )
            ]
    return []
