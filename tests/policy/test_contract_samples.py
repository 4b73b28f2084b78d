"""Contract tests of the sample catalog: every sample file, plus the seed texts' cases.

Each file in `tests/contract_samples/<tool>/{valid,invalid}/` is one proposal
and the decision it must get from the layered check, run against the catalog
in `policy/catalog`. `valid` samples are argument-valid (schema, targets and
cross-field rules hold); only the runtime policy (capabilities, approval,
forbidden tools) may still refuse them. `invalid` samples must be rejected.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from policy import (
    ApprovalMode,
    ContractRegistry,
    EffectClass,
    InMemoryTargetResolver,
    ProposalChecker,
    SemanticInput,
    ToolCatalog,
)
from policy.catalog import CATALOG_DIR, SAMPLE_RULES, sample_targets
from schemas import (
    CheckStage,
    Decision,
    DecisionOutcome,
    ErrorCategory,
    RiskLevel,
    RuntimeContext,
    ToolProposal,
)

SAMPLES_DIR = Path(__file__).resolve().parents[1] / "contract_samples"
NOW = datetime(2026, 7, 15, 9, 0, tzinfo=UTC)
"""The fixed clock of every sample: `date_from` "2026-07-16" is in the future."""

MIN_VALID = 2
MIN_INVALID = 4

_SAMPLE_KEYS = {"description", "arguments", "context", "expect"}
_CONTEXT_KEYS = {"principal", "tenant", "capabilities", "environment"}
_EXPECT_KEYS = {"outcome", "codes", "paths", "risk"}
_ARGUMENT_STAGES = {CheckStage.PARSE, CheckStage.TOOL, CheckStage.STRUCTURE, CheckStage.SEMANTICS}

# The twelve contract fields of seed 000, plus the host's policy knobs; every
# catalog file spells all of them out instead of relying on model defaults.
_DECLARED_FIELDS = {
    "name",
    "description",
    "input_schema",
    "output_schema",
    "errors",
    "effect",
    "required_capabilities",
    "approval",
    "timeout_ms",
    "retry",
    "idempotency",
    "version",
    "risk",
    "limits",
    "targets",
    "sensitive_arguments",
}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def registry() -> ContractRegistry:
    """The sample catalog, loaded the way a host loads operator files."""
    return ContractRegistry.from_directory(CATALOG_DIR)


@pytest.fixture(scope="module")
def catalog(registry: ContractRegistry) -> ToolCatalog:
    """The newest version of every sample tool."""
    return registry.pin_latest()


@pytest.fixture(scope="module")
def checker(catalog: ToolCatalog) -> ProposalChecker:
    """The layered check over the sample catalog, fake world and rules, at a fixed time."""
    return ProposalChecker(
        catalog,
        resolver=InMemoryTargetResolver(sample_targets()),
        rules=SAMPLE_RULES,
        clock=lambda: NOW,
    )


@functools.cache
def _all_capabilities() -> tuple[str, ...]:
    registry = ContractRegistry.from_directory(CATALOG_DIR)
    capabilities = {cap for c in registry.pin_latest().values() for cap in c.required_capabilities}
    return tuple(sorted(capabilities))


def _context(**overrides: Any) -> RuntimeContext:
    """alice in tenant acme, holding every capability the catalog requires, unless overridden."""
    values: dict[str, Any] = {
        "principal": "alice",
        "tenant": "acme",
        "capabilities": _all_capabilities(),
        "environment": "development",
    }
    values.update(overrides)
    return RuntimeContext.model_validate(values)


def _check(
    checker: ProposalChecker, tool: str, arguments: Any, context: RuntimeContext | None = None
) -> Decision:
    context = context or _context()
    proposal = ToolProposal(
        proposal_id=f"sample-{tool}",
        conversation_id="contract-samples",
        requested_by_user_id=context.principal,
        tool_name=tool,
        arguments=arguments,
    )
    return checker.check(proposal, context)


def _explain(decision: Decision) -> str:
    lines = [f"outcome={decision.outcome.value} risk={decision.risk}"]
    lines += [
        f"  [{i.stage.value}] {i.code} at {i.path or '(root)'}: {i.message}"
        for i in decision.issues
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- sample files


@dataclass(frozen=True)
class Sample:
    """One sample file, checked for shape when loaded."""

    path: Path
    tool: str
    kind: str
    description: str
    arguments: Any
    context: Mapping[str, Any]
    expect: Mapping[str, Any]

    @classmethod
    def load(cls, path: Path) -> Sample:
        """Read and validate the shape of one sample file."""
        document = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(document, dict), f"{path}: a sample is a JSON object"
        assert set(document) <= _SAMPLE_KEYS, f"{path}: unknown keys {set(document) - _SAMPLE_KEYS}"
        assert {"description", "arguments", "expect"} <= set(document), f"{path}: incomplete"
        description = document["description"]
        assert isinstance(description, str) and description.strip(), f"{path}: no description"
        context = document.get("context", {})
        assert isinstance(context, dict) and set(context) <= _CONTEXT_KEYS, f"{path}: bad context"
        expect = document["expect"]
        assert isinstance(expect, dict) and set(expect) <= _EXPECT_KEYS, f"{path}: bad expect"
        assert expect.get("outcome") in {o.value for o in DecisionOutcome}, f"{path}: outcome"
        kind = path.parent.name
        assert kind in {"valid", "invalid"}, f"{path}: must be under valid/ or invalid/"
        return cls(
            path=path,
            tool=path.parent.parent.name,
            kind=kind,
            description=description,
            arguments=document["arguments"],
            context=context,
            expect=expect,
        )


def _sample_files() -> list[Path]:
    return sorted(SAMPLES_DIR.glob("*/*/*.json"))


def _sample_id(path: Path) -> str:
    return "/".join(path.relative_to(SAMPLES_DIR).with_suffix("").parts)


@pytest.mark.parametrize("path", _sample_files(), ids=_sample_id)
def test_contract_sample(checker: ProposalChecker, path: Path) -> None:
    sample = Sample.load(path)
    decision = _check(checker, sample.tool, sample.arguments, _context(**sample.context))
    expect = sample.expect
    why = f"{sample.description}\n{_explain(decision)}"

    assert decision.outcome is DecisionOutcome(expect["outcome"]), why
    codes = {issue.code for issue in decision.issues}
    if decision.outcome is DecisionOutcome.REJECTED:
        assert "codes" in expect, f"{path}: a rejection must list its codes"
        assert codes == set(expect["codes"]), why
        assert decision.category is not None, why
    else:
        assert not decision.issues, why
        assert not expect.get("codes"), f"{path}: only rejections have codes"
    if "paths" in expect:
        assert {issue.path for issue in decision.issues} == set(expect["paths"]), why
    if "risk" in expect:
        assert decision.risk is RiskLevel(expect["risk"]), why

    if sample.kind == "invalid":
        assert decision.outcome is DecisionOutcome.REJECTED, why
    else:
        # Argument-valid: only the runtime policy may still say no.
        assert not {i.stage for i in decision.issues} & _ARGUMENT_STAGES, why


def test_every_catalog_tool_has_valid_and_invalid_samples(registry: ContractRegistry) -> None:
    tools = set(registry.names())
    sample_tools = {path.name for path in SAMPLES_DIR.iterdir() if path.is_dir()}
    assert sample_tools == tools
    for tool in sorted(tools):
        valid = list((SAMPLES_DIR / tool / "valid").glob("*.json"))
        invalid = list((SAMPLES_DIR / tool / "invalid").glob("*.json"))
        assert len(valid) >= MIN_VALID, f"{tool}: {len(valid)} valid samples"
        assert len(invalid) >= MIN_INVALID, f"{tool}: {len(invalid)} invalid samples"


def test_sample_files_are_well_formed() -> None:
    samples = [Sample.load(path) for path in _sample_files()]
    assert samples
    for sample in samples:
        if sample.kind == "invalid":
            assert sample.expect["outcome"] == "rejected", sample.path
            assert sample.expect.get("codes"), sample.path


# --------------------------------------------------------------------------- the catalog files


def _contract_files() -> list[Path]:
    return sorted(CATALOG_DIR.glob("*.yaml"))


def test_catalog_has_the_nine_sample_tools(registry: ContractRegistry) -> None:
    assert registry.names() == sorted(
        [
            "search_documents",
            "read_document_span",
            "compare_document_snapshots",
            "send_customer_email",
            "create_ticket",
            "delete_document",
            "request_refund",
            "cancel_refund",
            "query_orders",
        ]
    )


@pytest.mark.parametrize("path", _contract_files(), ids=lambda p: p.stem)
def test_contract_file_declares_every_field(path: Path) -> None:
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert document["name"] == path.stem
    assert set(document) >= _DECLARED_FIELDS, _DECLARED_FIELDS - set(document)


def _object_schemas(schema: Any, pointer: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(schema, dict):
        if schema.get("type") == "object" or "properties" in schema:
            yield pointer, schema
        for key, value in schema.items():
            yield from _object_schemas(value, f"{pointer}/{key}")
    elif isinstance(schema, list):
        for index, item in enumerate(schema):
            yield from _object_schemas(item, f"{pointer}/{index}")


def _schema_at(schema: dict[str, Any], argument_pointer: str) -> dict[str, Any] | None:
    """The sub-schema an argument pointer names, following `properties` (and `items` for `*`)."""
    current: dict[str, Any] | None = schema
    for part in argument_pointer.split("/")[1:]:
        if part == "*":
            current = current.get("items") if current else None
            continue
        properties = current.get("properties", {}) if current else {}
        current = properties.get(part)
    return current


def test_every_object_in_every_schema_is_closed(catalog: ToolCatalog) -> None:
    for contract in catalog.values():
        for field in ("input_schema", "output_schema"):
            for pointer, node in _object_schemas(getattr(contract, field)):
                assert node.get("additionalProperties") is False, (
                    f"{contract.name} {field}{pointer}"
                )


def test_pointers_in_contracts_name_declared_arguments(catalog: ToolCatalog) -> None:
    for contract in catalog.values():
        pointers = list(contract.sensitive_arguments)
        for rule in contract.targets:
            pointers += [rule.argument, rule.same_source_as or "", rule.expected_version_from or ""]
        pointers += [r.when.argument or "" for r in contract.risk.rules]
        for pointer in filter(None, pointers):
            assert _schema_at(contract.input_schema, pointer) is not None, (contract.name, pointer)


def test_error_models_cover_the_basic_categories(catalog: ToolCatalog) -> None:
    basic = {
        ErrorCategory.INVALID_INPUT,
        ErrorCategory.UNAUTHORIZED,
        ErrorCategory.TRANSIENT,
        ErrorCategory.INTERNAL,
    }
    for contract in catalog.values():
        codes = [entry.code for entry in contract.errors]
        assert len(codes) == len(set(codes)), contract.name
        categories = {entry.category for entry in contract.errors}
        assert basic <= categories, contract.name
        if contract.targets:
            assert ErrorCategory.NOT_FOUND in categories, contract.name


def test_descriptions_name_neighbour_tools_of_the_catalog(catalog: ToolCatalog) -> None:
    for contract in catalog.values():
        assert contract.description.differs_from, contract.name
        assert set(contract.description.differs_from) <= set(catalog) - {contract.name}
        assert contract.description.limitations, contract.name


def test_writes_are_idempotent_and_irreversible_writes_never_auto_retry(
    catalog: ToolCatalog,
) -> None:
    for contract in catalog.values():
        if contract.effect.writes:
            assert contract.idempotency.required, contract.name
        if contract.effect is EffectClass.IRREVERSIBLE_WRITE:
            assert contract.retry.max_attempts == 1, contract.name


@pytest.mark.parametrize(
    ("tool", "effect", "mode", "threshold"),
    [
        ("search_documents", EffectClass.PURE_READ, ApprovalMode.NEVER, None),
        ("read_document_span", EffectClass.PURE_READ, ApprovalMode.NEVER, None),
        ("compare_document_snapshots", EffectClass.PURE_READ, ApprovalMode.NEVER, None),
        ("query_orders", EffectClass.PURE_READ, ApprovalMode.RISK_AT_LEAST, RiskLevel.HIGH),
        ("send_customer_email", EffectClass.IRREVERSIBLE_WRITE, ApprovalMode.ALWAYS, None),
        ("create_ticket", EffectClass.REVERSIBLE_WRITE, ApprovalMode.RISK_AT_LEAST, RiskLevel.HIGH),
        ("request_refund", EffectClass.IRREVERSIBLE_WRITE, ApprovalMode.ALWAYS, None),
        ("delete_document", EffectClass.IRREVERSIBLE_WRITE, ApprovalMode.FORBIDDEN, None),
    ],
)
def test_effect_and_approval_policy(
    catalog: ToolCatalog,
    tool: str,
    effect: EffectClass,
    mode: ApprovalMode,
    threshold: RiskLevel | None,
) -> None:
    contract = catalog[tool]
    assert contract.effect is effect
    assert contract.approval.mode is mode
    assert contract.approval.risk_threshold is threshold


def test_sample_rules_belong_to_catalog_tools(catalog: ToolCatalog) -> None:
    assert set(SAMPLE_RULES) <= set(catalog)


@pytest.mark.parametrize("tool", sorted(SAMPLE_RULES))
def test_rules_tolerate_missing_arguments_and_targets(tool: str) -> None:
    """A rule that raised would turn every proposal of its tool into CHECK_FAILED."""
    data = SemanticInput(tool=tool, arguments={}, context=_context(), targets={}, now=NOW)
    for rule in SAMPLE_RULES[tool]:
        assert list(rule(data)) == []


def test_sample_world_has_the_seed_004_snapshots_and_two_tenants() -> None:
    targets = {(t.kind, t.id): t for t in sample_targets()}
    assert {t.tenant for t in targets.values()} == {"acme", "globex"}
    assert targets[("snapshot", "snap-a-7")].source_id == "document-a"
    assert targets[("snapshot", "snap-a-8")].source_id == "document-a"
    assert targets[("snapshot", "snap-b-8")].source_id == "document-b"
    owners = {t.owner for t in targets.values() if t.kind == "order"}
    assert {"alice", "bob"} <= owners
    # (kind, id) pairs are unique but one: customer cus-0700, kept twice on purpose
    # (a reference to it needs the user to say which record).
    assert len(targets) == len(sample_targets()) - 1
    assert [t.attributes["email"] for t in sample_targets() if t.id == "cus-0700"] == [
        "jordan.lee@acme.example.test", "j.lee@acme.example.test",
    ]


# --------------------------------------------------------------------------- the seeds' cases


def test_query_orders_limit_10_is_moderate_and_ready(checker: ProposalChecker) -> None:
    decision = _check(checker, "query_orders", {"limit": 10})
    assert decision.outcome is DecisionOutcome.READY, _explain(decision)
    assert decision.risk is RiskLevel.MODERATE
    assert decision.approval is None
    assert decision.risk_reasons == ()


def test_query_orders_limit_one_million_is_high_and_needs_approval(
    checker: ProposalChecker,
) -> None:
    decision = _check(checker, "query_orders", {"limit": 1_000_000})
    assert decision.outcome is DecisionOutcome.NEEDS_APPROVAL, _explain(decision)
    assert decision.risk is RiskLevel.HIGH
    assert decision.risk_reasons == (
        "more than 1,000 orders is a bulk export (cost and data exposure)",
    )
    assert decision.approval is not None
    assert decision.approval.approver_roles == ("data_steward",)
    assert decision.approval.required_approvals == 1


def test_send_customer_email_to_one_recipient_is_high(checker: ProposalChecker) -> None:
    decision = _check(
        checker,
        "send_customer_email",
        {
            "recipient_ids": ["cus-0001"],
            "template": "support_received",
            "variables": {"ticket_id": "TCK-42"},
        },
    )
    assert decision.outcome is DecisionOutcome.NEEDS_APPROVAL, _explain(decision)
    assert decision.risk is RiskLevel.HIGH
    assert decision.risk_reasons == ()
    assert decision.approval is not None
    assert decision.approval.reason == "this tool always needs approval"
    assert decision.normalized_arguments is not None
    assert decision.normalized_arguments["variables"] == {"ticket_id": "TCK-42"}


def test_send_customer_email_to_500_recipients_is_critical(checker: ProposalChecker) -> None:
    recipients = [f"cus-{i:04d}" for i in range(1, 501)]
    decision = _check(
        checker,
        "send_customer_email",
        {
            "recipient_ids": recipients,
            "template": "refund_review_requested",
            "variables": {"order_id": "order-1001"},
        },
    )
    assert decision.outcome is DecisionOutcome.NEEDS_APPROVAL, _explain(decision)
    assert decision.risk is RiskLevel.CRITICAL
    assert "more than 10 recipients is a bulk send" in decision.risk_reasons
    too_many = _check(
        checker,
        "send_customer_email",
        {"recipient_ids": [*recipients, "cus-0501"], "template": "support_received"},
    )
    assert too_many.outcome is DecisionOutcome.REJECTED
    assert [(i.code, i.path) for i in too_many.issues] == [("length", "/recipient_ids")]


def test_seed_004_snapshot_of_document_b_is_refused_before_comparing(
    checker: ProposalChecker,
) -> None:
    decision = _check(
        checker,
        "compare_document_snapshots",
        {
            "source_id": "document-a",
            "before_snapshot_id": "snap-a-7",
            "after_snapshot_id": "snap-b-8",
        },
    )
    assert decision.outcome is DecisionOutcome.REJECTED, _explain(decision)
    assert decision.category is ErrorCategory.INVALID_INPUT
    assert len(decision.issues) == 1
    issue = decision.issues[0]
    assert issue.stage is CheckStage.SEMANTICS
    assert issue.code == "SOURCE_MISMATCH"
    assert issue.path == "/after_snapshot_id"
    assert issue.category is ErrorCategory.INVALID_INPUT
    assert issue.repairable is True
    assert issue.expected == "document-a"
    assert issue.actual == "document-b"
    assert issue.details == {
        "expected_source_id": "document-a",
        "observed_source_id": "document-b",
        "comparison_performed": False,
    }
    assert decision.repairable

    repaired = _check(
        checker,
        "compare_document_snapshots",
        {
            "source_id": "document-a",
            "before_snapshot_id": "snap-a-7",
            "after_snapshot_id": "snap-a-8",
        },
    )
    assert repaired.outcome is DecisionOutcome.READY, _explain(repaired)
    assert repaired.applied_defaults == ("/ignore_whitespace",)


@pytest.mark.parametrize(
    ("amount_cents", "risk", "approvers"),
    [(5000, RiskLevel.HIGH, 1), (50000, RiskLevel.HIGH, 1), (50001, RiskLevel.CRITICAL, 2)],
)
def test_request_refund_needs_two_distinct_approvers_above_500(
    checker: ProposalChecker, amount_cents: int, risk: RiskLevel, approvers: int
) -> None:
    decision = _check(
        checker,
        "request_refund",
        {
            "order_id": "order-1004",
            "amount_cents": amount_cents,
            "currency": "USD",
            "reason_code": "damaged",
        },
    )
    assert decision.outcome is DecisionOutcome.NEEDS_APPROVAL, _explain(decision)
    assert decision.approval is not None
    assert (decision.risk, decision.approval.required_approvals) == (risk, approvers)
    assert decision.approval.separation_of_duties is True
    assert decision.approval.approver_roles == ("finance_approver",)


def test_create_ticket_is_a_dry_run_unless_asked_otherwise(checker: ProposalChecker) -> None:
    decision = _check(
        checker, "create_ticket", {"title": "Customer cannot log in", "category": "account"}
    )
    assert decision.outcome is DecisionOutcome.READY, _explain(decision)
    assert decision.normalized_arguments is not None
    assert decision.normalized_arguments["dry_run"] is True
    assert "/dry_run" in decision.applied_defaults
    assert decision.risk is RiskLevel.LOW


def test_forbidden_tool_is_not_repairable(checker: ProposalChecker) -> None:
    decision = _check(
        checker,
        "delete_document",
        {"document_id": "document-b", "expected_revision": "8", "reason": "Superseded manual"},
    )
    assert decision.outcome is DecisionOutcome.REJECTED, _explain(decision)
    assert [i.code for i in decision.issues] == ["TOOL_FORBIDDEN"]
    assert decision.category is ErrorCategory.POLICY_DENIED
    assert not decision.repairable
