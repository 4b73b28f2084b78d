"""`ExecutorRunner` against fake NATS objects: the consumer it pulls from, subjects,
headers and the order publish → PubAck → ack. `PullConsumer` itself and the real
server are tested in `tests/nats/test_pull.py` and with the NATS topology."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import pytest

import executors._runner
from executors import (
    ExecutorConfigError,
    ExecutorRunner,
    ProcessorOptions,
    RunnerOptions,
    Tool,
    ToolContext,
)
from executors._main import serve_until_stopped
from schemas import LeaseDecision, LeaseReply, LeaseRequest, PullConsumer, ResultEnvelope
from tests.executors.helpers import contract, reply, work_item

TOOL = "search_documents"
ARGS = {"query": "refund window", "source_types": ["policy"], "top_k": 3}
OUTPUT = {"items": [], "truncated": False, "next_cursor": None}


class FakeMsg:
    def __init__(self, name: str, data: bytes, events: list[tuple[Any, ...]], delivered: int = 1):
        self.name = name
        self.data = data
        self.metadata = SimpleNamespace(num_delivered=delivered)
        self._events = events

    async def ack(self) -> None:
        self._events.append(("ack", self.name))

    async def nak(self, delay: float | None = None) -> None:
        self._events.append(("nak", self.name, delay))

    async def term(self) -> None:
        self._events.append(("term", self.name))

    async def in_progress(self) -> None:
        self._events.append(("in_progress", self.name))


class FakeNats:
    """A connection, its JetStream context and one pull consumer, all recorded."""

    def __init__(self, answers: Mapping[str, LeaseReply | bytes], *, failing_publishes: int = 0):
        self.answers = answers
        self.events: list[tuple[Any, ...]] = []
        self.batches: list[list[FakeMsg]] = []
        self.options: dict[str, Any] = {}
        self.bound: dict[str, Any] = {}
        self.published: list[dict[str, Any]] = []
        self.failing_publishes = failing_publishes
        self.runner: ExecutorRunner | None = None
        self.timeouts: dict[str, list[float | None]] = {}
        self.fetched: list[int] = []
        self.stop_in_fetch = False
        self.held_at_stop: list[FakeMsg] = []
        self.request_headers: list[dict[str, str] | None] = []

    def _timeout(self, what: str, timeout: float | None) -> None:
        self.timeouts.setdefault(what, []).append(timeout)

    # nats.connect
    async def connect(self, **options: Any) -> FakeNats:
        self.options = options
        return self

    def jetstream(self, timeout: float | None = None) -> FakeNats:
        self._timeout("jetstream", timeout)
        return self

    # schemas.PullConsumer, as the runner's `pull` factory builds it
    def consumer(self, nc: object, stream: str, consumer: str) -> FakeNats:
        assert nc is self
        self.bound = {"consumer": consumer, "stream": stream}
        return self

    async def start(self) -> None:
        self.events.append(("subscribed",))

    async def take(self, capacity: int, timeout: float | None = None) -> list[FakeMsg]:
        self.fetched.append(capacity)
        self._timeout("take", timeout)
        if self.batches:
            if self.stop_in_fetch:
                assert self.runner is not None
                self.runner.stop()  # SIGTERM arrives while the take is under way
            return self.batches.pop(0)
        assert self.runner is not None
        self.runner.stop()
        return []

    async def stop(self) -> list[FakeMsg]:
        return self.held_at_stop

    def interrupt(self) -> None:
        pass

    def reset(self) -> None:
        pass

    async def request(
        self,
        subject: str,
        payload: bytes,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        self._timeout("request", timeout)
        self.request_headers.append(headers)
        request = LeaseRequest.model_validate_json(payload)
        self.events.append(("lease", subject, request.operation_id))
        answer = self.answers[request.operation_id]
        if isinstance(answer, bytes):
            return SimpleNamespace(data=answer)
        return SimpleNamespace(data=answer.model_dump_json().encode())

    async def publish(
        self,
        subject: str,
        payload: bytes,
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        self._timeout("publish", timeout)
        self.published.append(
            {
                "subject": subject,
                "payload": payload,
                "stream": stream,
                "headers": dict(headers or {}),
            }
        )
        if self.failing_publishes > 0:
            self.failing_publishes -= 1
            self.events.append(("publish_failed", subject))
            raise TimeoutError
        self.events.append(("publish", subject))
        return SimpleNamespace(stream=stream, seq=len(self.published), duplicate=False)

    async def flush(self, timeout: float | None = None) -> None:
        self._timeout("flush", timeout)
        self.events.append(("flush",))

    async def close(self) -> None:
        self.events.append(("close",))

    def message(self, name: str, payload: bytes, delivered: int = 1) -> FakeMsg:
        return FakeMsg(name, payload, self.events, delivered)


def _tool(run: Any = None) -> Tool:
    def default(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        return OUTPUT

    return Tool(name=TOOL, run=run or default)


_PROCESSING = {option.name for option in fields(ProcessorOptions)}


def _runner(fake: FakeNats, tool: Tool | None = None, **options: Any) -> ExecutorRunner:
    # The keywords of either option type may be given; each goes where it belongs.
    processing = {name: options.pop(name) for name in list(options) if name in _PROCESSING}
    runner = ExecutorRunner(
        tool or _tool(),
        contract(TOOL),
        RunnerOptions(
            ProcessorOptions("exec-7", **processing),
            connect_options=options.pop("connect_options", {"servers": ["nats://127.0.0.1:4222"]}),
            connect=fake.connect,
            pull=cast("Callable[[Any, str, str], PullConsumer]", fake.consumer),
            fetch_timeout_s=0.05,
            **options,
        ),
    )
    fake.runner = runner
    return runner


def _execute(operation_id: str) -> LeaseReply:
    return reply(
        LeaseDecision.EXECUTE, operation_id, TOOL, arguments=ARGS, fencing_token=5, attempt=2
    )


def test_pulls_from_its_consumer_and_publishes_before_acking() -> None:
    fake = FakeNats({"op-1": _execute("op-1")})
    fake.batches = [[fake.message("m1", work_item("op-1", TOOL))]]
    asyncio.run(_runner(fake).run())

    assert fake.options["inbox_prefix"] == "_INBOX_exec_search_documents"
    assert fake.options["name"] == "exec-7"
    assert fake.options["servers"] == ["nats://127.0.0.1:4222"]
    assert fake.bound == {"consumer": "exec_search_documents", "stream": "OPS_WORK"}
    assert fake.events == [
        ("subscribed",),
        ("lease", "ops.lease.search_documents", "op-1"),
        ("publish", "ops.result.search_documents"),
        ("ack", "m1"),
        ("flush",),
        ("close",),
    ]
    (published,) = fake.published
    # The message ID, and the trace context when this process traces (another test
    # may have installed a tracer provider): nothing else.
    assert set(published["headers"]) - {"traceparent", "tracestate"} == {"Nats-Msg-Id"}
    msg_id = published["headers"]["Nats-Msg-Id"]
    assert re.fullmatch(r"search_documents:op-1:2:5:[0-9a-f]{16}", msg_id)
    assert published["stream"] == "OPS_RESULTS"
    envelope = ResultEnvelope.model_validate_json(published["payload"])
    assert envelope.ok
    # Nothing waits without a bound: lease, publish and take all have timeouts.
    assert set(fake.timeouts) == {"jetstream", "take", "request", "publish", "flush"}
    assert all(t is not None and t > 0 for ts in fake.timeouts.values() for t in ts)
    assert envelope.fencing_token == 5
    assert envelope.provenance.executor == "exec-7"


def test_callers_connect_options_are_kept() -> None:
    fake = FakeNats({})
    options = {
        "servers": ["nats://x:1"],
        "nkeys_seed": "/secrets/exec.nk",
        "inbox_prefix": "_INBOX_custom",
    }
    runner = _runner(fake, connect_options=options)
    asyncio.run(runner.run())
    assert fake.options["nkeys_seed"] == "/secrets/exec.nk"
    assert fake.options["inbox_prefix"] == "_INBOX_custom"
    assert options == {
        "servers": ["nats://x:1"],
        "nkeys_seed": "/secrets/exec.nk",
        "inbox_prefix": "_INBOX_custom",
    }


def test_a_lost_puback_is_retried_with_the_same_message_id() -> None:
    fake = FakeNats({"op-1": _execute("op-1")}, failing_publishes=1)
    fake.batches = [[fake.message("m1", work_item("op-1", TOOL))]]
    asyncio.run(_runner(fake).run())
    first, again = (p["headers"]["Nats-Msg-Id"] for p in fake.published)
    assert first == again
    assert re.fullmatch(r"search_documents:op-1:2:5:[0-9a-f]{16}", first)
    assert ("ack", "m1") in fake.events
    assert fake.events.index(("publish", "ops.result.search_documents")) < fake.events.index(
        ("ack", "m1")
    )


def test_each_result_publish_draws_a_new_nonce() -> None:
    """The same result published twice (two runs of one attempt) gets two message IDs:
    the nonce is drawn at random, not derived from the operation. The results stream
    drops a message whose ID it has seen, on any tool's subject, so an executor of
    another tool that could predict the ID could publish under it first and make this
    result vanish (`tests/e2e/test_result_ids.py` tries the old, nonce-less forms)."""
    ids = []
    for _ in range(3):
        fake = FakeNats({"op-1": _execute("op-1")})
        fake.batches = [[fake.message("m1", work_item("op-1", TOOL))]]
        asyncio.run(_runner(fake).run())
        (published,) = fake.published
        ids.append(published["headers"]["Nats-Msg-Id"])
    nonces = {msg_id.rsplit(":", 1)[1] for msg_id in ids}
    assert len(nonces) == 3, ids
    assert all(re.fullmatch(r"[0-9a-f]{16}", nonce) for nonce in nonces), ids


def test_no_puback_means_no_ack() -> None:
    fake = FakeNats({"op-1": _execute("op-1")}, failing_publishes=5)
    fake.batches = [[fake.message("m1", work_item("op-1", TOOL))]]
    asyncio.run(_runner(fake, publish_attempts=2, retry_delay_s=7.0).run())
    assert len(fake.published) == 2
    assert ("ack", "m1") not in fake.events
    assert ("nak", "m1", 7.0) in fake.events


def test_done_busy_and_malformed_items_are_settled_without_publishing() -> None:
    fake = FakeNats(
        {
            "op-done": reply(LeaseDecision.DONE, "op-done", TOOL),
            "op-busy": reply(LeaseDecision.BUSY, "op-busy", TOOL),
        }
    )
    fake.batches = [
        [
            fake.message("m-done", work_item("op-done", TOOL), delivered=3),
            fake.message("m-busy", work_item("op-busy", TOOL)),
            fake.message("m-bad", b"{}"),
        ]
    ]
    asyncio.run(_runner(fake, batch_size=3).run())
    assert fake.published == []
    assert ("ack", "m-done") in fake.events
    assert ("term", "m-bad") in fake.events
    (busy,) = [event for event in fake.events if event[:2] == ("nak", "m-busy")]
    assert busy[2] is not None and busy[2] > 0


def test_an_error_answer_to_a_lease_request_is_understood() -> None:
    error = {"code": "OPERATION_NOT_FOUND", "category": "NOT_FOUND", "message": "no such operation"}
    fake = FakeNats(
        {
            "op-gone": json.dumps({"operation_id": "op-gone", "error": error}).encode(),
            "op-late": json.dumps({"operation_id": "op-late", "error": error}).encode(),
            "op-junk": b"<html>",
        }
    )
    fake.batches = [
        [
            fake.message("m-gone", work_item("op-gone", TOOL)),
            fake.message("m-late", work_item("op-late", TOOL), delivered=5),
            fake.message("m-junk", work_item("op-junk", TOOL)),
        ]
    ]
    runner = _runner(fake, batch_size=3, retry_delay_s=4.0)
    asyncio.run(runner.run())
    assert ("nak", "m-gone", 4.0) in fake.events
    assert ("term", "m-late") in fake.events
    assert ("nak", "m-junk", 4.0) in fake.events
    assert fake.published == []
    samples = runner.metrics.registry
    assert samples.get_sample_value("tool_execution_retries_total", {"reason": "lease_error"}) == 1
    assert (
        samples.get_sample_value("tool_execution_retries_total", {"reason": "lease_unavailable"})
        == 1
    )


def test_items_of_one_take_run_at_once_and_stop_lets_them_finish() -> None:
    fake = FakeNats({f"op-{n}": _execute(f"op-{n}") for n in range(3)})
    holder: dict[str, ExecutorRunner] = {}

    def run(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        holder["runner"].stop()  # SIGTERM arrives while the items run
        return OUTPUT

    fake.batches = [[fake.message(f"m{n}", work_item(f"op-{n}", TOOL)) for n in range(3)]]
    runner = _runner(fake, _tool(run), batch_size=3)
    holder["runner"] = runner
    asyncio.run(runner.run())
    assert fake.fetched == [3]
    # All three asked for their lease before any result went out: concurrent.
    assert [event[0] for event in fake.events[1:4]] == ["lease"] * 3
    # Stopping took nothing more, and every item in progress finished.
    for n in range(3):
        assert ("ack", f"m{n}") in fake.events
    assert sum(1 for event in fake.events if event[0] == "publish") == 3
    assert fake.events[-2:] == [("flush",), ("close",)]


def test_stop_during_a_take_returns_what_it_brought_at_once() -> None:
    fake = FakeNats({f"op-{n}": _execute(f"op-{n}") for n in range(3)})
    fake.batches = [[fake.message(f"m{n}", work_item(f"op-{n}", TOOL)) for n in range(3)]]
    fake.stop_in_fetch = True
    runner = _runner(fake, batch_size=3)
    asyncio.run(runner.run())
    assert fake.events == [
        ("subscribed",),
        ("nak", "m0", None),
        ("nak", "m1", None),
        ("nak", "m2", None),
        ("flush",),
        ("close",),
    ]


def test_items_delivered_but_not_taken_at_stop_go_back_at_once() -> None:
    fake = FakeNats({})
    fake.held_at_stop = [fake.message("late", work_item("op-9", TOOL))]
    asyncio.run(_runner(fake).run())
    assert fake.events == [("subscribed",), ("nak", "late", None), ("flush",), ("close",)]


def test_a_batch_size_below_one_is_refused() -> None:
    with pytest.raises(ExecutorConfigError, match="batch_size"):
        _runner(FakeNats({}), batch_size=0)


def test_a_result_is_kept_trying_while_the_lease_holds_then_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A results stream electing a leader refuses publishes for seconds: the executor
    keeps trying (marking the item in progress) until the lease would run out, instead
    of dropping a result after `publish_attempts` tries."""
    now = [datetime.now(UTC)]
    real_sleep = asyncio.sleep

    async def elapse(seconds: float, *args: Any) -> Any:
        now[0] += timedelta(seconds=seconds)
        return await real_sleep(0, *args)

    # Only the runner's own pauses elapse on the fake clock (not the processor's).
    fast = SimpleNamespace(**{name: getattr(asyncio, name) for name in dir(asyncio)
                              if not name.startswith("__")})
    fast.sleep = elapse
    monkeypatch.setattr(executors._runner, "asyncio", fast)
    for failing, published, acked in ((6, 7, True), (100, 7, False)):
        leased = _execute("op-1").model_copy(
            update={"lease_expires_at": now[0] + timedelta(seconds=10)}
        )
        fake = FakeNats({"op-1": leased}, failing_publishes=failing)
        fake.batches = [[fake.message("m1", work_item("op-1", TOOL))]]
        asyncio.run(_runner(fake, publish_attempts=2, clock=lambda: now[0]).run())
        # Pauses of 0.5, 1, 2, 2, ... s: the 7th try is the last before the 10 s lease ends.
        assert len(fake.published) == published, fake.events
        assert (("ack", "m1") in fake.events) is acked
        assert fake.events.count(("in_progress", "m1")) >= published - 1


