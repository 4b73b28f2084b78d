"""`ExecutorRunner`: one tool's executor loop over NATS JetStream.

The executor of tool T holds few permissions (see `ledger/nats`): it may
pull from and ack on its own durable consumer `work_consumer(T)`, request
`Subjects.lease(T)`, publish to `Subjects.result(T)`, and receive on its own
inbox prefix `inbox_prefix("exec", T)`. So it pulls from the consumer by name
(`schemas.PullConsumer`, no lookup or creation) and never touches `_INBOX.>`.

Per message the loop asks `ItemProcessor` what to do, then does it. A result
is acked only after its PubAck: if the process dies in between, the item is
redelivered, the ledger answers `done` (or `reconcile`), and the operation
converges instead of running twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import nats.errors
import orjson
from opentelemetry.trace import SpanKind
from prometheus_client import start_http_server
from pydantic import ValidationError

from executors._api import Tool
from executors._errors import ExecutorConfigError, LeaseError
from executors._metrics import ExecutorMetrics
from executors._process import (
    ItemAction,
    ItemDisposition,
    ItemProcessor,
    ProcessorOptions,
    result_msg_id,
    wait_through_cancels,
)
from policy import ContractRegistry, ToolContract
from schemas import (
    RESULTS_STREAM,
    WORK_STREAM,
    ErrorInfo,
    GenAI,
    LeaseReply,
    LeaseRequest,
    PullConsumer,
    ResultEnvelope,
    Subjects,
    TraceAttr,
    cancel_and_wait,
    context_from_headers,
    drop_undecodable_messages,
    inbox_prefix,
    trace_headers,
    tracer,
    work_consumer,
)

__all__ = ["ExecutorRunner", "RunnerOptions", "load_contract"]

_TOOL_CLOSE_S = 30.0
"""How long a tool's `close` may take when the executor stops (an MCP executor's closes
its sessions, each within 16 s: ledger.mcp.executor)."""

ConnectFn = Callable[..., Awaitable[Any]]
PullFn = Callable[[Any, str, str], PullConsumer]


def load_contract(contracts_dir: Path, name: str, version: str | None = None) -> ToolContract:
    """The contract `name@version` from an operator's contract directory.

    An executor pins the version it implements: with `version` given, that
    exact version or an error; without it, the newest one in the directory.
    """
    registry = ContractRegistry.from_directory(contracts_dir)
    versions = registry.versions(name)
    if not versions:
        raise ExecutorConfigError(f"no contract for tool {name!r} in {contracts_dir}")
    chosen = version or versions[-1]
    contract = registry.get(name, chosen)
    if contract is None:
        raise ExecutorConfigError(
            f"{name}@{chosen} is not in {contracts_dir} (have {', '.join(versions)})"
        )
    return contract


def _error_in(data: bytes) -> ErrorInfo | None:
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(document, dict) or not isinstance(document.get("error"), dict):
        return None
    try:
        return ErrorInfo.model_validate(document["error"])
    except ValidationError:
        return None


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """How an `ExecutorRunner` connects, pulls and publishes; `processing` is the rest.

    The processor's options (identity, secrets, redaction, heartbeat and
    retry timings) are not repeated here: `processing` carries them, and
    the runner uses its `executor`, `metrics`, `logger` and `retry_delay_s`.
    """

    processing: ProcessorOptions
    """The item processor's options; its `executor` is also the NATS client's name."""
    connect_options: Mapping[str, Any] = field(default_factory=dict)
    """Passed to `nats.connect` (servers, credentials, TLS); `inbox_prefix` defaults to the
    executor's private prefix and `name` to its identity."""
    batch_size: int = 1
    """Work items run at once (the tool must allow concurrent calls); at least 1."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port; None: no metrics server."""
    metrics_addr: str = "0.0.0.0"
    """The address the metrics server binds."""
    fetch_timeout_s: float = 5.0
    """How long one pull waits for work."""
    lease_timeout_s: float = 5.0
    """How long a lease request waits for the ledger's answer."""
    publish_timeout_s: float = 5.0
    """How long a result publish waits for its PubAck."""
    publish_attempts: int = 3
    """Tries per result publish before the item is nak'ed (at least 1)."""
    connect: ConnectFn = nats.connect
    """Opens the NATS connection (a fake in tests)."""
    pull: PullFn = PullConsumer
    """Makes the pull consumer (a fake in tests)."""


