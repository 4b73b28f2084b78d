"""A reference only the user can settle is a question for them, not a rejection for
the model to repair (seed 001's `needs_clarification`)."""

from __future__ import annotations

from policy import ContractRegistry, InMemoryTargetResolver, ProposalChecker, Target
from policy.catalog import CATALOG_DIR, SAMPLE_RULES, sample_targets
from schemas import DecisionOutcome, RuntimeContext, ToolProposal

ALICE = RuntimeContext(principal="alice", tenant="acme", capabilities=frozenset({"orders:read"}))


def _checker(resolver: InMemoryTargetResolver | None = None) -> ProposalChecker:
    return ProposalChecker(
        ContractRegistry.from_directory(CATALOG_DIR).pin_latest(),
        resolver=resolver or InMemoryTargetResolver(sample_targets()),
        rules=SAMPLE_RULES,
    )


def _orders_of(customer: str) -> ToolProposal:
    return ToolProposal(proposal_id="p-1", conversation_id="c-1", requested_by_user_id="alice",
                        tool_name="query_orders", arguments={"customer_id": customer})


def test_two_records_for_one_customer_ask_the_user_which() -> None:
    decision = _checker().check(_orders_of("cus-0700"), ALICE)
    assert decision.outcome is DecisionOutcome.NEEDS_CLARIFICATION
    assert decision.question is not None and "Jordan Lee" in decision.question
    assert "jordan.lee@acme.example.test" in decision.question
    assert [issue.code for issue in decision.issues] == ["TARGET_AMBIGUOUS"]
    assert not decision.repairable  # the model is not invited to retry it blindly


def test_only_the_callers_tenants_records_count() -> None:
    resolver = InMemoryTargetResolver(sample_targets())
    # A second record under the same ID, but another tenant's: not a question, and
    # nothing about the other tenant shows.
    resolver.add(Target(kind="customer", id="cus-0001", tenant="globex",
                        attributes={"name": "Someone at Globex"}))
    decision = _checker(resolver).check(_orders_of("cus-0001"), ALICE)
    assert decision.outcome is DecisionOutcome.READY
    assert "Globex" not in decision.model_dump_json()
