"""Property: whatever a model sends, the check returns a decision and never raises."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy import ContractRegistry, InMemoryBudgetCounter, ProposalChecker
from schemas import DecisionOutcome, ErrorCategory, RuntimeContext, ToolProposal
from tests.factories import make_contract

_REGISTRY = ContractRegistry()
_REGISTRY.register(make_contract(limits={"max_per_hour": 1000}))
CHECKER = ProposalChecker(_REGISTRY.pin_latest(), budget=InMemoryBudgetCounter())
CONTEXT = RuntimeContext(
    principal="alice", tenant="acme", capabilities=frozenset({"documents:search"})
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)
# Objects shaped like the tool's arguments, so the deeper stages are reached too.
argument_objects = st.fixed_dictionaries(
    {},
    optional={
        "query": json_values | st.text(max_size=600),
        "top_k": json_values | st.integers(min_value=-5, max_value=30),
        "source_types": json_values
        | st.lists(st.sampled_from(["policy", "manual", "incident", "faq", "web"])),
        "date_from": json_values | st.dates().map(str),
        "filters": json_values | st.fixed_dictionaries({}, optional={"language": json_values}),
        "surprise": json_values,
    },
)


def _proposal(arguments: Any) -> ToolProposal:
    return ToolProposal(
        proposal_id="p",
        conversation_id="c",
        requested_by_user_id="alice",
        tool_name="search_documents",
        arguments=arguments,
    )


def _assert_sound(decision: Any) -> None:
    assert decision.outcome in set(DecisionOutcome)
    # An INTERNAL rejection would mean the check hit a bug it caught; that is a failure here.
    assert decision.category is not ErrorCategory.INTERNAL, decision
    if decision.outcome is DecisionOutcome.REJECTED:
        assert decision.issues
    else:
        assert decision.normalized_arguments is not None
        assert decision.proposal_hash is not None
    orjson.loads(decision.model_dump_json())  # always serializable for the wire


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=json_values | argument_objects)
def test_any_json_value_gets_a_decision(arguments: Any) -> None:
    _assert_sound(CHECKER.check(_proposal(arguments), CONTEXT))


@settings(max_examples=200, deadline=None)
@given(
    text=st.text()
    | argument_objects.map(json.dumps)
    | argument_objects.map(lambda o: json.dumps(o)[:-1])  # truncated: a syntax error
)
def test_any_string_gets_a_decision(text: str) -> None:
    _assert_sound(CHECKER.check(_proposal(text), CONTEXT))


@settings(max_examples=200, deadline=None)
@given(raw=st.dictionaries(st.text(max_size=20), json_values, max_size=8))
def test_any_envelope_gets_a_decision(raw: dict[str, Any]) -> None:
    decision = CHECKER.check(raw, CONTEXT)
    assert decision.outcome is DecisionOutcome.REJECTED or decision.proposal_hash