def _closing_tool(events: list[tuple[Any, ...]], run: Any = None, close: Any = None) -> Tool:
    tool = _tool(run)

    async def recorded_close() -> None:
        events.append(("tool closed",))
        if close is not None:
            await close()

    tool.closer(recorded_close)
    return tool


def _hanging(running: asyncio.Event) -> Callable[..., Awaitable[dict[str, Any]]]:
    """A tool's run that sets `running`, then never ends by itself."""

    async def hangs(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        running.set()
        await asyncio.Event().wait()
        return OUTPUT

    return hangs


def test_the_tools_close_is_awaited_once_when_the_executor_stops_after_its_last_item() -> None:
    fake = FakeNats({"op-1": _execute("op-1")})
    fake.batches = [[fake.message("m1", work_item("op-1", TOOL))]]
    asyncio.run(_runner(fake, _closing_tool(fake.events)).run())
    assert fake.events.count(("tool closed",)) == 1
    assert fake.events.index(("ack", "m1")) < fake.events.index(("tool closed",))


def test_an_abandoned_item_still_closes_the_tool() -> None:
    """A second signal cancels the run while an item runs: the item is abandoned (it is
    redelivered), and the tool still closes (an MCP server process it started must not
    outlive the executor)."""
    fake = FakeNats({"op-1": _execute("op-1")})
    fake.batches = [[fake.message("m1", work_item("op-1", TOOL))]]
    running = asyncio.Event()
    hangs = _hanging(running)

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(
            _runner(fake, _closing_tool(fake.events, hangs)).run()
        )
        await running.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert ("ack", "m1") not in fake.events
    assert fake.events.count(("tool closed",)) == 1


@pytest.mark.parametrize("failure", ["hangs", "raises"])
def test_a_close_that_hangs_or_fails_does_not_keep_the_executor_from_stopping(
    failure: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(executors._runner, "_TOOL_CLOSE_S", 0.2)

    async def close() -> None:
        if failure == "raises":
            raise RuntimeError("the provider's client would not close")
        await asyncio.Event().wait()

    fake = FakeNats({})
    asyncio.run(_runner(fake, _closing_tool(fake.events, close=close)).run())
    assert ("tool closed",) in fake.events
    said = "did not close within" if failure == "hangs" else "closing the tool failed"
    assert any(said in record.getMessage() for record in caplog.records)


def test_another_signal_during_the_close_does_not_cut_it_short() -> None:
    """The first signal lets the items finish, then the tool closes. A second signal
    (the run cancelled) during that close waits for it (within its bound), then the run
    ends cancelled: cut short, the close would leave an MCP server process running
    (found in review, on the real sample server)."""
    fake = FakeNats({})
    closing = asyncio.Event()

    async def slow_close() -> None:
        closing.set()
        await asyncio.sleep(0.3)
        fake.events.append(("close finished",))

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(
            _runner(fake, _closing_tool(fake.events, close=slow_close)).run()
        )
        await closing.wait()
        task.cancel()  # the second signal
        await asyncio.sleep(0.05)
        task.cancel()  # and a third
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert ("close finished",) in fake.events


class _DroppingDrain(FakeNats):
    """A consumer whose takes wait until interrupted, and whose stop (nats-py drains
    the inbox there) drops a cancel, as nats-py's waits do on Python 3.11 when the
    cancel lands in the turn their answer does."""

    def __init__(self, answers: Mapping[str, LeaseReply | bytes]) -> None:
        super().__init__(answers)
        self.interrupted = asyncio.Event()
        self.draining = asyncio.Event()

    async def take(self, capacity: int, timeout: float | None = None) -> list[FakeMsg]:
        self.fetched.append(capacity)
        self._timeout("take", timeout)
        if self.batches:
            return self.batches.pop(0)
        await self.interrupted.wait()
        return []

    def interrupt(self) -> None:
        self.interrupted.set()

    async def stop(self) -> list[FakeMsg]:
        self.draining.set()
        try:
            await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            self.events.append(("cancel dropped",))
        return []


def test_a_second_signal_abandons_the_item_even_when_nats_drops_the_cancel() -> None:
    """`serve_until_stopped` with real signals. The first lets the item run on; the
    second abandons it. It lands while the loop drains the consumer, where nats-py may
    drop a cancel: before, the second signal was only that cancel, it was lost, and the
    item (which never ends here) kept the executor running; only a third signal ended
    it. Now the runner cancels its items itself."""
    fake = _DroppingDrain({"op-1": _execute("op-1")})
    fake.batches = [[fake.message("m1", work_item("op-1", TOOL))]]
    running = asyncio.Event()
    hangs = _hanging(running)

    async def main() -> None:
        runner = _runner(fake, _closing_tool(fake.events, hangs), batch_size=2)
        serving = asyncio.get_running_loop().create_task(serve_until_stopped(runner))
        await running.wait()
        os.kill(os.getpid(), signal.SIGTERM)  # finish the item first
        await fake.draining.wait()
        await asyncio.sleep(0.05)
        assert not serving.done()  # the first signal waits for the item
        os.kill(os.getpid(), signal.SIGTERM)  # abandon it
        async with asyncio.timeout(5):
            await serving

    asyncio.run(main())
    assert ("cancel dropped",) in fake.events  # the situation the test is about
    assert ("ack", "m1") not in fake.events and fake.published == []
    assert fake.events.count(("tool closed",)) == 1
    assert fake.events[-3:] == [("flush",), ("close",), ("tool closed",)]


def test_an_abandoned_items_tool_call_ends_before_the_tool_closes() -> None:
    """Found in review: a second signal re-cancels the item until it ends, but the tool's
    call runs in a task of its own, which was cancelled once and not waited for: a call
    that takes a moment over its cancel (here it drops one, as nats-py may, then works
    on for 0.2 s) went on after its item, after the tool's `close`, and after the
    executor's own end."""
    fake = _DroppingDrain({"op-1": _execute("op-1")})
    fake.batches = [[fake.message("m1", work_item("op-1", TOOL))]]
    running = asyncio.Event()

    async def slow_to_stop(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            fake.events.append(("tool call cancelled",))
        await asyncio.sleep(0.2)
        fake.events.append(("tool call ended",))
        return OUTPUT

    async def main() -> None:
        runner = _runner(fake, _closing_tool(fake.events, slow_to_stop), batch_size=2)
        serving = asyncio.get_running_loop().create_task(serve_until_stopped(runner))
        await running.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        await fake.draining.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        async with asyncio.timeout(5):
            await serving
        fake.events.append(("executor ended",))

    asyncio.run(main())
    assert ("ack", "m1") not in fake.events and fake.published == []
    ended = fake.events.index(("tool call ended",))
    assert ended < fake.events.index(("tool closed",)) < fake.events.index(("executor ended",))


_Fake = TypeVar("_Fake", bound=FakeNats)


def _cancelled_after_its_lease(kind: type[_Fake]) -> _Fake:
    """A `kind` fake whose op-1 gets its lease (30 s), and whose every check-in after
    that is answered `cancel`."""
    fake = kind({"op-1": reply(LeaseDecision.EXECUTE, "op-1", TOOL, arguments=ARGS,
                               fencing_token=5, attempt=2, timeout_ms=30000)})
    leased = fake.request

    async def request(subject: str, payload: bytes, timeout: float | None = None,
                      headers: dict[str, str] | None = None) -> Any:
        answer = await leased(subject, payload, timeout, headers)
        fake.answers = {
            "op-1": reply(LeaseDecision.CANCEL, "op-1", TOOL, fencing_token=5, attempt=2)
        }
        return answer

    fake.request = request  # type: ignore[method-assign]
    return fake


def test_an_abandoned_items_check_ins_end_with_it() -> None:
    """Found in review: when the tool's call took longer than the re-cancel's half second
    over its cancel, the wait for it swallowed the cancel that would have ended the
    item's check-in task: it kept checking in after its item, the tool's close and the
    NATS close."""
    fake = _DroppingDrain({"op-1": _execute("op-1")})
    fake.batches = [[fake.message("m1", work_item("op-1", TOOL))]]
    running = asyncio.Event()
    left: list[str] = []

    async def slow_to_stop(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        running.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        await asyncio.sleep(0.7)  # past the re-cancel's 0.5 s
        return OUTPUT

    async def main() -> None:
        runner = _runner(fake, _closing_tool(fake.events, slow_to_stop), batch_size=2,
                         heartbeat_interval_s=0.1)
        serving = asyncio.get_running_loop().create_task(serve_until_stopped(runner))
        await running.wait()
        await asyncio.sleep(0.3)  # the item checks in
        os.kill(os.getpid(), signal.SIGTERM)
        await fake.draining.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        async with asyncio.timeout(5):
            await serving
        fake.events.append(("executor ended",))
        await asyncio.sleep(0.3)
        left.extend(repr(task.get_coro()) for task in asyncio.all_tasks()
                    if task is not asyncio.current_task())

    asyncio.run(main())
    closed = fake.events.index(("tool closed",))
    assert [event for event in fake.events[closed:] if event[0] == "lease"] == []
    assert left == []


def test_a_call_that_ends_with_its_output_after_a_cancel_reports_it() -> None:
    """Found in review: the cancel hook said the call stopped before any effect, but the
    call ended with its output while the executor waited for it to stop; the output was
    dropped and the call reported cancelled before any effect. What happened is
    published instead."""

    fake = _cancelled_after_its_lease(FakeNats)
    fake.batches = [[fake.message("m1", work_item("op-1", TOOL))]]

    async def committing(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.3)  # the write was committing: it completes
        await asyncio.sleep(0.1)
        return OUTPUT

    tool = _tool(committing)

    @tool.canceller
    async def cancel(operation_id: str, context: ToolContext) -> bool:
        return True  # "stopped before any effect"

    asyncio.run(_runner(fake, tool, heartbeat_interval_s=0.1).run())
    envelope = json.loads(fake.published[0]["payload"])
    assert envelope["ok"] and envelope["data"] == OUTPUT, envelope["error"]


def test_an_abandoned_call_past_its_cancel_is_waited_for_a_second_only() -> None:
    """Found in review: once a cancel came too late (no cancel hook, as for every MCP
    tool), the item awaited its call, which passed each cancel of the item on to the call
    and waited as long as the call took over it: an abandoned item waited for its call,
    and a call that never stopped kept the executor from stopping."""

    fake = _cancelled_after_its_lease(_DroppingDrain)
    fake.batches = [[fake.message("m1", work_item("op-1", TOOL))]]
    running = asyncio.Event()

    released = asyncio.Event()

    async def never_stops(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        running.set()
        while not released.is_set():  # released once the test has measured
            with contextlib.suppress(asyncio.CancelledError):  # swallows every cancel
                await asyncio.sleep(0.05)
        return OUTPUT

    took: list[float] = []

    async def main() -> None:
        runner = _runner(fake, _tool(never_stops), batch_size=2, heartbeat_interval_s=0.1)
        serving = asyncio.get_running_loop().create_task(serve_until_stopped(runner))
        await running.wait()
        await asyncio.sleep(0.5)  # checked in: a cancel, too late without a hook
        os.kill(os.getpid(), signal.SIGTERM)
        await fake.draining.wait()
        second = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        # Waited for, not awaited: cancelled at a timeout, the await would wait for it.
        done, _ = await asyncio.wait({serving}, timeout=10)
        if done:
            took.append(time.monotonic() - second)
        released.set()  # what nothing can stop would hold the loop's own end
        await serving

    asyncio.run(main())
    assert took and took[0] < 3, f"still running 10 s after the second signal: {took}"
    assert ("ack", "m1") not in fake.events and fake.published == []
