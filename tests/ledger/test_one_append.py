"""One append per service turn: proposals, leases and results that arrive together are
stored in one transaction, and a turn that cannot be stored stores nothing at all.
SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from eventsourcing.persistence import IntegrityError

from ledger import Ledger, ResultDisposition, StorageConfig
from schemas import LeaseDecision
from tests.ledger.helpers import ALICE, NO_HITS, make_ledger, result, search


@pytest.fixture
def ledger(storage: StorageConfig) -> Ledger:
    return make_ledger(storage)


class _Appends:
    """Counts the event store's appends (one transaction each)."""

    def __init__(self, ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        store = ledger.runner.events.events
        put = store.put

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return put(*args, **kwargs)

        monkeypatch.setattr(store, "put", counted)


def _kept_results(ledger: Ledger) -> int:
    return len(ledger.db.query("SELECT result_ref FROM opledger_results"))


def test_a_turn_of_proposals_leases_and_results_is_one_append(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger.submit(search("op-run"), ALICE)
    ledger.submit(search("op-lease"), ALICE)
    grant = ledger.lease("op-run", executor="exec-1")
    appends = _Appends(ledger, monkeypatch)
    with ledger.runner.one_append():
        [submitted] = ledger.submit_many([(search("op-new"), ALICE, "")])
        [lease] = ledger.lease_many([("op-lease", "exec-1", None)])
        [recorded] = ledger.record_results([result("op-run", grant.fencing_token, data=NO_HITS)])
        # Inside the turn, what it changed is what the next step sees; nothing is stored.
        assert ledger.runner.get("op-lease").fencing_token == 1
        assert not ledger.runner.tables.stored_ids(["op-new"])
        assert _kept_results(ledger) == 0
    assert appends.count == 1
    assert not isinstance(submitted, Exception) and submitted.created
    assert not isinstance(lease, Exception) and lease.decision is LeaseDecision.EXECUTE
    assert recorded is ResultDisposition.ACCEPTED
    fresh = make_ledger(ledger.db.storage)
    try:
        assert fresh.get("op-new").state.value == "ready"
        assert fresh.get("op-lease").state.value == "executing"
        assert fresh.get("op-run").state.value == "succeeded"
        assert fresh.status("op-run").result is not None  # its envelope kept, after the events
    finally:
        fresh.close()


def test_a_turn_that_lost_a_race_stores_nothing_and_runs_again(
    ledger: Ledger, storage: StorageConfig
) -> None:
    """Another instance writes to an operation the turn changed: the one append fails on
    its version check, nothing of the turn is stored (no kept result without its event),
    and the steps run again on the stored state, each with its own save."""
    ledger.submit(search("op-a"), ALICE)
    ledger.submit(search("op-b"), ALICE)
    grant = ledger.lease("op-a", executor="exec-1")
    other = make_ledger(storage)
    try:
        with pytest.raises(IntegrityError), ledger.runner.one_append():
            ledger.record_results([result("op-a", grant.fencing_token, data=NO_HITS)])
            ledger.lease_many([("op-b", "exec-1", None)])
            # Meanwhile the other instance takes op-b's lease.
            other.lease("op-b", executor="exec-2")
        assert ledger.get("op-a").state.value == "executing"  # the result was not stored
        assert _kept_results(ledger) == 0
        # Run again, one save each: the result lands; op-b is the other's.
        [recorded] = ledger.record_results([result("op-a", grant.fencing_token, data=NO_HITS)])
        assert recorded is ResultDisposition.ACCEPTED
        [busy] = ledger.lease_many([("op-b", "exec-1", None)])
        assert not isinstance(busy, Exception) and busy.decision is LeaseDecision.BUSY
        assert _kept_results(ledger) == 1
    finally:
        other.close()


def test_a_command_failing_on_an_operation_the_turn_changed_abandons_the_turn(
    ledger: Ledger,
) -> None:
    from ledger.service import OneAppendAbandoned

    ledger.submit(search("op-c"), ALICE)
    with pytest.raises(OneAppendAbandoned), ledger.runner.one_append():
        ledger.lease_many([("op-c", "exec-1", None)])
        # A lease request naming another tool for the same operation is refused
        # (OPERATION_NOT_FOUND) after the turn changed it: nothing is kept.
        ledger.lease_many([("op-c", "exec-2", "send_customer_email")])
    assert ledger.get("op-c").state.value == "ready"
    assert ledger.lease("op-c", executor="exec-1").decision is LeaseDecision.EXECUTE
