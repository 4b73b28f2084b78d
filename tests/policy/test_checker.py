"""The layered check, stage by stage, on a contract built in the test."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from policy import (
    ContractRegistry,
    InMemoryBudgetCounter,
    InMemoryTargetResolver,
    ProposalChecker,
    SemanticInput,
    Target,
    ToolContract,
)
from schemas import (
    CheckStage,
    DecisionOutcome,
    ErrorCategory,
    RiskLevel,
    RuntimeContext,
    ToolProposal,
    ValidationIssue,
)
from tests.factories import contract_document, make_contract

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
CONTEXT = RuntimeContext(
    principal="alice", tenant="acme", capabilities=frozenset({"documents:search"})
)


def _checker(*contracts: ToolContract, **kwargs: Any) -> ProposalChecker:
    registry = ContractRegistry()
    for contract in contracts or (make_contract(),):
        registry.register(contract)
    return ProposalChecker(registry.pin_latest(), clock=lambda: NOW, **kwargs)


def _proposal(arguments: Any, **fields: Any) -> ToolProposal:
    values: dict[str, Any] = {
        "proposal_id": "p-1",
        "conversation_id": "c-1",
        "requested_by_user_id": "alice",
        "tool_name": "search_documents",
        "arguments": arguments,
    }
    values.update(fields)
    return ToolProposal(**values)


def _codes(decision: Any) -> list[tuple[str, str]]:
    return [(issue.code, issue.path) for issue in decision.issues]


def test_valid_proposal_is_ready_with_defaults_recorded() -> None:
    decision = _checker().check(_proposal({"query": "refund policy"}), CONTEXT)
    assert decision.outcome is DecisionOutcome.READY
    assert decision.normalized_arguments == {
        "query": "refund policy",
        "source_types": ["policy", "manual"],
        "top_k": 8,
    }
    assert decision.applied_defaults == ("/source_types", "/top_k")
    assert decision.risk is RiskLevel.LOW
    assert decision.tool_version == "2.1.0"
    assert decision.proposal_hash is not None and len(decision.proposal_hash) == 64


def test_nested_defaults_apply_only_inside_present_objects() -> None:
    decision = _checker().check(_proposal({"query": "qq", "filters": {}}), CONTEXT)
    assert decision.normalized_arguments is not None
    assert decision.normalized_arguments["filters"] == {"language": "en"}
    assert "/filters/language" in decision.applied_defaults


def test_arguments_as_json_string_are_parsed() -> None:
    decision = _checker().check(_proposal('{"query": "refund", "top_k": 3}'), CONTEXT)
    assert decision.outcome is DecisionOutcome.READY
    assert decision.normalized_arguments is not None
    assert decision.normalized_arguments["top_k"] == 3


def test_json_syntax_error_is_structured_feedback() -> None:
    decision = _checker().check(_proposal('{"query": "refund",'), CONTEXT)
    assert decision.outcome is DecisionOutcome.REJECTED
    (issue,) = decision.issues
    assert (issue.stage, issue.code, issue.repairable) == (CheckStage.PARSE, "json_syntax", True)
    # Where to look, for the model that repairs it: the line and the column.
    assert "line 1 column 20" in issue.message
    assert decision.repairable


def test_arguments_must_be_an_object() -> None:
    decision = _checker().check(_proposal("[1, 2]"), CONTEXT)
    assert _codes(decision) == [("not_an_object", "")]
    assert decision.issues[0].actual == "array"


def test_unknown_tool() -> None:
    decision = _checker().check(_proposal({}, tool_name="drop_database"), CONTEXT)
    (issue,) = decision.issues
    assert (issue.stage, issue.code) == (CheckStage.TOOL, "unknown_tool")
    assert issue.expected == ["search_documents"]


@pytest.mark.parametrize(
    ("arguments", "code", "path", "keyword", "expected", "actual"),
    [
        ({"top_k": 3}, "missing", "/query", "required", "present", None),
        ({"query": "ok", "tenant": "x"}, "extra", "/tenant", "additionalProperties", "absent", "x"),
        ({"query": "ok", "top_k": "10"}, "wrong_type", "/top_k", "type", "integer", "string"),
        ({"query": "ok", "top_k": 50}, "range", "/top_k", "maximum", 20, 50),
        ({"query": "ok", "top_k": 0}, "range", "/top_k", "minimum", 1, 0),
        ({"query": "x"}, "length", "/query", "minLength", 2, 1),
        (
            {"query": "ok", "source_types": ["web"]},
            "enum",
            "/source_types/0",
            "enum",
            ["policy", "manual", "incident", "faq"],
            "web",
        ),
        (
            {"query": "ok", "filters": {"language": "fr"}},
            "enum",
            "/filters/language",
            "enum",
            ["en", "ko"],
            "fr",
        ),
        (
            {"query": "ok", "date_from": "2026-13-45"},
            "format",
            "/date_from",
            "format",
            "date",
            "2026-13-45",
        ),
    ],
)
def test_structure_issue_shapes(
    arguments: dict[str, Any], code: str, path: str, keyword: str, expected: Any, actual: Any
) -> None:
    decision = _checker().check(_proposal(arguments), CONTEXT)
    assert decision.outcome is DecisionOutcome.REJECTED
    (issue,) = decision.issues
    assert (issue.code, issue.path, issue.keyword) == (code, path, keyword)
    assert (issue.expected, issue.actual) == (expected, actual)
    assert issue.repairable
    assert decision.category is ErrorCategory.INVALID_INPUT


def test_every_structure_issue_is_reported_at_once() -> None:
    decision = _checker().check(_proposal({"top_k": True, "extra": 1}), CONTEXT)
    assert sorted(_codes(decision)) == [
        ("extra", "/extra"),
        ("missing", "/query"),
        ("wrong_type", "/top_k"),
    ]


def test_no_coercion_of_numeric_strings_or_booleans() -> None:
    for value in ("8", True, 8.5):
        decision = _checker().check(_proposal({"query": "ok", "top_k": value}), CONTEXT)
        assert _codes(decision) == [("wrong_type", "/top_k")], value


def test_long_values_are_clipped_in_feedback() -> None:
    decision = _checker().check(_proposal({"query": "q" * 5000}), CONTEXT)
    (issue,) = decision.issues
    assert issue.actual == 5000  # a length finding reports the length, not the text
    assert len(issue.message) <= 201


def test_repair_counter_is_bounded_by_the_contract() -> None:
    checker = _checker(make_contract(max_repair_attempts=2))
    first = checker.check(_proposal({"top_k": 3}, repair_attempt=1), CONTEXT)
    assert first.repair is not None and not first.repair.exhausted
    assert first.repairable
    last = checker.check(_proposal({"top_k": 3}, repair_attempt=2), CONTEXT)
    assert last.repair is not None and last.repair.exhausted
    assert last.repair.max_attempts == 2
    assert not last.repairable


def test_the_repair_bound_is_two_attempts_unless_the_contract_says_otherwise() -> None:
    checker = _checker(make_contract())  # no max_repair_attempts: the default
    first = checker.check(_proposal({"top_k": 3}, repair_attempt=1), CONTEXT)
    assert first.repair is not None and not first.repair.exhausted
    second = checker.check(_proposal({"top_k": 3}, repair_attempt=2), CONTEXT)
    assert second.repair is not None and second.repair.exhausted
    assert second.repair.max_attempts == 2
    assert not second.repairable


def test_missing_capability_is_unauthorized_and_not_repairable() -> None:
    context = RuntimeContext(principal="alice", tenant="acme")
    decision = _checker().check(_proposal({"query": "ok"}), context)
    (issue,) = decision.issues
    assert (issue.code, issue.stage, issue.repairable) == (
        "CAPABILITY_DENIED",
        CheckStage.AUTHORIZATION,
        False,
    )
    assert decision.category is ErrorCategory.UNAUTHORIZED
    assert not decision.repairable


def test_risk_is_argument_aware() -> None:
    checker = _checker()
    assert checker.check(_proposal({"query": "ok", "top_k": 5}), CONTEXT).risk is RiskLevel.LOW
    wide = checker.check(_proposal({"query": "ok", "top_k": 15}), CONTEXT)
    assert (wide.risk, wide.risk_reasons) == (RiskLevel.MODERATE, ("wide",))


def test_approval_when_risk_reaches_threshold() -> None:
    contract = make_contract(approval={"mode": "risk_at_least", "risk_threshold": "moderate"})
    checker = _checker(contract)
    assert checker.check(_proposal({"query": "ok"}), CONTEXT).outcome is DecisionOutcome.READY
    decision = checker.check(_proposal({"query": "ok", "top_k": 15}), CONTEXT)
    assert decision.outcome is DecisionOutcome.NEEDS_APPROVAL
    assert decision.approval is not None
    assert decision.approval.required_approvals == 1
    assert "moderate" in decision.approval.reason


def test_two_person_policy_asks_for_two_approvers() -> None:
    contract = make_contract(approval={"mode": "two_person", "approver_roles": ["finance"]})
    decision = _checker(contract).check(_proposal({"query": "ok"}), CONTEXT)
    assert decision.outcome is DecisionOutcome.NEEDS_APPROVAL
    assert decision.approval is not None
    assert (decision.approval.required_approvals, decision.approval.approver_roles) == (
        2,
        ("finance",),
    )
    assert decision.approval.separation_of_duties


def test_two_person_from_a_risk_level_asks_for_a_second_approver_only_there() -> None:
    contract = make_contract(approval={"mode": "always", "two_person_from": "moderate"})
    checker = _checker(contract)
    narrow = checker.check(_proposal({"query": "ok"}), CONTEXT)
    wide = checker.check(_proposal({"query": "ok", "top_k": 15}), CONTEXT)
    assert narrow.approval is not None and wide.approval is not None
    assert (narrow.risk, narrow.approval.required_approvals) == (RiskLevel.LOW, 1)
    assert (wide.risk, wide.approval.required_approvals) == (RiskLevel.MODERATE, 2)
    assert "two-person threshold moderate" in wide.approval.reason
    assert "two-person" not in narrow.approval.reason


def test_two_person_from_combines_with_an_approval_threshold() -> None:
    contract = make_contract(
        approval={
            "mode": "risk_at_least", "risk_threshold": "moderate", "two_person_from": "moderate"
        }
    )
    checker = _checker(contract)
    assert checker.check(_proposal({"query": "ok"}), CONTEXT).outcome is DecisionOutcome.READY
    wide = checker.check(_proposal({"query": "ok", "top_k": 15}), CONTEXT)
    assert wide.outcome is DecisionOutcome.NEEDS_APPROVAL
    assert wide.approval is not None and wide.approval.required_approvals == 2


def test_a_contract_asks_for_n_approvers_some_from_named_roles() -> None:
    contract = make_contract(
        approval={
            "mode": "always", "approver_roles": ["lead", "compliance"],
            "required_approvals": 3, "required_from": {"compliance": 1},
        }
    )
    decision = _checker(contract).check(_proposal({"query": "ok"}), CONTEXT)
    assert decision.approval is not None
    assert (decision.approval.required_approvals, decision.approval.required_from) == (
        3, {"compliance": 1}
    )
    assert "3 distinct approvers (at least 1 compliance)" in decision.approval.reason


@pytest.mark.parametrize(
    ("approval", "message"),
    [
        ({"required_from": {"finance": 1}}, "not an approver role"),
        ({"required_from": {"approver": 0}}, "asks for 0 approvers"),
        ({"required_approvals": 0}, "greater than or equal to 1"),
        ({"required_approvals": 21}, "less than or equal to 20"),
    ],
)
def test_an_m_of_n_policy_that_cannot_be_met_is_refused(
    approval: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_contract(approval={"mode": "always", **approval})


def test_forbidden_tool_is_rejected_as_policy_denied() -> None:
    contract = make_contract(approval={"mode": "forbidden"})
    decision = _checker(contract).check(_proposal({"query": "ok"}), CONTEXT)
    assert _codes(decision) == [("TOOL_FORBIDDEN", "")]
    assert decision.category is ErrorCategory.POLICY_DENIED


def test_budget_limits_per_actor_and_tool() -> None:
    counter = InMemoryBudgetCounter()
    checker = _checker(make_contract(limits={"max_per_hour": 2}), budget=counter)
    for minutes in (10, 70):  # the second is outside the hour window
        counter.record(
            tenant="acme",
            actor="alice",
            tool="search_documents",
            at=NOW - timedelta(minutes=minutes),
        )
    assert checker.check(_proposal({"query": "ok"}), CONTEXT).outcome is DecisionOutcome.READY
    counter.record(tenant="acme", actor="alice", tool="search_documents", at=NOW)
    decision = checker.check(_proposal({"query": "ok"}), CONTEXT)
    assert _codes(decision) == [("BUDGET_EXCEEDED", "")]
    assert decision.category is ErrorCategory.TRANSIENT
    bob = RuntimeContext(principal="bob", tenant="acme", capabilities=CONTEXT.capabilities)
    assert checker.check(_proposal({"query": "ok"}), bob).outcome is DecisionOutcome.READY


def _snapshot_contract(capabilities: tuple[str, ...] = ()) -> ToolContract:
    schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "source_id": {"type": "string", "minLength": 1},
            "before_snapshot_id": {"type": "string", "minLength": 1},
            "after_snapshot_id": {"type": "string", "minLength": 1},
        },
        "required": ["source_id", "before_snapshot_id", "after_snapshot_id"],
    }
    return ToolContract.model_validate(
        contract_document(
            name="compare_document_snapshots",
            input_schema=schema,
            required_capabilities=list(capabilities),
            targets=[
                {"argument": "/source_id", "kind": "document"},
                {
                    "argument": "/before_snapshot_id",
                    "kind": "snapshot",
                    "same_source_as": "/source_id",
                },
                {
                    "argument": "/after_snapshot_id",
                    "kind": "snapshot",
                    "same_source_as": "/source_id",
                },
            ],
            risk={"base": "low"},
        )
    )


WORLD = InMemoryTargetResolver(
    [
        Target("document", "document-a", tenant="acme"),
        Target("document", "document-b", tenant="acme"),
        Target("document", "document-z", tenant="globex"),
        Target("snapshot", "snap-a-7", tenant="acme", source_id="document-a"),
        Target("snapshot", "snap-a-8", tenant="acme", source_id="document-a"),
        Target("snapshot", "snap-b-8", tenant="acme", source_id="document-b"),
    ]
)


def test_seed_004_snapshot_of_another_document_is_source_mismatch() -> None:
    checker = _checker(_snapshot_contract(), resolver=WORLD)
    proposal = _proposal(
        {
            "source_id": "document-a",
            "before_snapshot_id": "snap-a-7",
            "after_snapshot_id": "snap-b-8",
        },
        tool_name="compare_document_snapshots",
    )
    decision = checker.check(proposal, CONTEXT)
    assert decision.outcome is DecisionOutcome.REJECTED
    (issue,) = decision.issues
    assert (issue.code, issue.path, issue.stage) == (
        "SOURCE_MISMATCH",
        "/after_snapshot_id",
        CheckStage.SEMANTICS,
    )
    assert issue.details == {
        "expected_source_id": "document-a",
        "observed_source_id": "document-b",
        "comparison_performed": False,
    }
    repaired = proposal.model_copy(
        update={"arguments": {**proposal.arguments, "after_snapshot_id": "snap-a-8"}}
    )
    assert checker.check(repaired, CONTEXT).outcome is DecisionOutcome.READY


def _issues_comparing(
    checker: ProposalChecker, source: str, context: RuntimeContext = CONTEXT
) -> list[str]:
    """Every issue of the answer to comparing two snapshots of `source`, byte for byte,
    with the ID asked about as `<id>`."""
    arguments = {
        "source_id": source,
        "before_snapshot_id": "snap-a-7",
        "after_snapshot_id": "snap-a-8",
    }
    decision = checker.check(
        _proposal(arguments, tool_name="compare_document_snapshots"), context
    )
    return [issue.model_dump_json().replace(source, "<id>") for issue in decision.issues]


def test_target_in_another_tenant_looks_exactly_like_a_missing_one() -> None:
    checker = _checker(_snapshot_contract(), resolver=WORLD)
    other_tenant = _issues_comparing(checker, "document-z")
    missing = _issues_comparing(checker, "document-nope")
    assert ValidationIssue.model_validate_json(missing[0]).code == "TARGET_NOT_FOUND"
    # The same words, fields and values (a message naming the owner, or saying "another
    # tenant", would differ), and nothing of the other tenant anywhere.
    assert other_tenant == missing
    assert not any("globex" in issue for issue in other_tenant)


class _Asked:
    """A resolver that notes every lookup before answering as `WORLD` does (a fake: what
    is tested is whether the check asks at all)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def resolve(self, kind: str, target_id: str, context: RuntimeContext) -> Any:
        self.asked.append((kind, target_id))
        return WORLD.resolve(kind, target_id, context)


