"""The ledger bounds the repair loop from its own events: a repair names the rejected
proposal it repairs, the ledger counts the chain, and refuses a repair past the
contract's `max_repair_attempts` with `repair_exhausted`. Both backends.

Before: `repair_attempt` was whatever the host said. Four invalid proposals left at 0
were never marked exhausted, and a valid one at `repair_attempt=99` (bound 2) was ready.
"""

from __future__ import annotations

from typing import Any

import pytest

from ledger import Ledger, StorageConfig
from schemas import REPAIR_EXHAUSTED, REPAIR_TARGET_INVALID, RuntimeContext
from tests.ledger.helpers import ALICE, event_types, make_ledger, proposal

BAD = {"query": "", "top_k": 0}  # both repairable findings
GOOD = {"query": "refund policy"}


@pytest.fixture
def ledger(storage: StorageConfig) -> Ledger:
    return make_ledger(storage)


def _submit(ledger: Ledger, operation_id: str, arguments: dict[str, Any], *,
            repairs: str | None = None, claimed: int = 0, conversation: str = "c-1",
            context: RuntimeContext = ALICE, host: str = "h1") -> Any:
    call = proposal("search_documents", arguments, operation_id=operation_id,
                    repairs=repairs, repair_attempt=claimed).model_copy(
        update={"conversation_id": conversation})
    return ledger.submit(call, context, host=host)


def test_the_ledger_counts_the_chain_and_refuses_past_the_bound(ledger: Ledger) -> None:
    first = _submit(ledger, "op-0", BAD)
    assert first.decision.outcome.value == "rejected" and first.decision.repairable
    assert (first.decision.repair.attempt, first.decision.repair.exhausted) == (0, False)
    one = _submit(ledger, "op-1", BAD, repairs="op-0", claimed=0)  # the host says 0: ignored
    assert (one.decision.repair.attempt, one.decision.repair.exhausted) == (1, False)
    two = _submit(ledger, "op-2", BAD, repairs="op-1")
    assert (two.decision.repair.attempt, two.decision.repair.exhausted) == (2, True)
    # Past the bound (2): refused, even with valid arguments, and not repairable.
    three = _submit(ledger, "op-3", GOOD, repairs="op-2", claimed=0)
    assert three.decision.outcome.value == "rejected"
    assert [i.code for i in three.decision.issues] == [REPAIR_EXHAUSTED]
    assert three.decision.repair.exhausted and not three.decision.repairable
    assert ledger.get("h1/op-3").repair_depth == 3
    assert event_types(ledger, "h1/op-2")[-1] == "RepairProposed"


def test_what_the_host_claims_neither_exhausts_nor_extends_the_bound(ledger: Ledger) -> None:
    valid = _submit(ledger, "op-99", GOOD, claimed=99)
    assert valid.decision.outcome.value == "ready"
    assert valid.decision.repair.attempt == 0  # the ledger's count
    bad = _submit(ledger, "op-bad", BAD, claimed=99)
    assert not bad.decision.repair.exhausted  # not a repair: the chain starts here


@pytest.mark.parametrize("case", ["unknown", "other-conversation", "other-tool",
                                  "other-host", "accepted", "repaired-twice"])
def test_a_repair_must_name_a_rejected_proposal_of_its_own_chain(
    ledger: Ledger, case: str
) -> None:
    _submit(ledger, "op-0", BAD)
    _submit(ledger, "op-ok", GOOD)
    target, conversation, host = "op-0", "c-1", "h1"
    if case == "unknown":
        target = "op-nobody"
    elif case == "other-conversation":
        conversation = "c-2"
    elif case == "other-host":
        host = "h2"
    elif case == "accepted":
        target = "op-ok"
    elif case == "repaired-twice":
        _submit(ledger, "op-1", BAD, repairs="op-0")
    if case == "other-tool":
        call = proposal("query_orders", {"limit": 5}, operation_id="op-x", repairs="op-0")
        answer = ledger.submit(call, ALICE, host="h1")
    else:
        answer = _submit(ledger, "op-x", GOOD, repairs=target, conversation=conversation,
                         host=host)
    decision = answer.decision
    assert decision is not None
    assert [i.code for i in decision.issues] == [REPAIR_TARGET_INVALID], case
    assert not decision.repairable
    # Nothing was noted on the named operation by an invalid repair.
    if case in ("other-conversation", "other-tool", "other-host"):
        assert "RepairProposed" not in event_types(ledger, "h1/op-0")


def test_the_same_repair_sent_twice_converges(ledger: Ledger) -> None:
    _submit(ledger, "op-0", BAD)
    first = _submit(ledger, "op-1", BAD, repairs="op-0")
    again = _submit(ledger, "op-1", BAD, repairs="op-0")
    assert first.created and not again.created
    assert event_types(ledger, "h1/op-0").count("RepairProposed") == 1


def test_a_repair_that_fails_to_be_stored_leaves_its_target_repairable(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the target was noted repaired before the repair was built, so a
    repair that then failed blocked every later one."""
    import ledger.service._submission as submission

    bad_mail = proposal("send_customer_email", {"recipient_ids": ["cus-0001"],
                                                "template": "no-such-template"},
                        operation_id="m-0")
    ledger.submit(bad_mail, ALICE, host="h1")
    good_mail = proposal("send_customer_email", {"recipient_ids": ["cus-0001"],
                                                 "template": "support_received",
                                                 "variables": {"ticket_id": "TCK-1"}},
                         operation_id="m-1", repairs="m-0")

    def broken(*_args: Any) -> Any:
        raise RuntimeError("the effect preview broke")

    monkeypatch.setattr(submission, "effect_preview", broken)
    answers = ledger.submissions.submit_many(
        [(good_mail, ALICE, "h1"), (proposal("search_documents", GOOD, operation_id="s-1"),
                                    ALICE, "h1")]
    )
    assert [type(a).__name__ for a in answers] == ["InvalidProposal", "Submission"]
    assert "RepairProposed" not in event_types(ledger, "h1/m-0")
    monkeypatch.undo()
    again = ledger.submit(good_mail, ALICE, host="h1")
    assert again.decision is not None and again.decision.outcome.value == "needs_approval"
    assert event_types(ledger, "h1/m-0")[-1] == "RepairProposed"
