"""Read the feed stream by sequence, from the first event on, as an auditor: `read_feed`.

The auditor's durable consumer (`feed_auditor`) moves forward only: what it
acknowledged it never sees again. To compare the whole feed with the event
store, an auditor reads `OPS_FEED` by sequence instead, with batched direct
gets (the stream has `allow_direct`; the auditor may publish exactly
`$JS.API.DIRECT.GET.OPS_FEED` for it). The last sequence comes from a direct
get too (`{"last_by_subj": "ops.feed.>"}`: the last message stored).

How the server answers a batched direct get (nats-server `stream.go`,
`getDirectRequest`), for a request `{"seq": N, "batch": K}`:

- up to K messages, the first stored at or after sequence N, then each next
  one, stepping over deleted sequences. Each carries the headers it was
  published with (the relay's `Nats-Msg-Id` among them), plus `Nats-Stream`,
  `Nats-Subject` (where it was published), `Nats-Sequence`,
  `Nats-Time-Stamp`, `Nats-Num-Pending` (messages after it) and
  `Nats-Last-Sequence` (the sequence of the message before it in this batch,
  0 for the first). A batch also ends early once it reaches the server's
  `max_pending` bytes;
- then a status message `NATS/1.0 204 EOB` with `Nats-Num-Pending` and
  `Nats-Last-Sequence` (the last sequence sent);
- or, if nothing is stored at or after N, only `NATS/1.0 404 Message Not Found`.

Those `Nats-Last-Sequence` headers chain the batch together, so a message lost
on the way (a slow consumer drop) is detected instead of silently skipped.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ledger.nats.client import flush_all
from ledger.nats.errors import FeedAccessDenied, FeedReadError, FeedReadTimeout
from schemas import FEED_STREAM, Subjects

__all__ = ["MAX_BATCH", "FeedMessage", "read_feed"]

MAX_BATCH = 4096
"""The largest `batch` `read_feed` accepts: it bounds how many messages are held at once."""

_DIRECT_GET = f"$JS.API.DIRECT.GET.{FEED_STREAM}"
_FEED_SUBJECTS = Subjects.all_feed()  # the stream's subjects (`topology.stream_configs`)
# Header names of direct get answers (nats-server stream.go).
_STATUS = "Status"
_DESCRIPTION = "Description"
_SEQUENCE = "Nats-Sequence"
_SUBJECT = "Nats-Subject"
_MSG_ID = "Nats-Msg-Id"
_LAST_SEQUENCE = "Nats-Last-Sequence"
_END_OF_BATCH = "204"
_NOTHING_LEFT = "404"
_NO_RESPONDERS = "503"


@dataclass(frozen=True)
class FeedMessage:
    """One message of `OPS_FEED`, as stored.

    `subject` is where the relay published it (`ops.feed.<tool>.<event type>`),
    `msg_id` its `Nats-Msg-Id` header (the relay writes `<operation_id>:<version>`;
    None if it had none), `data` the body (the relay's JSON `FeedEvent`).
    """

    seq: int
    subject: str
    msg_id: str | None
    data: bytes


async def read_feed(
    nc: Client,
    *,
    start_seq: int = 1,
    batch: int = 256,
    timeout: float = 5.0,
) -> AsyncIterator[FeedMessage]:
    """Every message of `OPS_FEED` from `start_seq` to the stream's last sequence, in order.

    The last sequence is that of the last message stored when iteration
    starts (read once, then): messages stored later are not returned (call
    again with `start_seq` one past the last `seq` seen to read them).
    Deleted sequences are skipped, so `seq` can jump. One batch of at most
    `batch` messages is requested at a time, and the next only once it is
    consumed, so memory stays bounded by `batch` messages whatever the length
    of the feed.

    `nc` must be connected as an auditor (`connect_as(url, credentials.auditor())`):
    the reply inbox is the connection's own (its private inbox prefix).
    `timeout` bounds every single wait for the server (the last message, each
    message of a batch, each flush); the whole read takes as long as the feed
    needs.

    On a replicated stream any replica may answer a direct get, and a follower
    can lag a little behind the leader: the read may then end a few messages
    short of the leader's last one. Replicas apply in order, so what is
    returned is still every stored message up to where it ends; a caller that
    compares the feed with the event store treats a short tail like events
    the relay has not published yet.

    Raises `ValueError` for bad arguments, and `FeedReadError`s:
    `FeedAccessDenied` if the server refuses a publish or subscription of the
    read (not an auditor, or an old server config), `FeedReadTimeout` if the
    server does not answer within `timeout`, `FeedReadError` itself if the
    stream is missing or does not allow direct gets (no responders), or an
    answer is an error, malformed or out of order.

    Leave the `async for` early only through `contextlib.aclosing(read_feed(...))`
    (or `aclose()`), so the reply subscription is removed at once.
    """
    if start_seq < 1:
        raise ValueError(f"start_seq must be at least 1, not {start_seq}")
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be between 1 and {MAX_BATCH}, not {batch}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, not {timeout}")
    reader = _Reader(nc, timeout)
    try:
        # Batch messages plus the end-of-batch status: everything one request can
        # bring. More would be a drop, which the sequence chain then reports.
        await reader.open(pending_msgs_limit=batch + 1)
        last = await reader.last_sequence()
        next_seq = start_seq
        while next_seq <= last:
            want = min(batch, last - next_seq + 1)
            # Nothing in the batch (all deleted from next_seq on) ends the read too.
            done = True
            async for message in reader.batch(next_seq, want):
                if message.seq > last:
                    # Stored after the call, reached past a gap: not ours to return.
                    done = True
                    continue
                done = message.seq == last
                next_seq = message.seq + 1
                yield message
            if done:
                return
    finally:
        await reader.close()


class _Reader:
    """One read: a reply subscription and the checks around each request."""

    def __init__(self, nc: Client, timeout: float) -> None:
        self.nc = nc
        self.timeout = timeout
        self.inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._error_before: Exception | None = None

    async def open(self, *, pending_msgs_limit: int) -> None:
        self._error_before = self.nc.last_error
        try:
            self._sub = await self.nc.subscribe(self.inbox, pending_msgs_limit=pending_msgs_limit)
        except nats.errors.ConnectionClosedError as exc:
            raise FeedReadError("the NATS connection is closed") from exc
        await self._flush_and_check("subscription to", self.inbox)

    async def close(self) -> None:
        if self._sub is not None and not self.nc.is_closed:
            # Best effort: a closed or reconnecting connection cleans up on its own.
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
        self._sub = None

    async def last_sequence(self) -> int:
        """The sequence of the last message stored now; 0 if the stream holds none.

        A direct get of the last message on any feed subject (`last_by_subj`
        with the stream's own wildcard: the last *stored* one, even if later
        sequences were deleted). Not `$JS.API.STREAM.INFO`: through a service
        import the JetStream API answers for the requester's account, and the
        auditors' has no JetStream.
        """
        request = json.dumps({"last_by_subj": _FEED_SUBJECTS}).encode()
        await self._send(_DIRECT_GET, request)
        msg = await self._next(f"answer to a direct get of the last message of {FEED_STREAM}")
        headers = msg.headers or {}
        if headers.get(_STATUS) == _NOTHING_LEFT:
            return 0
        self._raise_for_status(msg, _DIRECT_GET)
        return _header_int(headers, _SEQUENCE)

    async def batch(self, start_seq: int, count: int) -> AsyncIterator[FeedMessage]:
        """The messages of one batched direct get, checked against their sequence chain."""
        request = json.dumps({"seq": start_seq, "batch": count}).encode()
        await self._send(_DIRECT_GET, request)
        previous = 0
        received = 0
        while True:
            msg = await self._next(f"message {received + 1} of a direct get from {start_seq}")
            headers = msg.headers or {}
            status = headers.get(_STATUS)
            if status == _END_OF_BATCH:
                if received == 0 or _header_int(headers, _LAST_SEQUENCE) != previous:
                    raise FeedReadError(
                        f"direct get from {start_seq}: end of batch after sequence "
                        f"{headers.get(_LAST_SEQUENCE)!r}, but {previous} was the last received "
                        f"({received} messages): messages were lost on the way"
                    )
                return
            if status == _NOTHING_LEFT and received == 0:
                return  # nothing stored at or after start_seq: the rest was deleted
            self._raise_for_status(msg, _DIRECT_GET)
            seq = _header_int(headers, _SEQUENCE)
            if _header_int(headers, _LAST_SEQUENCE) != previous or seq < start_seq or (
                received and seq <= previous
            ):
                raise FeedReadError(
                    f"direct get from {start_seq}: sequence {seq} follows "
                    f"{headers.get(_LAST_SEQUENCE)!r}, but {previous or 'nothing'} was received "
                    "before it: messages were lost or reordered"
                )
            subject = headers.get(_SUBJECT)
            if not subject:
                raise FeedReadError(f"direct get answer for sequence {seq} has no {_SUBJECT}")
            previous = seq
            received += 1
            yield FeedMessage(seq=seq, subject=subject, msg_id=headers.get(_MSG_ID), data=msg.data)

    async def _send(self, subject: str, payload: bytes) -> None:
        try:
            await self.nc.publish(subject, payload, reply=self.inbox)
        except nats.errors.ConnectionClosedError as exc:
            raise FeedReadError("the NATS connection is closed") from exc
        await self._flush_and_check("publish to", subject)

    async def _flush_and_check(self, operation: str, subject: str) -> None:
        """Wait until the server has seen everything sent; raise if it refused `subject`.

        A refused publish or subscription raises nothing in nats-py and gets no
        answer; the server sends `-ERR 'Permissions Violation for ...'`, which
        nats-py records as the connection's last error (lowercased) before it
        handles the PONG of this flush. So after the flush a refusal is known
        at once, and the read does not wait out its timeout for it.
        """
        what = f"{operation} {subject}"
        try:
            await flush_all(self.nc, self.timeout)
        except nats.errors.TimeoutError as exc:
            raise FeedReadTimeout(
                f"the NATS server did not answer a flush within {self.timeout:g} s", what=what
            ) from exc
        except nats.errors.ConnectionClosedError as exc:
            raise FeedReadError("the NATS connection is closed") from exc
        error = self.nc.last_error
        if error is None or error is self._error_before:
            return
        self._error_before = error
        text = str(error).lower()
        if "permissions violation" in text and f'{operation} "{subject}"'.lower() in text:
            raise FeedAccessDenied(
                f"the NATS server refused the {what}; reading the feed by sequence needs "
                "an auditor identity and a server config of this version",
                what=what,
            )

    async def _next(self, what: str) -> Msg:
        assert self._sub is not None
        try:
            return await self._sub.next_msg(timeout=self.timeout)
        except nats.errors.TimeoutError as exc:
            raise FeedReadTimeout(
                f"no {what} within {self.timeout:g} s (is the server up, and is "
                f"{FEED_STREAM} declared?)",
                stream=FEED_STREAM,
            ) from exc
        except nats.errors.ConnectionClosedError as exc:
            raise FeedReadError("the NATS connection is closed") from exc

    @staticmethod
    def _raise_for_status(msg: Msg, subject: str) -> None:
        headers = msg.headers or {}
        status = headers.get(_STATUS)
        if status is None:
            return
        description = headers.get(_DESCRIPTION, "")
        if status == _NO_RESPONDERS:
            raise FeedReadError(
                f"no responders on {subject}: {FEED_STREAM} does not exist, does not allow "
                "direct gets, or JetStream is not ready",
                stream=FEED_STREAM,
            )
        raise FeedReadError(
            f"{subject} answered {status} {description}".rstrip(), stream=FEED_STREAM
        )


def _header_int(headers: dict[str, str], name: str) -> int:
    try:
        return int(headers[name])
    except (KeyError, ValueError) as exc:
        raise FeedReadError(f"direct get answer without a numeric {name} header") from exc