def test_an_unauthorized_caller_cannot_probe_which_targets_exist() -> None:
    """Authorization runs before the targets are looked up: a caller without the
    capability gets the same answer for a document that exists, one that does not and
    one of another tenant, and nothing is looked up for it."""
    resolver = _Asked()
    checker = _checker(_snapshot_contract(("documents:compare",)), resolver=resolver)
    answers = [
        _issues_comparing(checker, source)  # CONTEXT lacks documents:compare
        for source in ("document-a", "document-nope", "document-z")
    ]
    assert answers[0] == answers[1] == answers[2]
    assert [ValidationIssue.model_validate_json(i).code for i in answers[0]] == [
        "CAPABILITY_DENIED"
    ]
    assert resolver.asked == []
    # With the capability, the same three are told apart: the probe would work.
    allowed = RuntimeContext(
        principal="alice", tenant="acme", capabilities=frozenset({"documents:compare"})
    )
    assert _issues_comparing(checker, "document-a", allowed) == []
    assert _issues_comparing(checker, "document-nope", allowed) != []
    assert resolver.asked


def test_draft_2020_12_keywords_are_enforced() -> None:
    """The structure stage validates with Draft 2020-12: `prefixItems`, `$defs` and
    `unevaluatedProperties` (which earlier drafts ignore, letting these calls pass)."""
    schema = {
        "type": "object",
        "$defs": {"positive": {"type": "integer", "minimum": 1}},
        "properties": {
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "string"}, {"$ref": "#/$defs/positive"}],
                "items": False,
            },
        },
        "allOf": [{"properties": {"note": {"type": "string"}}}],
        "unevaluatedProperties": False,
        "required": ["pair"],
    }
    checker = _checker(
        make_contract(name="pairs", input_schema=schema, required_capabilities=[])
    )

    def check(arguments: dict[str, Any]) -> list[tuple[str, str]]:
        return _codes(checker.check(_proposal(arguments, tool_name="pairs"), CONTEXT))

    assert check({"pair": ["a", 2], "note": "evaluated by allOf"}) == []
    assert check({"pair": [1, 2]}) == [("wrong_type", "/pair/0")]  # prefixItems
    assert check({"pair": ["a", 0]}) == [("range", "/pair/1")]  # $defs through $ref
    assert check({"pair": ["a", 2, "extra"]}) == [("invalid", "/pair")]  # items after them
    assert check({"pair": ["a", 2], "other": 1}) == [("extra", "/other")]  # unevaluated


