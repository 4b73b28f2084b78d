"""The gateway batches requests, and one request's failure stays its own.

The ledger answers each item of a batch on its own; the gateway is the second
line: a batch that raises anyway (a bug one item triggers) is run again item
by item, so only that item fails, while an outage of the database fails
every caller at once rather than being retried item by item.
"""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest

from ledger import StorageConfig, Submission
from ledger.domain.states import ResultDisposition
from ledger.server.gateway import LedgerGateway, _Lane
from schemas import OpledgerError
from tests.ledger.helpers import ALICE, NO_HITS, make_ledger, result, search


class _Ledger:
    """Just enough of a ledger for the gateway's constructor."""

    def lease_many(self, items: list[Any]) -> list[Any]:
        return items

    def record_results(self, items: list[Any]) -> list[Any]:
        return items

    def submit_many(self, items: list[Any]) -> list[Any]:
        return items


def _answers(run: Any, items: list[Any]) -> list[Any]:
    async def scenario() -> list[Any]:
        gateway = LedgerGateway(_Ledger())  # type: ignore[arg-type]
        gateway._lanes["probe"] = _Lane(run)
        gateway.start()
        try:
            futures = [gateway._enqueue("probe", item) for item in items]
            return list(await asyncio.gather(*futures, return_exceptions=True))
        finally:
            await gateway.stop()

    return asyncio.run(scenario())


def test_a_batch_that_raises_is_answered_item_by_item() -> None:
    calls: list[list[Any]] = []

    def run(items: list[Any]) -> list[Any]:
        calls.append(list(items))
        if "poison" in items:
            raise TypeError("Integer exceeds 64-bit range")
        return [f"ok:{item}" for item in items]

    answers = _answers(run, ["a", "b", "poison", "c"])
    assert answers[:2] == ["ok:a", "ok:b"] and answers[3] == "ok:c"
    assert isinstance(answers[2], OpledgerError)
    assert answers[2].to_info().code == "LEDGER_UNAVAILABLE"
    assert calls[0] == ["a", "b", "poison", "c"] and len(calls) == 5


def test_an_outage_fails_every_caller_without_a_retry_per_item() -> None:
    calls: list[list[Any]] = []

    def run(items: list[Any]) -> list[Any]:
        calls.append(list(items))
        raise sqlite3.OperationalError("database is locked")

    answers = _answers(run, ["a", "b", "c"])
    assert all(isinstance(a, OpledgerError) and a.retryable for a in answers)
    assert len(calls) == 1


@pytest.mark.parametrize("size", [1, 2])
def test_a_single_failing_item_is_not_run_twice(size: int) -> None:
    calls: list[list[Any]] = []

    def run(items: list[Any]) -> list[Any]:
        calls.append(list(items))
        raise ValueError("bug")

    answers = _answers(run, ["x"] * size)
    assert all(isinstance(a, OpledgerError) for a in answers)
    assert len(calls) == (1 if size == 1 else 3)


def test_data_the_database_cannot_store_fails_its_request_alone(
    postgres_storage: StorageConfig,
) -> None:
    """PostgreSQL refuses a NUL in text (`DataError`). That is the one request's data, not
    an outage: a result carrying one (past the wire's own checks, as a future field might)
    fails alone, while a good result and a proposal of the same turn are answered. Before,
    the gateway took it for an outage and failed the whole turn; an executor sending such
    results every 20 ms made other hosts' proposals fail about half the time, and good
    results in the same batch were lost after their redeliveries."""
    ledger = make_ledger(postgres_storage)
    ledger.submit(search("op-run"), ALICE)
    grant = ledger.lease("op-run", executor="exec-1")
    good = result("op-run", grant.fencing_token, data=NO_HITS)
    poisoned = good.model_copy(update={"operation_id": "op-\x00"})  # not validated again

    async def scenario() -> list[Any]:
        gateway = LedgerGateway(ledger)
        gateway.start()
        try:
            return list(await asyncio.gather(
                gateway.record_many([poisoned, good]),
                gateway.submit((search("op-new"), ALICE, "h1")),
                return_exceptions=True,
            ))
        finally:
            await gateway.stop()

    try:
        (bad_answer, good_answer), proposed = asyncio.run(scenario())
        assert isinstance(bad_answer, OpledgerError), bad_answer
        assert good_answer is ResultDisposition.ACCEPTED
        assert isinstance(proposed, Submission) and proposed.state.value == "ready"
        assert ledger.get("op-run").state.value == "succeeded"
    finally:
        ledger.close()
