"""Stage 5, authorization: from the trusted runtime context only."""

from __future__ import annotations

from policy._contract import ToolContract
from schemas import CheckStage, ErrorCategory, RuntimeContext, ValidationIssue

__all__ = ["check_authorization"]


def check_authorization(contract: ToolContract, context: RuntimeContext) -> list[ValidationIssue]:
    """Findings when the context lacks a capability the contract requires.

    The names of the missing capabilities are safe to show: they come from the
    host's own contract, not from any resource.
    """
    missing = sorted(contract.required_capabilities - context.capabilities)
    if not missing:
        return []
    return [
        ValidationIssue(
            stage=CheckStage.AUTHORIZATION,
            code="CAPABILITY_DENIED",
            message="the caller lacks a capability this tool requires",
            expected=missing,
            repairable=False,
            category=ErrorCategory.UNAUTHORIZED,
        )
    ]
