"""While a tool runs, its executor checks in with the ledger every progress interval,
and a cancel reaches the call: the tool's `cancel` hook stops it before any effect, or
it is too late and the call runs on. Driven with a fake lease responder (the ledger's
side is tested against the real server in tests/e2e/test_cancellation.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from executors import ItemAction, ProcessorOptions, Tool, ToolContext
from executors._process import ItemProcessor
from schemas import CANCELLED_BEFORE_EFFECT, LeaseDecision, LeaseReply, LeaseRequest
from tests.executors.helpers import FakeLedger, Heartbeats, contract, process, reply, work_item

TOOL = "search_documents"
ARGS = {"query": "refund window", "source_types": ["policy"], "top_k": 3}
OUT: dict[str, Any] = {"items": [], "truncated": False, "next_cursor": None}
INTERVAL_S = 0.02


def _slow(stoppable: bool | None, ran: list[str]) -> Tool:
    async def run(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        await asyncio.sleep(0.5)
        ran.append("finished")
        return OUT

    slow = Tool(name=TOOL, run=run)
    if stoppable is not None:

        @slow.canceller
        def _cancel(operation_id: str, context: ToolContext) -> bool:
            ran.append(f"cancel hook for {operation_id}")
            return stoppable

    return slow


def _ledger(cancel_after: int) -> FakeLedger:
    """Leases the call, then answers check-ins `execute`, and `cancel` from check-in
    number `cancel_after` on."""
    check_ins: list[LeaseRequest] = []

    def answer(request: LeaseRequest) -> LeaseReply:
        if request.holding is None:
            return reply(LeaseDecision.EXECUTE, "op-1", TOOL, arguments=ARGS, fencing_token=4)
        check_ins.append(request)
        decision = LeaseDecision.CANCEL if len(check_ins) >= cancel_after else (
            LeaseDecision.EXECUTE
        )
        return reply(decision, "op-1", TOOL, fencing_token=4)

    return FakeLedger(answer)


def _processor(implementation: Tool) -> ItemProcessor:
    options = ProcessorOptions("exec-1", heartbeat_interval_s=INTERVAL_S)
    return ItemProcessor(implementation, contract(TOOL), options)


def test_a_cancel_at_a_check_in_stops_a_tool_that_can_stop() -> None:
    ran: list[str] = []
    ledger = _ledger(cancel_after=3)
    disposition = process(_processor(_slow(True, ran)), work_item("op-1", TOOL), ledger)
    assert disposition.action is ItemAction.PUBLISH and disposition.envelope is not None
    error = disposition.envelope.error
    assert error is not None and error.code == CANCELLED_BEFORE_EFFECT
    assert disposition.envelope.fencing_token == 4
    assert ran == ["cancel hook for op-1"]  # stopped: the call never finished
    check_ins = [r for r in ledger.requests if r.holding is not None]
    assert len(check_ins) == 3 and {r.holding for r in check_ins} == {4}


def test_too_late_to_stop_or_no_hook_the_call_runs_to_its_outcome() -> None:
    cases: list[tuple[bool | None, list[str]]] = [
        (False, ["cancel hook for op-1", "finished"]),
        (None, ["finished"]),
    ]
    for stoppable, expected in cases:
        ran: list[str] = []
        disposition = process(_processor(_slow(stoppable, ran)), work_item("op-1", TOOL),
                              _ledger(cancel_after=1))
        assert disposition.envelope is not None and disposition.envelope.ok
        assert ran == expected


def test_no_cancel_means_the_call_just_runs() -> None:
    ran: list[str] = []
    ledger = _ledger(cancel_after=10_000)
    disposition = process(_processor(_slow(True, ran)), work_item("op-1", TOOL), ledger)
    assert disposition.envelope is not None and disposition.envelope.ok
    assert ran == ["finished"]
    assert len([r for r in ledger.requests if r.holding is not None]) >= 5  # it checked in


def test_a_lease_lost_while_running_stops_a_tool_that_can_stop() -> None:
    """Found in review: a `done` check-in (the lease ran out, or the call was settled)
    was ignored, and the call ran on to an effect the ledger no longer expected."""
    ran: list[str] = []

    def answer(request: LeaseRequest) -> LeaseReply:
        if request.holding is None:
            return reply(LeaseDecision.EXECUTE, "op-1", TOOL, arguments=ARGS, fencing_token=4)
        return reply(LeaseDecision.DONE, "op-1", TOOL)

    disposition = process(_processor(_slow(True, ran)), work_item("op-1", TOOL),
                          FakeLedger(answer))
    assert disposition.envelope is not None and disposition.envelope.error is not None
    assert disposition.envelope.error.code == CANCELLED_BEFORE_EFFECT
    assert ran == ["cancel hook for op-1"]


def test_a_lookups_answer_names_the_lookup_the_lease_named() -> None:
    from executors import Reconciliation

    implementation = Tool(name=TOOL, run=lambda _a, _c: OUT)

    @implementation.reconciler
    def _unsure(_operation_id: str, _context: ToolContext) -> Reconciliation:
        return Reconciliation.unknown("the provider cannot tell yet")

    lease = reply(LeaseDecision.RECONCILE, "op-1", TOOL, fencing_token=4)
    lease = lease.model_copy(update={"lookup": 3})
    disposition = process(_processor(implementation), work_item("op-1", TOOL), FakeLedger(lease))
    assert disposition.envelope is not None
    assert (disposition.envelope.outcome_unknown, disposition.envelope.lookup) == (True, 3)


def _after_done(processor: ItemProcessor, ledger: FakeLedger, beats: Heartbeats) -> list[int]:
    """Process one item, then wait five intervals more in the same loop; the counts of
    in-progress acks and check-ins when the item was done and after the wait."""

    async def run() -> list[int]:
        await processor.process(work_item("op-1", TOOL), lease=ledger, heartbeat=beats)
        done = [beats.count, len([r for r in ledger.requests if r.holding is not None])]
        await asyncio.sleep(INTERVAL_S * 5)
        return [*done, beats.count, len([r for r in ledger.requests if r.holding is not None])]

    return asyncio.run(run())


def test_a_call_done_within_one_interval_gets_no_check_in_task_nor_acks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast path: no task that would check in (it costs a task per item even when
    it never checks in), and no in-progress ack."""
    fast = Tool(name=TOOL, run=lambda _a, _c: OUT)
    processor = ItemProcessor(fast, contract(TOOL), ProcessorOptions("exec-1",
                                                                     heartbeat_interval_s=0.5))
    watchers: list[str] = []
    watch = processor._watch_for_cancel

    def recorded(*args: Any) -> Any:
        watchers.append("started")
        return watch(*args)

    monkeypatch.setattr(processor, "_watch_for_cancel", recorded)
    disposition = process(processor, work_item("op-1", TOOL), _ledger(cancel_after=10_000),
                          heartbeat=(beats := Heartbeats()))
    assert disposition.envelope is not None and disposition.envelope.ok
    assert watchers == [] and beats.count == 0