class ExecutorRunner:
    """Runs one tool's executor until `stop()`; its knobs are a `RunnerOptions`."""

    def __init__(self, tool: Tool, contract: ToolContract, options: RunnerOptions) -> None:
        if options.batch_size < 1:
            raise ExecutorConfigError("batch_size must be at least 1")
        processing = options.processing
        executor = processing.executor
        self.options = options
        self.tool = tool
        self.contract = contract
        self.executor = executor
        self.metrics = processing.metrics if processing.metrics is not None else ExecutorMetrics()
        self._log = processing.logger or logging.getLogger(f"opledger.executor.{contract.name}")
        # One metrics set and one logger for the loop and the processor.
        self.processor = ItemProcessor(
            tool, contract, replace(processing, metrics=self.metrics, logger=self._log)
        )
        connect = dict(options.connect_options)
        connect.setdefault("inbox_prefix", inbox_prefix("exec", contract.name))
        connect.setdefault("name", executor)
        # An executor outlives server restarts: keep reconnecting, and say so
        # in one line per event rather than the client's default tracebacks.
        connect.setdefault("max_reconnect_attempts", -1)
        connect.setdefault("error_cb", self._on_error)
        connect.setdefault("disconnected_cb", self._on_disconnected)
        connect.setdefault("reconnected_cb", self._on_reconnected)
        self._options = connect
        self._batch = options.batch_size
        self._metrics_port = options.metrics_port
        self._metrics_addr = options.metrics_addr
        self._fetch_timeout = options.fetch_timeout_s
        self._lease_timeout = options.lease_timeout_s
        self._publish_timeout = options.publish_timeout_s
        self._publish_attempts = max(options.publish_attempts, 1)
        self._retry_delay = processing.retry_delay_s
        self._clock = processing.clock
        self._connect = options.connect
        self._pull = options.pull
        self._consumer: PullConsumer | None = None
        self._stop = asyncio.Event()
        self._in_flight: set[asyncio.Task[ItemDisposition]] = set()
        self._abandoning: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()
        """Set once the loop is subscribed for work and pulls."""
        self._nc: Any = None
        self._js: Any = None

    @property
    def connect_options(self) -> dict[str, Any]:
        """The options passed to `nats.connect` (a copy)."""
        return dict(self._options)

    async def _on_error(self, error: Exception) -> None:
        self._log.warning("NATS: %s", error or type(error).__name__)

    async def _on_disconnected(self) -> None:
        self._log.warning("NATS: disconnected; reconnecting")

    async def _on_reconnected(self) -> None:
        self._log.info("NATS: reconnected")
        if self._consumer is not None:
            self._consumer.reset()  # the server dropped our open pull requests

    def stop(self) -> None:
        """Stop after the current item; delivered items not yet started go back at once.

        To abandon the current item too, cancel the task running `run()`: the
        item is left unacknowledged and redelivered after the consumer's
        ack wait, and the ledger decides (busy, then reconcile).
        """
        self._stop.set()
        if self._consumer is not None:
            self._consumer.interrupt()  # a waiting `take` returns now, not at its timeout

    def abandon(self) -> None:
        """Stop, and abandon the items in progress (a second SIGTERM).

        Each item's task is cancelled, again every half second until it has
        ended: its result is not published, or not acknowledged, so the item is
        redelivered after the consumer's ack wait and the ledger decides (busy
        while the lease holds, then a retry or a reconcile). The loop then ends
        as after `stop()`, and the connection is flushed and closed.

        Cancelling the task that runs `run()` would abandon them too, but only if
        the cancel reaches the loop: nats-py (on Python 3.11) drops a cancel that
        lands as one of its waits completes, and the items then ran on to their
        end (found in stop 37's review).
        """
        self.stop()
        if self._abandoning is not None or not self._in_flight:
            return
        self._log.warning(
            "abandoning %d item(s) in progress; they will be redelivered", len(self._in_flight)
        )
        self._abandoning = asyncio.get_running_loop().create_task(
            cancel_and_wait(*self._in_flight)
        )

    async def run(self) -> None:
        """Connect, start pulling from the tool's consumer and process work until `stop()`."""
        drop_undecodable_messages()  # one malformed message must not end the reading
        server = None
        if self._metrics_port is not None:
            server, _thread = start_http_server(
                self._metrics_port, addr=self._metrics_addr, registry=self.metrics.registry
            )
        try:
            self._nc = await self._connect(**self._options)
            try:
                self._js = self._nc.jetstream(timeout=self._publish_timeout)
                consumer = self._pull(self._nc, WORK_STREAM, work_consumer(self.contract.name))
                self._consumer = consumer
                await consumer.start()
                self.ready.set()
                self._log.info(
                    "executor %s runs %s@%s",
                    self.executor,
                    self.contract.name,
                    self.contract.version,
                )
                await self._loop(consumer)
            finally:
                await self._close()
        finally:
            try:
                # Also when the run was cancelled (a second signal): the items are over
                # either way, and what the tool holds (an MCP server process it started)
                # must not outlive the executor.
                await self._close_tool()
            finally:
                if server is not None:
                    server.shutdown()

    async def _close_tool(self) -> None:
        """Await the tool's `close` within `_TOOL_CLOSE_S`, in a task of its own that a
        cancel of the run arriving meanwhile (another signal) does not cut short: cut
        short, it would leave what it releases running (found in review: an MCP server
        process outlived its executor). The cancel is raised once the close is over."""
        close = self.tool.close
        if close is None:
            return
        closing = asyncio.ensure_future(close())
        cancelled = await wait_through_cancels(closing, _TOOL_CLOSE_S)
        if not closing.done():
            self._log.warning("the tool did not close within %.0f s", _TOOL_CLOSE_S)
            closing.cancel()
        elif not closing.cancelled() and (error := closing.exception()) is not None:
            # The executor stops all the same; say why the tool did not close.
            self._log.error("closing the tool failed", exc_info=error)
        if cancelled:
            raise asyncio.CancelledError

    async def _loop(self, consumer: PullConsumer) -> None:
        # Up to `batch_size` items in flight at once, pulling as slots free up.
        # Handling the items one after another would make each wait for the
        # previous one's lease round trip and result PubAck: one executor
        # would do at most 1 / (two round trips) items per second, whatever
        # the batch size.
        in_flight = self._in_flight
        try:
            while not self._stop.is_set():
                free = self._batch - len(in_flight)
                if free <= 0:
                    await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    messages = await consumer.take(free, timeout=self._fetch_timeout)
                except nats.errors.ConnectionClosedError:
                    self._log.error("NATS connection closed; executor stops")
                    return
                except Exception as exc:
                    # Reconnects and server restarts surface here; the client retries.
                    self._log.warning("pulling work failed: %s", type(exc).__name__)
                    await self._pause(1.0)
                    continue
                for index, msg in enumerate(messages):
                    # Also what keeps an item from starting after `abandon()`.
                    if self._stop.is_set():
                        # Nothing happened to these yet: let another executor have them now.
                        for rest in messages[index:]:
                            await self._settle(rest.nak(), "nak")
                        break
                    task = asyncio.get_running_loop().create_task(self.handle(msg))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                    task.add_done_callback(self._report_crash)
            # Stopping: items delivered but not started go back at once.
            for msg in await consumer.stop():
                await self._settle(msg.nak(), "nak")
        except asyncio.CancelledError:
            # Abandon the items in progress: unacknowledged, they are
            # redelivered after the ack wait and the ledger decides.
            for task in in_flight:
                task.cancel()
            raise
        finally:
            if in_flight:
                await asyncio.gather(*in_flight, return_exceptions=True)
            if self._abandoning is not None:
                await asyncio.wait({self._abandoning})  # ends once its items have

    def _report_crash(self, task: asyncio.Task[ItemDisposition]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # A bug in the processor (it turns tool failures into envelopes):
            # the item stays unacknowledged and is redelivered.
            self._log.error("handling a work item failed", exc_info=task.exception())

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()

    async def handle(self, msg: Any) -> ItemDisposition:
        """Process one JetStream message and settle it (ack, nak, term, publish then ack)."""
        # The work item's trace context (the operation's trace) is this span's parent:
        # the lease request, the tool's span and the result all continue it.
        with tracer().start_as_current_span(
            "opledger.work",
            context=context_from_headers(getattr(msg, "headers", None)),
            kind=SpanKind.CONSUMER,
            attributes={GenAI.TOOL_NAME: self.contract.name, TraceAttr.EXECUTOR: self.executor},
        ) as span:
            disposition = await self._handle(msg)
            span.set_attribute(TraceAttr.OUTCOME, disposition.reason)
        return disposition

    async def _handle(self, msg: Any) -> ItemDisposition:
        try:
            delivery = int(msg.metadata.num_delivered)
        except Exception:
            delivery = 1
        disposition = await self.processor.process(
            msg.data, lease=self._lease, heartbeat=msg.in_progress, delivery=delivery
        )
        if disposition.action is ItemAction.ACK:
            await self._settle(msg.ack(), "ack")
        elif disposition.action is ItemAction.NAK:
            await self._settle(msg.nak(delay=disposition.delay_s), "nak")
        elif disposition.action is ItemAction.TERM:
            await self._settle(msg.term(), "term")
        else:
            assert disposition.envelope is not None
            if await self._publish(disposition.envelope, msg, disposition.keep_until):
                await self._settle(msg.ack(), "ack")
            else:
                # No PubAck: the result may or may not be stored. Redelivery asks
                # the ledger again, which answers from what it actually recorded.
                await self._settle(msg.nak(delay=self._retry_delay), "nak")
        return disposition

    async def _settle(self, action: Awaitable[None], what: str) -> None:
        try:
            await action
        except Exception as exc:
            # A lost ack means a redelivery, and redeliveries converge.
            self._log.warning("%s failed: %s", what, type(exc).__name__)

    async def _lease(self, request: LeaseRequest) -> LeaseReply:
        reply = await self._nc.request(
            Subjects.lease(self.contract.name),
            request.model_dump_json().encode(),
            timeout=self._lease_timeout,
            headers=trace_headers(),
        )
        try:
            return LeaseReply.model_validate_json(reply.data)
        except ValidationError:
            # The ledger answers a request it cannot serve (an unknown operation,
            # a broken request) with `{"error": ErrorInfo, ...}` instead.
            error = _error_in(reply.data)
            if error is None:
                raise
            raise LeaseError(error) from None

    async def _publish(
        self, envelope: ResultEnvelope, msg: Any, keep_until: datetime | None = None
    ) -> bool:
        """Publish one result; True once JetStream stored it.

        At least `publish_attempts` tries, and beyond them until `keep_until`
        (the lease's expiry): a results stream electing a new leader refuses
        publishes for seconds, and giving up early would drop a result the
        tool already produced, leaving lease expiry and reconciliation to
        rediscover it (a read would spend an attempt). Between tries the work
        item is marked in progress, so it is not redelivered meanwhile.
        """
        payload = envelope.model_dump_json().encode()
        msg_id = result_msg_id(envelope, secrets.token_hex(8))
        # Same ID on every try: JetStream drops the copy if an earlier try was
        # stored but its PubAck was lost. The trace context: the ledger's record
        # of this result continues the operation's trace.
        headers = {**(trace_headers() or {}), "Nats-Msg-Id": msg_id}
        attempt = 0
        while True:
            attempt += 1
            try:
                ack = await self._js.publish(
                    Subjects.result(self.contract.name),
                    payload,
                    timeout=self._publish_timeout,
                    stream=RESULTS_STREAM,
                    headers=headers,
                )
            except Exception as exc:
                self._log.warning(
                    "publishing result %s failed (try %d): %s",
                    msg_id,
                    attempt,
                    type(exc).__name__,
                )
                pause = min(0.5 * 2 ** (attempt - 1), 2.0)
                more = attempt < self._publish_attempts or (
                    keep_until is not None
                    and self._clock() + timedelta(seconds=pause) < keep_until
                )
                if not more:
                    break
                await self._settle(msg.in_progress(), "in-progress")
                await asyncio.sleep(pause)
                continue
            if getattr(ack, "duplicate", False):
                self._log.info("result %s was already stored", msg_id)
            if attempt > 1:
                self._log.info("result %s stored on try %d", msg_id, attempt)
            return True
        self.metrics.retries.labels(reason="publish_failed").inc()
        return False

    async def _close(self) -> None:
        nc, self._nc = self._nc, None
        if nc is None:
            return
        # Acks are buffered publishes: flush them before closing. The work
        # inbox was drained already, when the loop stopped.
        with contextlib.suppress(Exception):
            await nc.flush(timeout=2)
        with contextlib.suppress(Exception):
            await nc.close()
