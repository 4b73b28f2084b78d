"""The one entry point: a raw proposal plus trusted context in, a decision out."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from policy._check._approval import approval_requirement
from policy._check._authorization import check_authorization
from policy._check._budget import check_budget
from policy._check._parse import DEFAULT_LIMITS, ArgumentLimits, parse_arguments
from policy._check._risk import assess_risk
from policy._check._semantics import AffectedTarget, check_semantics, describe_targets
from policy._check._structure import CompiledSchema, apply_defaults
from policy._contract import ToolContract
from policy._ports import BudgetCounter, SemanticRule, TargetResolver
from policy._registry import ToolCatalog
from schemas import (
    REPAIR_EXHAUSTED,
    CanonicalizationError,
    CheckStage,
    Decision,
    DecisionOutcome,
    ErrorCategory,
    RepairStatus,
    RuntimeContext,
    ToolProposal,
    ValidationIssue,
    proposal_hash,
)

__all__ = ["ProposalChecker"]

_log = logging.getLogger(__name__)


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _known(issues: Sequence[ValidationIssue], deferred: frozenset[str]) -> list[ValidationIssue]:
    """`issues` but those about an argument whose value is not known yet."""
    if not deferred:
        return list(issues)
    return [
        issue
        for issue in issues
        if not any(issue.path == at or issue.path.startswith(f"{at}/") for at in deferred)
    ]


class ProposalChecker:
    """Runs the layered check on proposals against one pinned catalog.

    Stages run in order and stop at the first that finds a fault, so repair
    feedback is about one layer at a time. `check` never raises: every failure,
    including a bug in a semantic rule, becomes a rejected decision.
    """

    def __init__(
        self,
        catalog: ToolCatalog,
        *,
        resolver: TargetResolver | None = None,
        rules: Mapping[str, Sequence[SemanticRule]] | None = None,
        budget: BudgetCounter | None = None,
        clock: Callable[[], datetime] = _utcnow,
        limits: ArgumentLimits = DEFAULT_LIMITS,
    ) -> None:
        self.catalog = catalog
        self.limits = limits
        self._resolver = resolver
        self._rules = dict(rules or {})
        self._budget = budget
        self._clock = clock
        self._schemas = {
            name: CompiledSchema(c.input_schema, max_issues=limits.max_issues)
            for name, c in catalog.items()
        }

    def check(
        self,
        proposal: ToolProposal | Mapping[str, Any],
        context: RuntimeContext,
        *,
        deferred: frozenset[str] = frozenset(),
    ) -> Decision:
        """Decide on one proposal: ready, needs approval, or rejected.

        `deferred`: JSON pointers of arguments whose values are not known yet (a
        plan's step that takes a field of an earlier step's result); findings
        at or under them are left for the check of the step with its values.
        """
        try:
            if not isinstance(proposal, ToolProposal):
                try:
                    proposal = ToolProposal.model_validate(proposal)
                except ValidationError as exc:
                    return _malformed_envelope(proposal, exc)
            return self._check(proposal, context, deferred)
        except Exception:
            _log.exception("proposal check failed")
            proposal_id = proposal.proposal_id if isinstance(proposal, ToolProposal) else ""
            tool = proposal.tool_name if isinstance(proposal, ToolProposal) else ""
            return _rejected(
                proposal_id,
                tool,
                [
                    ValidationIssue(
                        stage=CheckStage.PARSE,
                        code="CHECK_FAILED",
                        message="the proposal could not be checked",
                        repairable=False,
                        category=ErrorCategory.INTERNAL,
                    )
                ],
            )

    def _check(
        self, proposal: ToolProposal, context: RuntimeContext, deferred: frozenset[str]
    ) -> Decision:
        arguments, issues = parse_arguments(proposal.arguments, self.limits)
        contract = self.catalog.get(proposal.tool_name)
        if contract is None:
            return _rejected(
                proposal.proposal_id,
                proposal.tool_name,
                [
                    ValidationIssue(
                        stage=CheckStage.TOOL,
                        code="unknown_tool",
                        message="no tool of this name is available",
                        expected=sorted(self.catalog),
                        actual=proposal.tool_name[:128],
                        repairable=True,
                    )
                ],
            )
        # A forbidden tool is refused before anything else: its callers learn
        # nothing about their arguments or about the targets they name.
        forbidden = approval_requirement(contract, contract.risk.base)
        if isinstance(forbidden, ValidationIssue):
            return self._reject(proposal, contract, [forbidden])
        if arguments is None:
            return self._reject(proposal, contract, issues)

        normalized, applied = apply_defaults(contract.input_schema, arguments)
        issues = _known(self._schemas[contract.name].issues(normalized), deferred)
        if issues:
            return self._reject(proposal, contract, issues)
        try:
            hashed = proposal_hash(
                tool=contract.name,
                tool_version=contract.version,
                arguments=normalized,
                actor=context.principal,
                tenant=context.tenant,
            )
        except CanonicalizationError as exc:
            return self._reject(
                proposal,
                contract,
                [
                    ValidationIssue(
                        stage=CheckStage.STRUCTURE,
                        code="not_canonical",
                        message=f"arguments have no canonical JSON form: {exc}",
                        repairable=True,
                    )
                ],
            )

        now = self._clock()
        # Authorization (stage 5) runs before target resolution (stage 4) on
        # purpose: a caller without the capability must not be able to probe
        # which targets exist.
        issues = check_authorization(contract, context)
        targets: dict[str, Any] = {}
        if not issues:
            targets, issues = check_semantics(
                contract,
                normalized,
                context,
                resolver=self._resolver,
                rules=self._rules.get(contract.name, ()),
                now=now,
            )
            issues = _known(issues, deferred)
        if issues:
            return self._reject(proposal, contract, issues, normalized, applied, hashed)

        risk, reasons = assess_risk(contract, normalized, context, targets)
        requirement = approval_requirement(contract, risk)
        if isinstance(requirement, ValidationIssue):
            return self._reject(
                proposal, contract, [requirement], normalized, applied, hashed, risk, reasons
            )
        if self._budget is not None:
            issues = check_budget(contract, context, self._budget, now)
            if issues:
                return self._reject(
                    proposal, contract, issues, normalized, applied, hashed, risk, reasons
                )

        return Decision(
            outcome=(
                DecisionOutcome.READY if requirement is None else DecisionOutcome.NEEDS_APPROVAL
            ),
            **_checked(proposal, contract, normalized, applied, hashed, risk, reasons),
            approval=requirement,
            repair=self._repair_status(proposal, contract, exhausted=False),
        )

    def affected_targets(
        self, decision: Decision, context: RuntimeContext, *, limit: int = 50
    ) -> tuple[list[AffectedTarget], int]:
        """What a checked call acts on, for an approver: its targets resolved through the
        host's resolver (names, titles), at most `limit` of them, and how many in all.

        Kept off the `Decision` on purpose: the host and its model see IDs only, the
        approver sees who they are.
        """
        contract = self.catalog.get(decision.tool)
        if contract is None or decision.normalized_arguments is None:
            return [], 0
        return describe_targets(
            contract, decision.normalized_arguments, context, self._resolver, limit=limit
        )

    def refuse(self, proposal: ToolProposal, issues: Sequence[ValidationIssue]) -> Decision:
        """A rejection decided outside the layered check: the ledger's repair bound.

        A `repair_exhausted` finding marks the repair loop exhausted.
        """
        contract = self.catalog.get(proposal.tool_name)
        if contract is None:
            return _rejected(proposal.proposal_id, proposal.tool_name, list(issues))
        return self._reject(proposal, contract, issues)

    def _repair_status(
        self, proposal: ToolProposal, contract: ToolContract, *, exhausted: bool
    ) -> RepairStatus:
        return RepairStatus(
            attempt=proposal.repair_attempt,
            max_attempts=contract.max_repair_attempts,
            exhausted=exhausted,
        )

    def _reject(
        self,
        proposal: ToolProposal,
        contract: ToolContract,
        issues: Sequence[ValidationIssue],
        normalized: dict[str, Any] | None = None,
        applied: Sequence[str] = (),
        hashed: str | None = None,
        risk: Any = None,
        reasons: tuple[str, ...] = (),
    ) -> Decision:
        repairable = all(issue.repairable for issue in issues)
        exhausted = (
            repairable and proposal.repair_attempt >= contract.max_repair_attempts
        ) or any(issue.code == REPAIR_EXHAUSTED for issue in issues)
        question = next((issue.question for issue in issues if issue.question), None)
        return Decision(
            # Only the user can settle a question: not a rejection to repair.
            outcome=(
                DecisionOutcome.REJECTED
                if question is None
                else DecisionOutcome.NEEDS_CLARIFICATION
            ),
            question=question,
            **_checked(proposal, contract, normalized, applied, hashed, risk, reasons),
            issues=bounded_issues(issues, self.limits.max_issues),
            repair=self._repair_status(proposal, contract, exhausted=exhausted),
            category=issues[0].category,
        )


def _checked(
    proposal: ToolProposal,
    contract: ToolContract,
    normalized: dict[str, Any] | None,
    applied: Sequence[str],
    hashed: str | None,
    risk: Any,
    reasons: tuple[str, ...],
) -> dict[str, Any]:
    """The decision fields every checked proposal has, whatever the outcome."""
    return {
        "proposal_id": proposal.proposal_id,
        "tool": contract.name,
        "tool_version": contract.version,
        "input_schema_hash": contract.input_schema_hash,
        "output_schema_hash": contract.output_schema_hash,
        "proposal_hash": hashed,
        "normalized_arguments": normalized,
        "applied_defaults": tuple(applied),
        "risk": risk,
        "risk_reasons": reasons,
    }


def bounded_issues(issues: Sequence[ValidationIssue], limit: int) -> tuple[ValidationIssue, ...]:
    """At most `limit` findings, then one that says how many more there were.

    Every finding is stored with the rejected operation and sent back in the
    reply: a 100,000-item array of wrong types must not become 100,000
    findings, which would be larger than any message may be.
    """
    shown = tuple(_short(issue) for issue in issues[:limit])
    if len(issues) <= limit:
        return shown
    omitted = len(issues) - limit
    more = ValidationIssue(
        stage=issues[limit].stage,
        code="more_issues",
        message=f"{omitted} more finding(s) not shown; fix these first",
        actual=omitted,
        repairable=all(issue.repairable for issue in issues[limit:]),
        category=issues[limit].category,
    )
    return (*shown, more)


_MAX_POINTER_CHARS = 256
_MAX_MESSAGE_CHARS = 300


def _short(issue: ValidationIssue) -> ValidationIssue:
    """`issue`, its pointer and message shortened: both can be as long as the input
    (a property name of 200 KiB is "not a known property")."""
    update: dict[str, str] = {}
    if len(issue.path) > _MAX_POINTER_CHARS:
        update["path"] = issue.path[: _MAX_POINTER_CHARS - 1] + "…"
    if len(issue.message) > _MAX_MESSAGE_CHARS:
        update["message"] = issue.message[: _MAX_MESSAGE_CHARS - 1] + "…"
    return issue.model_copy(update=update) if update else issue


def _rejected(proposal_id: str, tool: str, issues: list[ValidationIssue]) -> Decision:
    return Decision(
        outcome=DecisionOutcome.REJECTED,
        proposal_id=proposal_id,
        tool=tool,
        issues=bounded_issues(issues, DEFAULT_LIMITS.max_issues),
        category=issues[0].category,
    )


def _malformed_envelope(raw: Any, exc: ValidationError) -> Decision:
    """A proposal whose envelope (not its arguments) is malformed: the host's bug."""
    issues = [
        ValidationIssue(
            stage=CheckStage.PARSE,
            code="invalid_envelope",
            message=str(error["msg"]),
            path="/" + "/".join(str(part) for part in error["loc"]),
            repairable=False,
        )
        for error in exc.errors()[:10]
    ]
    proposal_id = raw.get("proposal_id") if isinstance(raw, Mapping) else None
    tool = raw.get("tool_name") if isinstance(raw, Mapping) else None
    return _rejected(
        proposal_id if isinstance(proposal_id, str) else "",
        tool if isinstance(tool, str) else "",
        issues,
    )