def test_the_first_check_in_comes_one_interval_after_the_call_started() -> None:
    """A call that runs one and a half intervals is checked in on once, at the first
    interval, and so can still be stopped then (were the first check-in an interval
    later, the call would finish first)."""
    ran: list[str] = []

    async def run(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        await asyncio.sleep(0.15)
        ran.append("finished")
        return OUT

    slow = Tool(name=TOOL, run=run)

    @slow.canceller
    def _cancel(operation_id: str, context: ToolContext) -> bool:
        ran.append("stopped")
        return True

    ledger = _ledger(cancel_after=1)
    processor = ItemProcessor(slow, contract(TOOL), ProcessorOptions("exec-1",
                                                                     heartbeat_interval_s=0.1))
    disposition = process(processor, work_item("op-1", TOOL), ledger)
    assert disposition.envelope is not None and disposition.envelope.error is not None
    assert disposition.envelope.error.code == CANCELLED_BEFORE_EFFECT
    assert ran == ["stopped"]
    assert len([r for r in ledger.requests if r.holding is not None]) == 1


def test_nothing_checks_in_or_acks_in_progress_once_the_item_is_done() -> None:
    """Check-ins and in-progress acks wait on timers (no task for an item done within
    one interval): a timer left behind would ack an acked item, and check in for a
    call that has finished."""
    ran: list[str] = []
    beats = Heartbeats()
    ledger = _ledger(cancel_after=10_000)
    counts = _after_done(_processor(_slow(True, ran)), ledger, beats)
    assert ran == ["finished"]
    assert counts[0] >= 5 and counts[1] >= 5  # it did both while the call ran
    assert counts[2:] == counts[:2]


def test_a_call_that_outlives_its_timeout_between_check_ins_times_out() -> None:
    ran: list[str] = []

    def answer(request: LeaseRequest) -> LeaseReply:
        if request.holding is None:
            return reply(LeaseDecision.EXECUTE, "op-1", TOOL, arguments=ARGS, fencing_token=4,
                         timeout_ms=150)
        return reply(LeaseDecision.EXECUTE, "op-1", TOOL, fencing_token=4)

    ledger = FakeLedger(answer)
    disposition = process(_processor(_slow(True, ran)), work_item("op-1", TOOL), ledger)
    assert disposition.envelope is not None and disposition.envelope.error is not None
    assert disposition.envelope.error.code == "EXECUTION_TIMEOUT"
    assert ran == []  # abandoned at its deadline
    assert len([r for r in ledger.requests if r.holding is not None]) >= 2


@pytest.mark.parametrize("turns", range(6))
def test_the_item_ends_when_its_run_ends_as_a_check_in_is_answered(turns: int) -> None:
    """Found in review: the check-ins were stopped with one cancel. The lease is nats-py's
    request, whose `asyncio.wait_for` on Python 3.11 drops a cancel arriving in the turn
    its answer does: the check-ins then went on, and the item whose run had ended waited
    for them (until the lease ran out). The run ends `turns` turns of the loop before a
    check-in is answered; in some of these the cancel met the answer (3 of 6 before)."""

    async def main() -> tuple[bool, int]:
        loop = asyncio.get_running_loop()
        finish: asyncio.Future[None] = loop.create_future()
        open_check_ins: list[asyncio.Future[LeaseReply]] = []
        asked = asyncio.Event()

        async def run(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
            await finish
            return OUT

        async def lease(request: LeaseRequest) -> LeaseReply:
            if request.holding is None:
                return reply(LeaseDecision.EXECUTE, "op-1", TOOL, arguments=ARGS,
                             fencing_token=4, timeout_ms=60_000)
            answer: asyncio.Future[LeaseReply] = loop.create_future()
            open_check_ins.append(answer)
            asked.set()
            return await asyncio.wait_for(answer, 5)  # as nats-py's request does

        def answer_all() -> None:
            for check_in in open_check_ins:
                if not check_in.done():
                    check_in.set_result(reply(LeaseDecision.EXECUTE, "op-1", TOOL,
                                              fencing_token=4))

        def after(turns_left: int) -> None:
            if turns_left:
                loop.call_soon(after, turns_left - 1)
            else:
                answer_all()

        processor = ItemProcessor(
            Tool(name=TOOL, run=run), contract(TOOL),
            ProcessorOptions("exec-1", heartbeat_interval_s=INTERVAL_S),
        )
        item = asyncio.ensure_future(
            processor.process(work_item("op-1", TOOL), lease=lease, heartbeat=Heartbeats())
        )
        async with asyncio.timeout(5):
            await asked.wait()
        finish.set_result(None)
        after(turns)

        async def answer_at_once() -> None:  # later check-ins, as a live ledger would
            while True:
                await asyncio.sleep(0.01)
                answer_all()

        answering = asyncio.ensure_future(answer_at_once())
        done, _ = await asyncio.wait({item}, timeout=2)
        answering.cancel()
        if item not in done:
            item.cancel()
        return item in done, len(open_check_ins)

    ended, check_ins = asyncio.run(main())
    assert ended, f"the item never ended after its run did ({check_ins} check-ins)"
