"""The JetStream side of the relay: publish a batch in order, and prove it was stored.

Work items are acknowledged one by one. Feed events, most of the messages,
are not: the relay is the feed stream's only writer, so it knows the sequence
number each event must get, and one acknowledged event now and then
(`_CONFIRM_EVERY_S`) proves that every event before it was stored. A
mismatch means something was lost: the relay goes back to the last proven
position and publishes again with an acknowledgement each. A PubAck per event
was measured at 0.3-0.5 ms of the service's CPU per operation, and a wake-up
of the process for most batches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

from nats.aio.client import Client
from nats.errors import BadSubjectError, MaxPayloadError
from nats.js import JetStreamContext
from nats.js.errors import APIError

from ledger.adapters.event_tables import StoredRow
from ledger.server.relay.messages import RelayMessage
from schemas import ErrorCategory, OpledgerError

__all__ = ["Proof", "RelayPublisher", "SetAside", "SetAsideFn"]

_log = logging.getLogger(__name__)

_CONFIRM_EVERY_S = 0.05  # how often a feed event is published with a PubAck that proves the rest
_NEVER_STORED = frozenset({10054})  # JetStream: "message size exceeds maximum allowed"
_HEADER_ROOM = 512  # the server counts headers against max_payload; nats-py counts data only

SetAsideFn = Callable[[StoredRow, str], Awaitable[None]]
"""Sets the event at a stored row aside, with the reason (the relay's, on its ledger)."""


class SetAside(OpledgerError):
    """Messages of this batch cannot be published; they were set aside: read it again.

    Raised by `RelayPublisher` to its relay, never past it: the relay reads the
    batch again without the events it set aside.
    """

    category = ErrorCategory.INTERNAL
    code = "RELAY_SET_ASIDE"


class Proof(Enum):
    """What a publish proved about the batch (and everything before it)."""

    STORED = "stored"
    """Every feed event up to the batch's end is known stored."""
    NO_FEED = "no_feed"
    """The batch had no feed event; its other messages were acknowledged."""
    PENDING = "pending"
    """Sent; the next proof will tell."""
    LOST = "lost"
    """Something sent without a PubAck was not stored: publish again from the last proof."""


class RelayPublisher:
    """Publishes the relay's batches to JetStream and proves the feed stored (module doc)."""

    def __init__(self, nc: Client, *, ack_timeout: float, set_aside: SetAsideFn) -> None:
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream()
        self._ack_timeout = ack_timeout
        self._set_aside = set_aside
        # The feed sequence number the next feed event will get, once known;
        # None: publish with a PubAck each until it is known again.
        self._feed_next: int | None = None
        self._last_feed: RelayMessage | None = None
        self._confirmed_at = 0.0

    def payload_limit(self) -> int:
        """The largest payload a message may have (the server's limit, less its headers)."""
        return max(int(self._nc.max_payload) - _HEADER_ROOM, 0)

    def forget_sequence(self) -> None:
        """Another relay may have written since: learn the feed's sequence again."""
        self._feed_next = None

    def confirm_due(self) -> bool:
        """Whether it is time for a PubAck that proves the events sent without one."""
        return asyncio.get_running_loop().time() - self._confirmed_at >= _CONFIRM_EVERY_S

    async def publish(self, messages: list[RelayMessage]) -> Proof:
        """Publish one batch in order; what it proved.

        Stored messages go out with `publish_async` (no task, inbox or timer
        per message; one subscription collects the PubAcks), all in flight at
        once; any failure raises, so the batch goes out again (deduplicated by
        message ID). Feed events carry no reply subject, except the batch's
        last when a proof is due (or while the feed's sequence is unknown:
        then each). Outcome notices go out with the rest, not after the
        PubAcks: the outcome is committed in the ledger already, and a host
        waits for it.
        """
        feed = [message for message in messages if message.feed]
        known = self._feed_next is not None
        prove = bool(feed) and known and self.confirm_due()
        proof = feed[-1] if prove else None
        acks: list[asyncio.Future[Any]] = []
        acked: list[RelayMessage] = []
        feed_acks: list[asyncio.Future[Any]] = []
        try:
            for message in messages:
                headers = dict(message.headers or {})
                if message.message_id:
                    headers["Nats-Msg-Id"] = message.message_id
                try:
                    if message.message_id is None or (
                        message.feed and known and message is not proof
                    ):
                        await self._nc.publish(
                            message.subject, message.payload, headers=headers or None
                        )
                        continue
                    ack = await self._js.publish_async(
                        message.subject, message.payload, headers=headers or None
                    )
                except (BadSubjectError, MaxPayloadError) as exc:
                    # Checked for when the batch was read, so only a server with
                    # other limits can get here (a reconnect to another node).
                    await self._unpublishable(message, exc)
                    raise SetAside("a message of this batch was set aside") from exc
                acks.append(ack)
                acked.append(message)
                if message.feed:
                    feed_acks.append(ack)
            if acks:
                # `asyncio.timeout`, not `wait_for`: on Python 3.11 `wait_for` drops a
                # cancel that arrives with the PubAcks, and the relay would not stop.
                async with asyncio.timeout(self._ack_timeout):
                    outcomes = await asyncio.gather(*acks, return_exceptions=True)
                await self._refused(acked, outcomes)
        except BaseException:
            for ack in acks:
                ack.cancel()  # frees its slot among the pending publishes
            raise
        if not feed:
            return Proof.NO_FEED
        self._last_feed = feed[-1]
        last = feed_acks[-1].result() if feed_acks else None
        if not known:
            # Each feed event was acknowledged: all stored. The last one's
            # sequence tells the next, unless it was a copy of an older one.
            assert last is not None
            self._feed_next = None if last.duplicate else last.seq + 1
            return self._proven()
        if proof is not None:
            assert self._feed_next is not None and last is not None
            return self._check(last, self._feed_next + len(feed) - 1)
        assert self._feed_next is not None
        self._feed_next += len(feed)
        return Proof.PENDING

    async def confirm_last(self) -> Proof:
        """Prove the feed events sent since the last proof by asking about the last one.

        Sent again with its message ID, a stored event comes back as a
        duplicate with the sequence it was stored at. PENDING: nothing to prove.
        """
        last = self._last_feed
        if last is None or self._feed_next is None:
            return Proof.PENDING
        ack = await self._js.publish(
            last.subject,
            last.payload,
            timeout=self._ack_timeout,
            headers={"Nats-Msg-Id": last.message_id} if last.message_id else None,
        )
        return self._check(ack, self._feed_next - 1, copy=True)

    async def _refused(self, messages: list[RelayMessage], outcomes: list[Any]) -> None:
        """Raise for a failed PubAck; set aside a message JetStream will never take."""
        refused = False
        for message, outcome in zip(messages, outcomes, strict=True):
            if not isinstance(outcome, BaseException):
                continue
            if isinstance(outcome, APIError) and outcome.err_code in _NEVER_STORED:
                await self._unpublishable(message, outcome)
                refused = True
                continue
            raise outcome
        if refused:
            raise SetAside("a message of this batch was set aside")

    async def _unpublishable(self, message: RelayMessage, cause: Exception) -> None:
        if message.row is None:
            # A work item or a notice: small and well-formed by construction;
            # failing here is a fault to retry, not a message to give up on.
            raise cause
        await self._set_aside(message.row, f"{type(cause).__name__}: {cause}")

    def _check(self, ack: Any, expected: int, *, copy: bool = False) -> Proof:
        """STORED if `ack` shows the sequence `expected`; else LOST (publish again)."""
        if ack.seq == expected and bool(ack.duplicate) == copy:
            self._feed_next = expected + 1
            return self._proven()
        # A feed event sent without a PubAck was not stored (or was a copy of
        # one stored before): publish again, with a PubAck each, from the
        # last proven position. JetStream drops what it already has.
        _log.warning("feed sequence %s where %s was expected; publishing again", ack.seq, expected)
        self._feed_next = None
        return Proof.LOST

    def _proven(self) -> Proof:
        self._confirmed_at = asyncio.get_running_loop().time()
        return Proof.STORED
