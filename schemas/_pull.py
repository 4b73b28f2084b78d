"""`PullConsumer`: messages of one durable JetStream pull consumer, pulled continuously.

nats-py offers `fetch()`: each call sends a pull request, and when nothing is
waiting it sends a `no_wait` probe first, receives a `404`, then sends a
long-poll request. At a low rate that is three or four messages and as many
wake-ups of the process per item fetched, in the client and in nats-server.
On a small machine those wake-ups, not the work, filled the CPU.

This is the loop other NATS clients call "consume": pull requests stay open
on the server (`expires`, with idle heartbeats), and a new one is sent only
when the credit still open falls to half of what the caller can take. Items
then arrive as they are stored, one message each. The wire protocol is the
documented one (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>` with a reply
inbox), so a process needs no permission beyond what `fetch()` needed.

Credit is never more than the caller said it can take, so items do not wait
in this process while their ack wait runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import orjson

__all__ = ["PullConsumer"]

_log = logging.getLogger(__name__)

_STATUS = "Status"
_PENDING = "Nats-Pending-Messages"
_REFUSED_PAUSE_S = 1.0
# The 409s that end a pull request with `max_bytes` normally (nats-server consumer.go).
_ENDED = frozenset({"Message Size Exceeds MaxBytes", "Batch Completed"})


class PullConsumer:
    """Continuous pulls from one durable pull consumer over one private inbox.

    `take(capacity)` returns what has arrived (at most `capacity` messages),
    waiting for the first one; the caller acks, naks or terms each message as
    with `fetch()`. `capacity` is how many more the caller can handle now:
    open credit plus messages held here never exceed it.

    A pull request the server forgot (a restart, a reconnect, a deleted and
    recreated consumer) shows as missing heartbeats; its credit is dropped
    and asked for again.
    """

    def __init__(
        self,
        nc: Any,
        stream: str,
        consumer: str,
        *,
        expires_s: float = 30.0,
        heartbeat_s: float = 5.0,
        max_bytes: int | None = None,
    ) -> None:
        self._nc = nc
        # Bytes per pull request, so that what is held here is bounded in bytes,
        # not only in messages: 256 results of 1 MiB each would be 256 MiB. Must
        # exceed the largest message, or that message could never be delivered.
        self._max_bytes = max_bytes
        self._subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._name = f"{stream}/{consumer}"
        self._expires_ns = int(expires_s * 1e9)
        self._heartbeat_ns = int(heartbeat_s * 1e9)
        self._heartbeat_s = heartbeat_s
        self._inbox = ""
        self._sub: Any = None
        self._held: deque[Any] = deque()
        self._credit = 0  # messages asked for and not yet delivered (nor expired)
        self._capacity = 0  # what the caller could take, as of its last `take`
        self._heard_at = time.monotonic()
        self._refused_at = float("-inf")
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    async def start(self) -> None:
        """Subscribe the private reply inbox (no pull request is sent yet)."""
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_message)

    @property
    def held(self) -> int:
        """Messages delivered and not yet taken."""
        return len(self._held)

    @property
    def credit(self) -> int:
        """Messages asked for and not yet delivered."""
        return self._credit

    async def take(self, capacity: int, timeout: float | None = None) -> list[Any]:
        """Up to `capacity` delivered messages; waits at most `timeout` s for the first.

        An empty list means the wait ran out (or the consumer was closed).
        """
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        if not self._held and not self._closed:
            self._check_heartbeats()
            await self._ask()
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = None if timeout is None else loop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        taken = [self._held.popleft() for _ in range(min(capacity, len(self._held)))]
        # What the caller can still take is less by what it just took; asking
        # for `capacity` again would deliver more than it can handle.
        self._capacity = capacity - len(taken)
        if self._capacity and not self._closed:
            await self._ask()
        return taken

    def interrupt(self) -> None:
        """Make a waiting `take` return what it has now (possibly nothing)."""
        if self._waiter is not None:
            _wake(self._waiter)

    def reset(self) -> None:
        """Forget open credit: after a reconnect, the server dropped our pull requests.

        A waiting `take` returns (empty), so that its caller's next `take` asks
        again at once rather than after the missed heartbeats show.
        """
        self._credit = 0
        self.interrupt()

    async def stop(self) -> list[Any]:
        """Stop pulling; the messages delivered and not taken (nak them to hand them on).

        The inbox is drained: the server stops delivering to it, and what it
        sent before that is collected here rather than dropped, so no item
        waits out its ack wait because this process went away.
        """
        self._closed = True
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.drain()
        self.interrupt()
        held = list(self._held)
        self._held.clear()
        return held

    # --------------------------------------------------------------- internals

    async def _ask(self) -> None:
        want = self._capacity - len(self._held) - self._credit
        # Top up only once half the caller's capacity is missing: at a steady
        # low rate that is one pull request per several items, not one each.
        if want <= 0 or (self._credit and want < max(1, self._capacity // 2)):
            return
        if time.monotonic() - self._refused_at < _REFUSED_PAUSE_S:
            return  # the server just refused a pull: the caller's next `take` asks again
        request = {
            "batch": want,
            "expires": self._expires_ns,
            "idle_heartbeat": self._heartbeat_ns,
        }
        if self._max_bytes is not None:
            request["max_bytes"] = self._max_bytes
        self._credit += want
        await self._nc.publish(self._subject, orjson.dumps(request), reply=self._inbox)

    def _check_heartbeats(self) -> None:
        silent = time.monotonic() - self._heard_at
        if self._credit and silent > 2 * self._heartbeat_s + 1:
            _log.info("%s: no heartbeat for %.0f s; pulling again", self._name, silent)
            self._credit = 0
            self._heard_at = time.monotonic()

    async def _on_message(self, msg: Any) -> None:
        self._heard_at = time.monotonic()
        headers = msg.headers
        status = headers.get(_STATUS) if headers else None
        if status is None:
            self._credit = max(self._credit - 1, 0)
            self._held.append(msg)
            if self._waiter is not None:
                _wake(self._waiter)
            return
        if status == "100":  # idle heartbeat: the pull requests are alive
            return
        if status in ("408", "409"):
            # An expired or ended pull request says how much of its credit was
            # left unused; without that count, assume all credit is gone.
            pending = headers.get(_PENDING)
            self._credit = max(self._credit - int(pending), 0) if pending else 0
            if status == "409" and headers.get("Description", "") in _ENDED:
                # A request with `max_bytes` that ended (its bytes used up, or its
                # batch delivered with bytes to spare): not a refusal.
                if self._waiter is not None and not self._closed:
                    await self._ask()
                return
            if status == "409":
                # Refused or ended by the server (too many waiting pulls, a
                # deleted consumer, a leader change): the waiting `take`
                # returns empty, and asking again waits a moment.
                _log.warning("%s: %s", self._name, headers.get("Description", "409"))
                self._refused_at = time.monotonic()
                self.interrupt()
            elif self._waiter is not None and not self._closed:
                await self._ask()  # an expired pull: renew it for the waiting `take`
            return
        _log.debug("%s: status %s ignored", self._name, status)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
