"""Request/reply subjects served with plain nats-py subscriptions, many at a time.

Why not FastStream subscribers: per request FastStream runs its middleware and
dependency machinery, hops to worker threads for its synchronous steps and
logs two lines. Measured with `bench/e2e_bench.py` on this project's 2-core
machine, the whole stack reached 223 operations/s with FastStream handlers
(64 at a time) and 667 with these subscriptions, everything else equal. The
ledger's own work per operation is what the CPU is for. Measured again for
issue 12 without the ledger (FastStream 0.7.8, a status request parsed and
answered, 64 in flight, one local nats-server): 8.0-8.4k requests/s through
a FastStream subscriber with its per-message log lines off (4.3-5.0k with
them on), 21.9-24.9k through a plain subscription: still about 3 to 1.

Why many at a time: a nats-py subscription calls its callback for one message
after another. A handler waits for the ledger's next batch, so serving one
request at a time would make every batch hold one request. Each request runs
in its own task instead, up to `limit` at once.

Why per requester: the requests of all hosts (and, on `ops.lease.*`, of all
tools) share one subscription. Served in arrival order, one host sending
thousands at once put every other host's requests behind its own: they
timed out. So the callback never waits: it queues each request under its
subject (one requester: `ops.propose.h1`, `ops.lease.search_documents`), and
requests are started in turn, one requester after another, with at most
`per_requester` of one requester in progress. A requester with more than
`waiting_per_requester` requests (or `max_waiting_bytes`) already waiting is
answered `LEDGER_BUSY` at once, retryable: its sender alone is slowed down.
Memory is bounded in bytes as well as in number: what is in progress by
`max_bytes`, what waits by the per-requester limits.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import context as otel_context

from ledger.nats.security import reply_allowed
from schemas import ErrorCategory, ErrorEnvelope, ErrorInfo, context_from_headers

__all__ = ["ErrorReply", "Handler", "RequestServer", "error_envelope"]

_log = logging.getLogger(__name__)

_HEADER_ROOM = 512
_TOO_LARGE = ErrorInfo(
    code="REPLY_TOO_LARGE",
    category=ErrorCategory.INTERNAL,
    message="the answer is larger than a message may be",
)
_BUSY = ErrorInfo(
    code="LEDGER_BUSY",
    category=ErrorCategory.TRANSIENT,
    message="too many of this requester's requests are waiting: retry shortly",
    retryable=True,
    retry_after_ms=200,
)

Handler = Callable[[bytes, str], Awaitable[bytes]]
"""Serves one request: (payload, last subject token) → reply payload. Never raises on bad input."""

ErrorReply = Callable[[ErrorInfo], bytes]
"""How a subject's requests are refused: the error as that subject's reply payload."""


def error_envelope(error: ErrorInfo) -> bytes:
    """`error` in the common error envelope (`schemas.ErrorEnvelope`): how status and lease
    requests, and any request by default, are refused."""
    return ErrorEnvelope(error=error).model_dump_json().encode()


@dataclass(frozen=True, slots=True)
class _Route:
    """One served subject: its handler and its two refusals, encoded once."""

    handler: Handler
    busy: bytes
    too_large: bytes


class RequestServer:
    """Serves request subjects in a queue group, answering only inside the requester's inbox,
    fairly across requesters (see the module docstring)."""

    def __init__(
        self,
        nc: Client,
        *,
        queue: str,
        limit: int = 512,
        max_bytes: int = 64 * 1024 * 1024,
        per_requester: int = 128,
        waiting_per_requester: int = 256,
        max_waiting_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self._nc = nc
        self._queue = queue
        self._limit = limit
        self._max_bytes = max_bytes
        self._per_requester = per_requester
        self._waiting_limit = waiting_per_requester
        self._max_waiting_bytes = max_waiting_bytes
        # Requesters with requests waiting, in the order their turn comes.
        self._waiting: OrderedDict[str, _Waiting] = OrderedDict()
        self._active: dict[str, int] = {}
        self._started = 0  # requests in progress
        self._bytes = 0  # their payload bytes
        self._running: set[asyncio.Task[None]] = set()
        self._subscriptions: list[Subscription] = []

    async def serve(
        self, subject: str, handler: Handler, *, error_reply: ErrorReply = error_envelope
    ) -> None:
        """Subscribe `subject` (a wildcard ending in `*`) and answer with `handler`;
        `error_reply` shapes the refusals the server itself makes (busy, too large)."""
        route = _Route(handler, error_reply(_BUSY), error_reply(_TOO_LARGE))

        async def callback(message: Msg) -> None:
            self._arrived(message, route)

        self._subscriptions.append(
            await self._nc.subscribe(subject, queue=self._queue, cb=callback)
        )

    def _arrived(self, message: Msg, route: _Route) -> None:
        if not reply_allowed(message.subject, message.reply):
            # The server does not check reply subjects: answering anywhere
            # else would let one client make the ledger publish for it.
            _log.warning(
                "not answering %s at %r: outside the requester's inbox",
                message.subject,
                message.reply,
            )
            return
        requester = message.subject
        size = len(message.data)
        if (
            not self._waiting
            and self._started < self._limit
            and self._active.get(requester, 0) < self._per_requester
            and (not self._bytes or self._bytes + size <= self._max_bytes)
        ):
            self._start(requester, message, route)  # nobody waits: no queue, no turn
            return
        waiting = self._waiting.get(requester)
        if waiting is None:
            waiting = self._waiting[requester] = _Waiting()
        if len(waiting.items) >= self._waiting_limit or (
            waiting.items and waiting.bytes + size > self._max_waiting_bytes
        ):
            self._busy(message, route)
            return
        waiting.items.append((message, route))
        waiting.bytes += size
        self._admit()

    def _busy(self, message: Msg, route: _Route) -> None:
        task = asyncio.get_running_loop().create_task(self._reply(message, route.busy))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _admit(self) -> None:
        """Start waiting requests, one requester after another, while there is room."""
        blocked: set[str] = set()
        while self._started < self._limit and len(blocked) < len(self._waiting):
            for requester in list(self._waiting):
                if self._started >= self._limit:
                    return
                waiting = self._waiting[requester]
                message, route = waiting.items[0]
                size = len(message.data)
                if self._active.get(requester, 0) >= self._per_requester or (
                    self._bytes and self._bytes + size > self._max_bytes
                ):
                    blocked.add(requester)
                    continue
                waiting.items.popleft()
                waiting.bytes -= size
                if waiting.items:
                    self._waiting.move_to_end(requester)  # its next turn after the others'
                else:
                    del self._waiting[requester]
                    blocked.discard(requester)
                self._start(requester, message, route)

    def _start(self, requester: str, message: Msg, route: _Route) -> None:
        self._active[requester] = self._active.get(requester, 0) + 1
        self._started += 1
        self._bytes += len(message.data)
        task = asyncio.get_running_loop().create_task(self._answer(requester, message, route))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _answer(self, requester: str, message: Msg, route: _Route) -> None:
        # The requester's trace context (a `traceparent` header), if it sent one, is
        # current while the handler runs: its spans continue the requester's trace.
        traced = otel_context.attach(context_from_headers(message.headers))
        try:
            token = message.subject.rsplit(".", 1)[-1]
            payload = await route.handler(message.data, token)
            if len(payload) > self._nc.max_payload - _HEADER_ROOM:
                # An answer no message can carry (a huge kept result): the
                # requester gets a structured error, not a timeout.
                _log.warning("answer on %s: %d bytes, sent an error", message.subject, len(payload))
                payload = route.too_large
            await self._nc.publish(message.reply, payload)
        except Exception:
            # A bug, not bad input (handlers answer bad input themselves): log
            # it here, since the requester only sees its own timeout.
            _log.exception("request on %s failed", message.subject)
        finally:
            otel_context.detach(traced)
            self._started -= 1
            self._bytes -= len(message.data)
            left = self._active[requester] - 1
            if left:
                self._active[requester] = left
            else:
                del self._active[requester]
            if self._waiting:
                self._admit()

    async def _reply(self, message: Msg, payload: bytes) -> None:
        try:
            await self._nc.publish(message.reply, payload)
        except Exception as exc:  # a closed connection: the requester retries
            _log.debug("reply on %s failed: %s", message.subject, type(exc).__name__)

    async def stop(self) -> None:
        """Stop taking requests and let the ones in progress finish."""
        for subscription in self._subscriptions:
            try:
                await subscription.unsubscribe()
            except Exception as exc:  # a closed connection: nothing left to stop
                _log.debug("unsubscribe failed: %s", type(exc).__name__)
        self._subscriptions.clear()
        self._waiting.clear()  # never started: their requesters time out and retry
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    @property
    def in_progress(self) -> int:
        """Requests being served right now."""
        return self._started


@dataclass(slots=True)
class _Waiting:
    """One requester's requests not yet started, oldest first, and their bytes."""

    items: deque[tuple[Msg, _Route]] = field(default_factory=deque)
    bytes: int = 0
