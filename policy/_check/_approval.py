"""Stage 7, approval: whether a human must approve, from risk and the contract's policy."""

from __future__ import annotations

from policy._contract import ApprovalMode, ToolContract
from schemas import ApprovalRequirement, CheckStage, ErrorCategory, RiskLevel, ValidationIssue

__all__ = ["approval_requirement"]


def approval_requirement(
    contract: ToolContract, risk: RiskLevel
) -> ApprovalRequirement | ValidationIssue | None:
    """None when no approval is needed; an issue when the tool is forbidden outright."""
    policy = contract.approval
    if policy.mode is ApprovalMode.FORBIDDEN:
        return ValidationIssue(
            stage=CheckStage.APPROVAL,
            code="TOOL_FORBIDDEN",
            message="this tool may not be run by agents",
            repairable=False,
            category=ErrorCategory.POLICY_DENIED,
        )
    if policy.mode is ApprovalMode.NEVER:
        return None
    if policy.mode is ApprovalMode.RISK_AT_LEAST:
        assert policy.risk_threshold is not None  # enforced by the contract model
        if not risk.at_least(policy.risk_threshold):
            return None
        reason = f"risk {risk.value} reaches the approval threshold {policy.risk_threshold.value}"
    elif policy.mode is ApprovalMode.TWO_PERSON:
        reason = "this tool needs two distinct approvers"
    else:
        reason = "this tool always needs approval"
    required = policy.approvals_for(risk)
    if (
        policy.two_person_from is not None
        and risk.at_least(policy.two_person_from)
        and required == 2
    ):
        reason += (
            f"; risk {risk.value} reaches the two-person threshold {policy.two_person_from.value}"
        )
    elif required > 1 and policy.mode is not ApprovalMode.TWO_PERSON:
        reason += f"; {required} distinct approvers"
    if policy.required_from:
        shares = ", ".join(f"{n} {r}" for r, n in sorted(policy.required_from.items()))
        reason += f" (at least {shares})"
    return ApprovalRequirement(
        approver_roles=policy.approver_roles,
        required_approvals=required,
        required_from=dict(policy.required_from),
        separation_of_duties=policy.separation_of_duties,
        expires_in_s=policy.expires_after_s,
        reason=reason,
    )
