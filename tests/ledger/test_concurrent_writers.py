"""Two ledger instances on one PostgreSQL database, contending for the same operations."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, cast

import pytest

from ledger import Ledger, OperationConflict, StorageConfig, Submission
from schemas import LeaseDecision
from tests.ledger.helpers import ALICE, make_ledger, registry_with_limit, search


def _race(ledgers: list[Ledger], operation_ids: list[str]) -> Counter[str]:
    """Every ledger tries to lease every operation at once; count who won what."""
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    barrier = threading.Barrier(len(ledgers))

    def contend(ledger: Ledger, name: str) -> None:
        barrier.wait()
        for operation_id in operation_ids:
            try:
                reply = ledger.lease(operation_id, executor=name)
                # The other writer won: its live lease makes this one busy.
                outcome = f"won:{name}" if reply.decision is LeaseDecision.EXECUTE else "refused"
            except OperationConflict:
                outcome = "gave_up"
            with lock:
                outcomes[outcome] += 1

    threads = [
        threading.Thread(target=contend, args=(ledger, f"instance-{n}"))
        for n, ledger in enumerate(ledgers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes


def test_two_instances_one_winner_per_operation(postgres_storage: StorageConfig) -> None:
    unlimited = registry_with_limit(None)
    first = make_ledger(postgres_storage, registry=unlimited)
    second = make_ledger(postgres_storage, registry=unlimited)
    operation_ids = [f"op-{n}" for n in range(40)]
    submitted = cast(
        "list[Submission]",
        first.submit_many([(search(operation_id), ALICE) for operation_id in operation_ids]),
    )
    assert {s.state.value for s in submitted} == {"ready"}
    outcomes = _race([first, second], operation_ids)
    wins = outcomes["won:instance-0"] + outcomes["won:instance-1"]
    assert wins == len(operation_ids)
    assert outcomes["refused"] + outcomes["gave_up"] == len(operation_ids)
    for operation_id in operation_ids:
        operation = second.get(operation_id)
        assert operation.fencing_token == 1  # exactly one lease, never two
        assert len(operation.leases) == 1
    second.refresh()
    assert first.verify().ok


def test_two_instances_submitting_the_same_operation(postgres_storage: StorageConfig) -> None:
    first, second = make_ledger(postgres_storage), make_ledger(postgres_storage)
    results = []
    barrier = threading.Barrier(2)

    def submit(ledger: Ledger) -> None:
        barrier.wait()
        results.append(ledger.submit(search("op-same"), ALICE))

    threads = [threading.Thread(target=submit, args=(ledger,)) for ledger in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(r.created for r in results) == [False, True]
    assert len(first.history("op-same")) == 3


def test_a_submit_that_loses_the_race_at_its_append_answers_the_stored_operation(
    postgres_storage: StorageConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race above, made certain: the second instance stores the same call after the
    first checked that its ID was free and before the first appends. The first's append
    then fails on the ID, and it answers the stored operation (not created), instead of
    failing or storing the call twice."""
    first, second = make_ledger(postgres_storage), make_ledger(postgres_storage)
    real_save = first.runner.save
    won: list[Submission] = []

    def save_after_the_other_stored_it(*operations: Any) -> None:
        if not won:
            won.append(second.submit(search("op-same"), ALICE))
        real_save(*operations)

    monkeypatch.setattr(first.runner, "save", save_after_the_other_stored_it)
    try:
        lost = first.submit(search("op-same"), ALICE)
        assert [submission.created for submission in won] == [True]
        assert lost.created is False and lost.operation_id == won[0].operation_id
        assert len(first.history("op-same")) == 3
    finally:
        first.close()
        second.close()
