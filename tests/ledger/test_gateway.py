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

from ledger.server.gateway import LedgerGateway, _Lane
from schemas import OpledgerError


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
