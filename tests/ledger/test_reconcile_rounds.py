"""Reconciliation is driven by the ledger: an unknown outcome is looked up in rounds,
with backoff, and after the contract's bound (or at once, for an executor that cannot
look anything up) it needs a person. On both backends.

Before: an unknown outcome an executor reported was acked and stayed
`outcome_unknown` for good; nothing queued a lookup, and nothing ever asked a person.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ledger import Ledger, StorageConfig
from ledger.domain.values import ReconcilePlan
from ledger.service._contracts import reconcile_plan
from policy import ReconcilePolicy
from schemas import RECONCILE_UNSUPPORTED, LeaseDecision
from tests.ledger.helpers import ALICE, event_types, make_ledger, result, search

UNKNOWN = {"code": "EXECUTION_TIMEOUT", "category": "TRANSIENT",
           "message": "the tool did not finish within 5000 ms"}
INCONCLUSIVE = {"code": "RECONCILE_INCONCLUSIVE", "category": "TRANSIENT",
                "message": "a send under this key is still in progress"}


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ledger(storage: StorageConfig, clock: Clock) -> Ledger:
    return make_ledger(storage, clock=clock)


def _unknown(ledger: Ledger, operation_id: str) -> int:
    """Propose, lease and report an unknown outcome; the fencing token."""
    ledger.submit(search(operation_id), ALICE)
    token = ledger.lease(operation_id, executor="exec-1").fencing_token
    envelope = result(operation_id, token, ok=False, error=UNKNOWN)
    ledger.record_result(envelope.model_copy(update={"outcome_unknown": True}))
    return token or 0


def _lookup(ledger: Ledger, operation_id: str, token: int, error: dict[str, str]) -> None:
    envelope = result(operation_id, token, ok=False, error=error, executor="exec-2")
    ledger.record_result(envelope.model_copy(update={"outcome_unknown": True}))


def test_an_unknown_outcome_is_looked_up_in_rounds_then_needs_a_person(
    ledger: Ledger, clock: Clock
) -> None:
    plan = reconcile_plan(ledger.contracts.get("search_documents"))
    token = _unknown(ledger, "op-u")
    operation = ledger.get("op-u")
    assert operation.state.value == "outcome_unknown"
    # Not looked up at once: the hung call may still land.
    assert operation.not_before == clock.now + plan.initial_delay
    busy = ledger.lease("op-u", executor="exec-2")
    assert (busy.decision, busy.not_before) == (LeaseDecision.BUSY, operation.not_before)
    for round_ in range(1, plan.max_rounds):
        clock.now = ledger.get("op-u").not_before or clock.now
        assert ledger.lease("op-u", executor="exec-2").decision is LeaseDecision.RECONCILE
        _lookup(ledger, "op-u", token, INCONCLUSIVE)
        operation = ledger.get("op-u")
        assert (operation.state.value, operation.reconcile_rounds) == ("outcome_unknown", round_)
        # Each round waits longer than the last.
        assert operation.not_before == clock.now + plan.delay(round_)
        assert ledger.lease("op-u", executor="exec-2").decision is LeaseDecision.BUSY
    clock.now = ledger.get("op-u").not_before or clock.now
    assert ledger.lease("op-u", executor="exec-2").decision is LeaseDecision.RECONCILE
    _lookup(ledger, "op-u", token, INCONCLUSIVE)
    operation = ledger.get("op-u")
    assert operation.state.value == "needs_resolution"
    needed = ledger.history("op-u")[-1]
    assert type(needed).__name__ == "ResolutionNeeded"
    assert (needed.rounds, needed.by, needed.code) == (
        plan.max_rounds, "exec-2", "RECONCILE_INCONCLUSIVE"
    )
    status = ledger.status("op-u")
    assert (status.state, status.final) == ("needs_resolution", False)
    # Nothing runs it, looks it up or spins on it any more: its items are acked.
    assert ledger.lease("op-u", executor="exec-3").decision is LeaseDecision.DONE
    assert event_types(ledger, "op-u").count("LeaseClaimed") == 1  # never run again
    ledger.resolve("op-u", by="ops-lead", applied=True, reason="the provider shows it")
    assert ledger.status("op-u").final


def test_an_executor_that_cannot_look_it_up_asks_for_a_person_at_once(
    ledger: Ledger, clock: Clock
) -> None:
    token = _unknown(ledger, "op-n")
    clock.now += timedelta(minutes=1)
    assert ledger.lease("op-n", executor="exec-2").decision is LeaseDecision.RECONCILE
    _lookup(ledger, "op-n", token, {"code": RECONCILE_UNSUPPORTED, "category": "INTERNAL",
                                    "message": "this executor cannot look earlier attempts up"})
    assert ledger.get("op-n").state.value == "needs_resolution"
    assert ledger.history("op-n")[-1].rounds == 1


def test_a_lookup_that_finds_it_after_all_settles_even_a_person_s_case(
    ledger: Ledger, clock: Clock
) -> None:
    token = _unknown(ledger, "op-l")
    clock.now += timedelta(minutes=1)
    ledger.lease("op-l", executor="exec-2")
    _lookup(ledger, "op-l", token, {"code": RECONCILE_UNSUPPORTED, "category": "INTERNAL",
                                    "message": "no"})
    assert ledger.get("op-l").state.value == "needs_resolution"
    # Another inconclusive word changes nothing (the person decides) ...
    _lookup(ledger, "op-l", token, INCONCLUSIVE)
    assert ledger.history("op-l")[-1].__class__.__name__ == "ResolutionNeeded"
    # ... but a lookup that found it settles it.
    found = result("op-l", token, executor="exec-3", data={"items": [], "truncated": False,
                                                          "next_cursor": None})
    ledger.record_result(found)
    status = ledger.status("op-l")
    assert (status.state, status.final) == ("succeeded", True)


def test_the_plan_follows_the_contract() -> None:
    policy = ReconcilePolicy(max_rounds=3, initial_delay_ms=500, backoff_multiplier=3.0,
                             max_delay_ms=2_000)
    plan = ReconcilePlan(max_rounds=3, initial_delay=timedelta(milliseconds=500),
                         multiplier=3.0, max_delay=timedelta(seconds=2))
    assert [plan.delay(n) for n in range(4)] == [
        timedelta(milliseconds=ms) for ms in (500, 1_500, 2_000, 2_000)
    ]
    assert [policy.delay_ms(n) for n in range(4)] == [500, 1_500, 2_000, 2_000]
    assert reconcile_plan(None) == ReconcilePlan()


def test_the_service_counts_lookups_and_the_operations_that_need_a_person() -> None:
    from ledger.server.metrics import LedgerMetrics

    metrics = LedgerMetrics()
    at = datetime.now(UTC).isoformat()
    for kind in ("OutcomeUnknown", "ReconciliationInconclusive", "ResolutionNeeded"):
        metrics.observe({"type": kind, "operation_id": "h1/op", "event": {"timestamp": at}},
                        "send_customer_email")
    sample = metrics.registry.get_sample_value
    labels = {"tool": "send_customer_email"}
    assert sample("tool_reconciliation_lookups_total", labels) == 2
    assert sample("tool_operations_needing_resolution_total", labels) == 1


TRANSIENT = {"code": "UPSTREAM_TIMEOUT", "category": "TRANSIENT", "message": "try again",
             "retryable": True}
NOT_APPLIED = {"code": "NOT_APPLIED", "category": "TRANSIENT", "retryable": True,
               "message": "the provider has no record of it"}


def test_a_cancelled_call_is_never_retried(ledger: Ledger, clock: Clock) -> None:
    """Found in review: a cancel, then a retryable failure, scheduled a retry that ran."""
    ledger.submit(search("op-c1"), ALICE)
    token = ledger.lease("op-c1", executor="exec-1").fencing_token
    ledger.cancel("op-c1", by="host:h1")
    ledger.record_result(result("op-c1", token, ok=False, error=TRANSIENT))
    status = ledger.status("op-c1")
    # The failure would have been retried: the cancel is why it ends, so it ends cancelled
    # (the attempt's failure stays in the history).
    assert (status.state, status.final) == ("cancelled", True)
    assert status.outcome == {"status": "cancelled", "by": "host:h1"}
    assert event_types(ledger, "op-c1")[-2:] == ["Failed", "Cancelled"]
    assert "RetryScheduled" not in event_types(ledger, "op-c1")
    clock.now += timedelta(minutes=5)
    assert ledger.lease("op-c1", executor="exec-2").decision is LeaseDecision.DONE


def test_a_cancel_while_the_outcome_is_unknown_stands_and_nothing_is_retried(
    ledger: Ledger, clock: Clock
) -> None:
    token = _unknown(ledger, "op-c2")
    ledger.cancel("op-c2", by="host:h1")  # noted; the lookups go on
    assert ledger.get("op-c2").state.value == "outcome_unknown"
    clock.now += timedelta(minutes=1)
    assert ledger.lease("op-c2", executor="exec-2").decision is LeaseDecision.RECONCILE
    ledger.record_result(result("op-c2", token, ok=False, error=NOT_APPLIED, executor="exec-2"))
    assert ledger.status("op-c2").state == "cancelled"  # not applied, and not to be retried
    assert "RetryScheduled" not in event_types(ledger, "op-c2")


def test_one_lookup_at_a_time_and_a_repeated_answer_is_one_round(
    ledger: Ledger, clock: Clock
) -> None:
    """Found in review: two executors looked up at once (a redelivered item beside the
    lookup item), and a redelivered unknown answer counted as another lookup."""
    token = _unknown(ledger, "op-one")
    again = result("op-one", token, ok=False, error=UNKNOWN)
    for _ in range(5):  # the first report, redelivered: no lookup was outstanding
        ledger.record_result(again.model_copy(update={"outcome_unknown": True}))
    assert (ledger.get("op-one").state.value, ledger.get("op-one").reconcile_rounds) == (
        "outcome_unknown", 0
    )
    clock.now += timedelta(minutes=1)
    assert ledger.lease("op-one", executor="exec-2").decision is LeaseDecision.RECONCILE
    busy = ledger.lease("op-one", executor="exec-3")
    assert busy.decision is LeaseDecision.BUSY and busy.lease_expires_at is not None
    _lookup(ledger, "op-one", token, INCONCLUSIVE)
    _lookup(ledger, "op-one", token, INCONCLUSIVE)  # the same answer again
    assert ledger.get("op-one").reconcile_rounds == 1
    # A lookup whose executor vanished is started again once it ran out.
    clock.now = (ledger.get("op-one").not_before or clock.now) + timedelta(seconds=1)
    assert ledger.lease("op-one", executor="exec-2").decision is LeaseDecision.RECONCILE
    clock.now += timedelta(hours=1)
    assert ledger.lease("op-one", executor="exec-4").decision is LeaseDecision.RECONCILE


def test_a_steep_policy_never_overflows() -> None:
    """Found in review: 10**19 times a second overflowed a timedelta."""
    plan = ReconcilePlan(max_rounds=20, multiplier=10.0)
    assert plan.delay(19) == plan.max_delay
    assert plan.delay(400) == plan.max_delay
    policy = ReconcilePolicy(max_rounds=20, backoff_multiplier=1e300)
    assert policy.delay_ms(5) == policy.max_delay_ms


def test_a_lease_that_ran_out_while_a_cancel_waited_is_swept(
    ledger: Ledger, clock: Clock
) -> None:
    """Found in review: the sweep looked only at `executing`; `cancel_requested` stayed."""
    ledger.submit(search("op-sw"), ALICE)
    ledger.lease("op-sw", executor="exec-1")
    ledger.cancel("op-sw", by="host:h1")
    clock.now += timedelta(hours=1)
    assert ledger.expire_leases() == ["op-sw"]
    assert ledger.get("op-sw").state.value == "outcome_unknown"


def test_an_earlier_lookups_answer_arriving_late_is_not_a_round(
    ledger: Ledger, clock: Clock
) -> None:
    """The lease names each lookup and the answer carries it back: a late copy of
    lookup 1's inconclusive answer, during lookup 2, does not count as lookup 2."""
    token = _unknown(ledger, "op-late")
    clock.now += timedelta(minutes=1)
    first = ledger.lease("op-late", executor="exec-2")
    assert (first.decision, first.lookup) == (LeaseDecision.RECONCILE, 1)
    answer = result("op-late", token, ok=False, error=INCONCLUSIVE, executor="exec-2")
    answer = answer.model_copy(update={"outcome_unknown": True, "lookup": 1})
    ledger.record_result(answer)
    clock.now = (ledger.get("op-late").not_before or clock.now) + timedelta(seconds=1)
    second = ledger.lease("op-late", executor="exec-3")
    assert (second.decision, second.lookup) == (LeaseDecision.RECONCILE, 2)
    ledger.record_result(answer)  # lookup 1's answer again, late
    assert (ledger.get("op-late").state.value, ledger.get("op-late").reconcile_rounds) == (
        "reconciling", 1
    )
    ledger.record_result(answer.model_copy(update={"lookup": 2}))
    assert ledger.get("op-late").reconcile_rounds == 2
