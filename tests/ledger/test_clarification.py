"""`needs_clarification` is a normal, final outcome: recorded with the question for the
user, never queued or run, not counted against the caller's budget. Both backends."""

from __future__ import annotations

from ledger import StorageConfig
from schemas import DecisionOutcome
from tests.ledger.helpers import ALICE, event_types, make_ledger, proposal


def test_an_ambiguous_reference_ends_in_a_question_for_the_user(storage: StorageConfig) -> None:
    ledger = make_ledger(storage)
    call = proposal("query_orders", {"customer_id": "cus-0700"}, operation_id="op-which")
    answer = ledger.submit(call, ALICE)
    assert answer.decision is not None
    assert answer.decision.outcome is DecisionOutcome.NEEDS_CLARIFICATION
    assert answer.state.value == "needs_clarification"
    status = ledger.status("op-which")
    assert status.final and status.outcome is not None
    assert status.outcome["status"] == "needs_clarification"
    assert "Jordan Lee" in status.outcome["question"]
    assert event_types(ledger, "op-which") == ["Proposed", "ClarificationNeeded"]
    assert ledger.lease("op-which", executor="exec-1").decision.value == "done"
    ledger.refresh()
    rows = ledger.projector.rows(state="needs_clarification")
    assert [row.operation_id for row in rows] == ["op-which"]