def test_semantic_rules_run_after_targets_resolve() -> None:
    def no_incident_over_5(data: SemanticInput) -> list[ValidationIssue]:
        if "incident" in data.arguments["source_types"] and data.arguments["top_k"] > 5:
            return [
                ValidationIssue(
                    stage=CheckStage.SEMANTICS,
                    code="INCIDENT_TOP_K_LIMIT",
                    message="at most 5",
                    path="/top_k",
                    repairable=True,
                )
            ]
        return []

    checker = _checker(rules={"search_documents": [no_incident_over_5]})
    decision = checker.check(
        _proposal({"query": "ok", "source_types": ["incident"], "top_k": 8}), CONTEXT
    )
    assert _codes(decision) == [("INCIDENT_TOP_K_LIMIT", "/top_k")]


def test_a_failing_rule_is_an_internal_rejection_not_an_exception() -> None:
    def broken(data: SemanticInput) -> list[ValidationIssue]:
        raise RuntimeError("secret connection string postgres://admin:hunter2@db")

    decision = _checker(rules={"search_documents": [broken]}).check(
        _proposal({"query": "ok"}), CONTEXT
    )
    assert decision.outcome is DecisionOutcome.REJECTED
    assert decision.category is ErrorCategory.INTERNAL
    assert "hunter2" not in decision.model_dump_json()
    assert "Traceback" not in decision.model_dump_json()


def test_malformed_envelope_is_rejected_not_raised() -> None:
    decision = _checker().check({"proposal_id": "p-9", "tool_name": 5}, CONTEXT)
    assert decision.outcome is DecisionOutcome.REJECTED
    assert decision.proposal_id == "p-9"
    assert {issue.code for issue in decision.issues} == {"invalid_envelope"}
    assert {issue.path for issue in decision.issues} >= {"/tool_name", "/conversation_id"}


def test_same_call_hashes_the_same_and_other_actor_differs() -> None:
    checker = _checker()
    first = checker.check(_proposal({"query": "ok"}), CONTEXT)
    second = checker.check(_proposal({"query": "ok", "top_k": 8}, proposal_id="p-2"), CONTEXT)
    assert first.proposal_hash == second.proposal_hash
    bob = RuntimeContext(principal="bob", tenant="acme", capabilities=CONTEXT.capabilities)
    assert checker.check(_proposal({"query": "ok"}), bob).proposal_hash != first.proposal_hash
