"""Request/reply subjects served with plain nats-py subscriptions, many at a time.

Why not FastStream subscribers: per request FastStream runs its middleware and
dependency machinery, hops to worker threads for its synchronous steps and
logs two lines. Measured with `bench/e2e_bench.py` on this project's 2-core
machine, the whole stack reached 223 operations/s with FastStream handlers
(64 at a time) and 667 with these subscriptions, everything else equal. The
ledger's own work per operation is what the CPU is for.

Why many at a time: a nats-py subscription calls its callback for one message
after another. A handler waits for the ledger's next batch, so serving one
request at a time would make every batch hold one request. Each request runs
in its own task instead, up to `limit` at once; beyond that the callback
waits, and the subscription's pending buffer queues the rest (back-pressure,
not loss of answered work: an unanswered request is the requester's timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ledger.nats.security import reply_allowed
from schemas import ErrorCategory, ErrorInfo, ProposeReply

__all__ = ["Handler", "RequestServer"]

_log = logging.getLogger(__name__)

_HEADER_ROOM = 512
_TOO_LARGE = (
    ProposeReply(
        error=ErrorInfo(
            code="REPLY_TOO_LARGE",
            category=ErrorCategory.INTERNAL,
            message="the answer is larger than a message may be",
        )
    )
    .model_dump_json()
    .encode()
)

Handler = Callable[[bytes, str], Awaitable[bytes]]
"""Serves one request: (payload, last subject token) → reply payload. Never raises on bad input."""


class RequestServer:
    """Serves request subjects in a queue group, answering only inside the requester's inbox."""

    def __init__(
        self, nc: Client, *, queue: str, limit: int = 512, max_bytes: int = 64 * 1024 * 1024
    ) -> None:
        self._nc = nc
        self._queue = queue
        self._slots = asyncio.Semaphore(limit)
        # Requests in progress are bounded in bytes as well as in number: 512
        # proposals of 1 MiB would be half a gigabyte. Past the budget the
        # callback waits, and the subscription's own pending limits hold (or,
        # past those, drop) the rest: the requesters time out and retry.
        self._max_bytes = max_bytes
        self._bytes = 0
        self._freed = asyncio.Condition()
        self._running: set[asyncio.Task[None]] = set()
        self._subscriptions: list[Subscription] = []

    async def serve(self, subject: str, handler: Handler) -> None:
        """Subscribe `subject` (a wildcard ending in `*`) and answer with `handler`."""

        async def callback(message: Msg) -> None:
            size = len(message.data)
            await self._slots.acquire()
            if self._bytes and self._bytes + size > self._max_bytes:
                async with self._freed:
                    await self._freed.wait_for(
                        lambda: not self._bytes or self._bytes + size <= self._max_bytes
                    )
            self._bytes += size
            task = asyncio.get_running_loop().create_task(self._answer(message, handler))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

        self._subscriptions.append(
            await self._nc.subscribe(
                subject,
                queue=self._queue,
                cb=callback,
                pending_bytes_limit=self._max_bytes,
            )
        )

    async def _answer(self, message: Msg, handler: Handler) -> None:
        try:
            if not reply_allowed(message.subject, message.reply):
                # The server does not check reply subjects: answering anywhere
                # else would let one client make the ledger publish for it.
                _log.warning(
                    "not answering %s at %r: outside the requester's inbox",
                    message.subject,
                    message.reply,
                )
                return
            token = message.subject.rsplit(".", 1)[-1]
            payload = await handler(message.data, token)
            if len(payload) > self._nc.max_payload - _HEADER_ROOM:
                # An answer no message can carry (a huge kept result): the
                # requester gets a structured error, not a timeout.
                _log.warning("answer on %s: %d bytes, sent an error", message.subject, len(payload))
                payload = _TOO_LARGE
            await self._nc.publish(message.reply, payload)
        except Exception:
            # A bug, not bad input (handlers answer bad input themselves): log
            # it here, since the requester only sees its own timeout.
            _log.exception("request on %s failed", message.subject)
        finally:
            self._slots.release()
            self._bytes -= len(message.data)
            async with self._freed:
                self._freed.notify_all()

    async def stop(self) -> None:
        """Stop taking requests and let the ones in progress finish."""
        for subscription in self._subscriptions:
            try:
                await subscription.unsubscribe()
            except Exception as exc:  # a closed connection: nothing left to stop
                _log.debug("unsubscribe failed: %s", type(exc).__name__)
        self._subscriptions.clear()
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    @property
    def in_progress(self) -> int:
        """Requests being served right now."""
        return len(self._running)
