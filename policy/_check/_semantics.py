"""Stage 4, semantics: target resolution and per-tool cross-field rules.

Schema-valid is not executable: an ID can have the right shape and name
another tenant's document, or a snapshot of a different source. Findings about
targets never reveal what the caller may not see: a target in another tenant
is reported exactly like one that does not exist.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from policy._check._pointer import MISSING, resolve_pointer
from policy._contract import TargetRule, ToolContract
from policy._ports import AmbiguousTarget, SemanticInput, SemanticRule, Target, TargetResolver
from schemas import CheckStage, ErrorCategory, RuntimeContext, ValidationIssue

__all__ = ["AffectedTarget", "check_semantics", "describe_targets"]


def _issue(
    code: str, path: str, message: str, *, category: ErrorCategory, repairable: bool, **extra: Any
) -> ValidationIssue:
    return ValidationIssue(
        stage=CheckStage.SEMANTICS,
        code=code,
        message=message,
        path=path,
        repairable=repairable,
        category=category,
        **extra,
    )


def _label(target: Target) -> str:
    """How a candidate is named in a question to the user (its own tenant's record)."""
    attributes = target.attributes
    parts = [str(attributes[key]) for key in ("name", "email", "title") if attributes.get(key)]
    return ", ".join(parts) or target.id


def _expand(arguments: Mapping[str, Any], pointer: str) -> list[tuple[str, Any]]:
    """(concrete pointer, value) for a pointer whose `*` segments range over array items."""
    if "/*" not in pointer:
        return [(pointer, resolve_pointer(arguments, pointer))]
    head, _, tail = pointer.partition("/*")
    items = resolve_pointer(arguments, head)
    if not isinstance(items, list):
        return []
    found: list[tuple[str, Any]] = []
    for index in range(len(items)):
        found.extend(_expand(arguments, f"{head}/{index}{tail}"))
    return found


def _resolve_target(
    rule: TargetRule,
    pointer: str,
    target_id: Any,
    arguments: Mapping[str, Any],
    context: RuntimeContext,
    resolver: TargetResolver,
) -> tuple[Target | None, list[ValidationIssue]]:
    if target_id is MISSING or target_id is None:
        return None, []  # optional argument not given; the schema decides if it is required
    found = resolver.resolve(rule.kind, str(target_id), context)
    if isinstance(found, AmbiguousTarget):
        # Only the caller's tenant's matches count; several of them is a question
        # for the user, not a repair for the model (seed 001's needs_clarification).
        mine = [match for match in found.matches if match.tenant == context.tenant]
        if len(mine) > 1:
            return None, [
                _issue(
                    "TARGET_AMBIGUOUS",
                    pointer,
                    f"{len(mine)} {rule.kind} records answer to '{target_id}'",
                    category=ErrorCategory.INVALID_INPUT,
                    repairable=False,
                    actual=str(target_id),
                    question=f"Which {rule.kind} do you mean? {len(mine)} records answer to"
                    f" '{target_id}': "
                    + "; ".join(_label(match) for match in mine[:5]),
                )
            ]
        found = mine[0] if mine else None
    target = found
    not_found = _issue(
        "TARGET_NOT_FOUND",
        pointer,
        f"no {rule.kind} '{target_id}' is visible to this caller",
        category=ErrorCategory.NOT_FOUND,
        repairable=True,
        actual=str(target_id),
    )
    if target is None or target.tenant != context.tenant:
        return None, [not_found]
    issues: list[ValidationIssue] = []
    if rule.must_be_owned_by_actor and target.owner != context.principal:
        # Another user's resource is reported like a missing one: the caller
        # learns nothing about what others own.
        return None, [not_found]
    if rule.same_source_as is not None:
        expected = resolve_pointer(arguments, rule.same_source_as)
        if expected is not MISSING and target.source_id != expected:
            issues.append(
                _issue(
                    "SOURCE_MISMATCH",
                    pointer,
                    f"{rule.kind} '{target_id}' belongs to another source",
                    category=ErrorCategory.INVALID_INPUT,
                    repairable=True,
                    expected=expected,
                    actual=target.source_id,
                    details={
                        "expected_source_id": expected,
                        "observed_source_id": target.source_id,
                        "comparison_performed": False,
                    },
                )
            )
    if rule.expected_version_from is not None:
        expected_version = resolve_pointer(arguments, rule.expected_version_from)
        if expected_version is not MISSING and str(expected_version) != str(target.version):
            issues.append(
                _issue(
                    "STALE_TARGET",
                    rule.expected_version_from,
                    f"{rule.kind} '{target_id}' has changed since it was read",
                    category=ErrorCategory.CONFLICT,
                    repairable=True,
                    expected=expected_version,
                    actual=target.version,
                )
            )
    return target, issues


def check_semantics(
    contract: ToolContract,
    arguments: Mapping[str, Any],
    context: RuntimeContext,
    *,
    resolver: TargetResolver | None,
    rules: Sequence[SemanticRule],
    now: datetime,
) -> tuple[dict[str, Target], list[ValidationIssue]]:
    """Resolve the contract's targets and run its rules; returns targets and findings."""
    targets: dict[str, Target] = {}
    issues: list[ValidationIssue] = []
    if contract.targets and resolver is None:
        issues.append(
            _issue(
                "RESOLVER_UNAVAILABLE",
                "",
                "targets of this tool cannot be checked right now",
                category=ErrorCategory.TRANSIENT,
                repairable=False,
            )
        )
        return targets, issues
    for rule in contract.targets:
        assert resolver is not None  # checked above whenever there are targets
        for pointer, target_id in _expand(arguments, rule.argument):
            target, found = _resolve_target(
                rule, pointer, target_id, arguments, context, resolver
            )
            if target is not None:
                targets[pointer] = target
            issues.extend(found)
    if issues:
        # Cross-field rules assume their targets resolved; running them now
        # would only add noise to the repair feedback.
        return targets, issues
    semantic_input = SemanticInput(
        tool=contract.name, arguments=arguments, context=context, targets=targets, now=now
    )
    for rule_fn in rules:
        issues.extend(rule_fn(semantic_input))
    return targets, issues


_LABELS = ("name", "title", "display_name")
"""Attributes that name a target for a person, in order of preference."""


@dataclass(frozen=True, slots=True)
class AffectedTarget:
    """A resource a call acts on, as an approver should see it: which argument names
    it, its kind and ID, and what the host's own systems call it."""

    argument: str
    kind: str
    id: str
    label: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """As JSON-able data (kept in the approval request's effect preview)."""
        return {"argument": self.argument, "kind": self.kind, "id": self.id, "label": self.label}


def describe_targets(
    contract: ToolContract,
    arguments: Mapping[str, Any],
    context: RuntimeContext,
    resolver: TargetResolver | None,
    *,
    limit: int = 50,
) -> tuple[list[AffectedTarget], int]:
    """The first `limit` targets of an already checked call, resolved for people, and
    how many there are in all. For the approval screen only: it runs after the check
    passed, so every target resolves in the caller's tenant."""
    shown: list[AffectedTarget] = []
    total = 0
    if resolver is None:
        return shown, total
    for rule in contract.targets:
        for pointer, target_id in _expand(arguments, rule.argument):
            if target_id is MISSING or target_id is None:
                continue
            total += 1
            if len(shown) >= limit:
                continue
            found = resolver.resolve(rule.kind, str(target_id), context)
            target = found if isinstance(found, Target) and found.tenant == context.tenant else None
            label = None
            if target is not None:
                label = next(
                    (str(target.attributes[a]) for a in _LABELS if target.attributes.get(a)),
                    None,
                )
            shown.append(AffectedTarget(pointer, rule.kind, str(target_id), label))
    return shown, total
