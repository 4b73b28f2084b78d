"""The relay: the ledger's outbox, published to NATS in event order.

Every appended event is mirrored on the feed; an operation that became ready
gets a work item on its tool's work queue; an operation that reached a final
state gets its outcome announced to the host that proposed it. The relay
saves its position only over what JetStream is known to have stored, so a
crash between commit and publish means a republish (deduplicated by message
ID), never a lost work item or feed event. One relay runs at a time per
database: instances take turns through a lease row, so two services do not
dispatch twice.

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
import contextlib
import logging
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from nats.aio.client import Client
from nats.errors import BadSubjectError, MaxPayloadError
from nats.js import JetStreamContext
from nats.js.errors import APIError

from ledger._recent import Recent
from ledger.audit.export import feed_record
from ledger.audit.verify import StoredRow
from ledger.server.gateway import LedgerGateway
from ledger.server.metrics import LedgerMetrics
from ledger.service import FINAL_STATES, Ledger
from schemas import (
    Subjects,
    WorkItem,
    feed_message_id,
    host_operation_id,
    work_message_id,
)

__all__ = ["SET_ASIDE_TABLE", "Relay"]

_log = logging.getLogger(__name__)
_NAME = "relay"
_DISPATCH = {"Readied", "RetryScheduled"}
_SETTLING = {
    "Succeeded",
    "Failed",
    "Rejected",
    "ApprovalDenied",
    "ApprovalExpired",
    "Cancelled",
    "Reconciled",
}


_CONFIRM_EVERY_S = 0.05  # how often a feed event is published with a PubAck that proves the rest
_POLL_S = 0.25  # how often the relay looks for events that other instances wrote
_REFRESH_EVERY_S = 0.02  # how far the operations view may fall behind while events flow
_ROUTES_KEPT = 100_000  # operations whose routes the relay remembers (oldest dropped first)
_FINAL = frozenset(state.value for state in FINAL_STATES)
_NEVER_STORED = frozenset({10054})  # JetStream: "message size exceeds maximum allowed"
_HEADER_ROOM = 512  # the server counts headers against max_payload; nats-py counts data only

SET_ASIDE_TABLE = "opledger_relay_set_aside"
"""Events the relay could not publish and went on without: (position, operation_id,
version, reason, set_aside_at). Each also gets `Operation.PublicationSetAside`."""


@dataclass(frozen=True, slots=True)
class _Message:
    subject: str
    payload: bytes
    message_id: str | None  # None: core NATS (outcome notices are not stored)
    feed: bool = False  # a feed event: its sequence number is known in advance
    row: StoredRow | None = None  # the event it carries, for a feed message


class _SetAside(Exception):
    """Messages of this batch cannot be published; they were set aside: read it again."""


class Relay:
    """Follows the event log and publishes what each event means for others."""

    def __init__(
        self,
        gateway: LedgerGateway,
        nc: Client,
        *,
        batch: int = 500,
        lease: timedelta = timedelta(seconds=10),
        save_every: timedelta = timedelta(milliseconds=200),
        ack_timeout: timedelta = timedelta(seconds=5),
        metrics: LedgerMetrics | None = None,
    ) -> None:
        self._gateway = gateway
        self._ledger: Ledger = gateway.ledger
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream()
        self._batch = batch
        self._lease = lease
        self._save_every = save_every
        self._ack_timeout = ack_timeout.total_seconds()
        self._metrics = metrics
        self._owner = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self._task: asyncio.Task[None] | None = None
        # While this instance holds the relay lease, its position lives here;
        # the row is written at most every `save_every` (and on stop), which
        # also renews the lease. A crash republishes what came after the
        # saved position: JetStream drops the copies by message ID, hosts
        # ignore an outcome they already have, the ledger a result it has.
        self._position: int | None = None  # published up to here
        self._confirmed: int | None = None  # known stored up to here (what is saved)
        self._saved_position: int | None = None
        # The feed sequence number the next feed event will get, once known;
        # None: publish with a PubAck each until it is known again.
        self._feed_next: int | None = None
        self._last_feed: _Message | None = None
        self._confirmed_at = 0.0
        self._held_until = datetime.min.replace(tzinfo=UTC)
        self._saved_at = datetime.min.replace(tzinfo=UTC)
        self._refreshed_at = 0.0
        self._routes: Recent[str, tuple[str, str | None, str]] = Recent(_ROUTES_KEPT)
        # Positions ahead of ours already set aside, so that reading them
        # again (after a failed batch, a restart) does not try them again.
        self._set_aside_positions: set[int] = set()
        self._ledger.db.execute(
            "CREATE TABLE IF NOT EXISTS opledger_relay ("
            " name TEXT PRIMARY KEY, position BIGINT NOT NULL, owner TEXT, until TEXT)"
        )
        self._ledger.db.execute(
            "INSERT INTO opledger_relay (name, position) VALUES (?, 0)"
            " ON CONFLICT (name) DO NOTHING",
            (_NAME,),
        )
        self._ledger.db.execute(
            f"CREATE TABLE IF NOT EXISTS {SET_ASIDE_TABLE} ("
            " position BIGINT PRIMARY KEY, operation_id TEXT NOT NULL,"
            " version INTEGER NOT NULL, reason TEXT NOT NULL, set_aside_at TEXT NOT NULL)"
        )

    def start(self) -> None:
        """Run the relay until `stop`."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ledger-relay")

    async def stop(self) -> None:
        """Stop relaying (what was not published is published by the next relay)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._position is not None:
            if self._confirmed != self._position:
                with contextlib.suppress(Exception):
                    await self._confirm_last()  # so the next relay need not send it again
            with contextlib.suppress(Exception):
                await self._gateway.call(self._release)

    async def _run(self) -> None:
        written = self._gateway.written
        while True:
            try:
                while await self.pump():
                    pass
            except _SetAside:
                # Read the batch again without what was set aside.
                self._position = None
                continue
            except Exception:
                _log.exception("relay failed; retrying")
                self._position = None  # read the position again from the row
                await asyncio.sleep(1)
            # Woken by the gateway after each batch, and by the poll timer for
            # what other instances write (no timeout wrapper per wait: a task
            # and a timer per wake-up add up at low rates).
            if not written.is_set():
                poll = asyncio.get_running_loop().call_later(_POLL_S, written.set)
                try:
                    await written.wait()
                finally:
                    poll.cancel()
            written.clear()

    async def pump(self) -> bool:
        """Publish one batch of new events; True if the batch was full (more may wait)."""
        claimed = await self._gateway.call(self._read_batch)
        if claimed is None:
            return False
        position, messages, full = claimed
        if position is None:
            # Caught up. Feed events sent without a PubAck are proven stored
            # by the next one sent with one; with nothing new to send, ask
            # about the last one again.
            if self._confirmed != self._position and self._confirm_due():
                await self._confirm_last()
            return False
        await self._publish(messages, position)
        # A short batch means the relay has caught up: asking again at once
        # would cost a query per wake-up for nothing. New appends set `written`.
        return full

    def _confirm_due(self) -> bool:
        return asyncio.get_running_loop().time() - self._confirmed_at >= _CONFIRM_EVERY_S

    # ------------------------------------------------------------- ledger thread

    def _claim(self) -> int | None:
        """Take, keep or renew the relay lease; the position to continue from, or None."""
        now = datetime.now(UTC)
        if self._position is not None and now < self._held_until - self._lease / 2:
            # Ours for a while yet; save (and so renew) now and then.
            if now - self._saved_at >= self._save_every and self._confirmed != self._saved_position:
                self._save(now)
            return self._position
        if self._position is not None:
            self._save(now)  # renew the lease, saving the position with it
            if self._position is not None:
                return self._position
        changed = self._ledger.db.execute_count(
            "UPDATE opledger_relay SET owner = ?, until = ?"
            " WHERE name = ? AND (owner IS NULL OR owner = ? OR until < ?)",
            (self._owner, (now + self._lease).isoformat(), _NAME, self._owner, now.isoformat()),
        )
        if not changed:
            return None
        rows = self._ledger.db.query("SELECT position FROM opledger_relay WHERE name = ?", (_NAME,))
        self._position = self._confirmed = self._saved_position = int(rows[0][0])
        self._set_aside_positions = {
            int(found[0])
            for found in self._ledger.db.query(
                f"SELECT position FROM {SET_ASIDE_TABLE} WHERE position > ?", (self._position,)
            )
        }
        self._feed_next = None  # another relay may have written since: learn it again
        self._held_until, self._saved_at = now + self._lease, now
        return self._position

    def _save(self, now: datetime) -> None:
        """Write the position and renew the lease; forget both if another relay took over."""
        changed = self._ledger.db.execute_count(
            "UPDATE opledger_relay SET position = ?, until = ? WHERE name = ? AND owner = ?",
            (self._confirmed, (now + self._lease).isoformat(), _NAME, self._owner),
        )
        if changed:
            self._saved_position, self._held_until, self._saved_at = (
                self._confirmed,
                now + self._lease,
                now,
            )
        else:
            _log.warning("the relay lease passed to another instance")
            self._position = self._confirmed = self._saved_position = None

    def _release(self) -> None:
        """Save the position and let another instance take over at once."""
        if self._confirmed is None:
            return
        self._ledger.db.execute(
            "UPDATE opledger_relay SET position = ?, owner = NULL, until = NULL"
            " WHERE name = ? AND owner = ?",
            (self._confirmed, _NAME, self._owner),
        )
        self._position = self._confirmed = self._saved_position = None

    def _read_batch(self) -> tuple[int | None, list[_Message], bool] | None:
        position = self._claim()
        if position is None:
            return None
        ledger = self._ledger
        rows = list(ledger.stored_rows_after(position, self._batch))
        if not rows:
            return None, [], False
        self._learn_routes(rows)
        missing = {row[1] for row in rows if row[1] not in self._routes}
        now = time.monotonic()
        if missing or now - self._refreshed_at >= _REFRESH_EVERY_S:
            # Keep the view a little behind, never far: bringing it up to date
            # blocks the loop, so it is done often enough to stay short. And
            # operations proposed before this relay's position (a restart, a
            # takeover) are known to the view once it has caught up.
            ledger.refresh()
            self._refreshed_at = now
        if missing:
            for operation_id, found in ledger.projector.routes(missing).items():
                self._routes.remember(operation_id, found)
        messages: list[_Message] = []
        limit = self._payload_limit()
        for row in rows:
            if row[0] in self._set_aside_positions:
                continue
            route = self._routes.get(row[1])
            if route is None:
                # Neither a Proposed event the relay read nor the view knows the
                # operation: the row is no event of ours (written by hand, or
                # unreadable). Skipping it silently would hide it.
                self._set_aside(row, "no operation is known for this event")
                continue
            try:
                messages.extend(self._messages_for(row, *route, limit=limit))
            except Exception as exc:
                # Nothing about one event may stop the feed, outcomes and work
                # for everyone: what cannot be published is set aside, said
                # so, and the relay moves on.
                self._set_aside(row, f"{type(exc).__name__}: {exc}")
        return rows[-1][0], messages, len(rows) == self._batch

    def _payload_limit(self) -> int:
        """The largest payload a message may have (the server's limit, less its headers)."""
        return max(int(self._nc.max_payload) - _HEADER_ROOM, 0)

    def _set_aside(self, row: StoredRow, reason: str) -> None:
        """Record that the event at `row` will not be published: a row, a metric, a log
        line and an event on its operation (`Operation.PublicationSetAside`)."""
        position, operation_id, version, topic, _ = row
        kind = topic.rsplit(".", 1)[-1]
        reason = reason[:500].replace("\x00", "\ufffd")  # TEXT on PostgreSQL holds no U+0000
        _log.error(
            "relay: event %s of %s (position %s) set aside: %s", version, operation_id,
            position, reason,
        )
        self._set_aside_positions.add(position)
        first = self._ledger.db.execute_count(
            f"INSERT INTO {SET_ASIDE_TABLE}"
            " (position, operation_id, version, reason, set_aside_at) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (position) DO NOTHING",
            (position, operation_id, version, reason, datetime.now(UTC).isoformat()),
        )
        if first and self._metrics is not None:
            self._metrics.relay_set_aside.inc()
        if not first or kind == "PublicationSetAside":
            # Seen before (a restart before the position was saved), or the note
            # itself: noting a note that cannot be published would never end.
            return
        try:
            self._ledger.note_publication_set_aside(
                operation_id, position=position, version=version, reason=reason
            )
        except Exception:
            # Not an operation we can load (a row that was never ours): the
            # table row, the metric and the log line stand for it.
            _log.exception("relay: could not note the set-aside event on %s", operation_id)

    def _learn_routes(self, rows: list[StoredRow]) -> None:
        """Note each operation's tool, tool version and host from the events that name them.

        The relay reads every event anyway; keeping these three facts saves
        bringing the operations view up to date (a transaction) per batch.
        """
        for _, operation_id, _, topic, stored in rows:
            kind = topic.rsplit(".", 1)[-1]
            try:
                if kind == "Proposed":
                    state = orjson.loads(stored)
                    route = (str(state["tool"]), None, str(state.get("host", "")))
                    self._routes.remember(operation_id, route)
                elif kind in ("Validated", "Rejected"):
                    known = self._routes.get(operation_id)
                    if known is not None:
                        version = orjson.loads(stored).get("tool_version")
                        self._routes.remember(
                            operation_id, (known[0], None if version is None else str(version),
                                           known[2])
                        )
            except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                # Not an event (a row written by hand): nothing to learn from it;
                # without a route it is set aside below.
                continue

    def _messages_for(
        self, row: StoredRow, tool: str, tool_version: str | None, host: str, *, limit: int
    ) -> list[_Message]:
        """The messages one event means, each within `limit` bytes; raises if it has none."""
        operation_id, version = row[1], row[2]
        contract = self._ledger.checker.catalog.get(tool)
        record = feed_record(row, contract.sensitive_arguments if contract else ())
        kind = record["type"]
        subject = Subjects.feed(tool, kind)
        if self._metrics is not None:
            try:
                self._metrics.observe(record, tool)
            except Exception:  # a metric must never cost an event its publication
                _log.warning("metrics could not count %s event %s", kind, version, exc_info=True)
        payload = orjson.dumps(record)
        if len(payload) > limit:
            # The event itself stays in the ledger; the feed carries its hash,
            # which is what an auditor compares against the store.
            payload = orjson.dumps(record | {"event": {}, "event_omitted": True})
            if len(payload) > limit:
                raise ValueError(f"even without its body the feed record is {len(payload)} bytes")
        feed_id = feed_message_id(operation_id, version)
        messages = [_Message(subject, payload, feed_id, feed=True, row=row)]
        if kind in _DISPATCH and tool_version:
            state: dict[str, Any] = record["event"]
            attempt = int(state.get("after_attempt", 0)) + 1
            item = WorkItem(
                operation_id=operation_id,
                tool=tool,
                tool_version=tool_version,
                attempt=attempt,
            )
            messages.append(
                _Message(
                    Subjects.work(tool),
                    item.model_dump_json().encode(),
                    # One dispatch event per attempt, so one work item per attempt.
                    work_message_id(operation_id, attempt),
                )
            )
        if kind in _SETTLING and host:
            notice = self._outcome_notice(operation_id, version, host, limit)
            if notice is not None:
                messages.append(notice)
        return messages

    def _outcome_notice(
        self, operation_id: str, version: int, host: str, limit: int
    ) -> _Message | None:
        """The announcement of a final outcome to its host, if there is one to make.

        Best effort (core NATS, and the host asks for the status when none
        comes): a status that cannot be read is the host's to ask about, and
        it never costs the event its place on the feed.
        """
        # The host knows its operation by its own ID: asked in its namespace.
        local = host_operation_id(operation_id)
        try:
            status = self._ledger.status(local, known_version=version, host=host)
        except Exception as exc:
            _log.warning("no outcome notice for %s: %s", operation_id, exc)
            return None
        if not (status.final and status.state in _FINAL):
            return None
        payload = status.model_dump_json().encode()
        if len(payload) > limit:
            # A result too large for any message: no notice (a notice without
            # its result would read as "no result"). The host's status request
            # is answered with an error that says so.
            _log.warning("no outcome notice for %s: %d bytes", operation_id, len(payload))
            return None
        return _Message(Subjects.outcome(host, local), payload, None)

    # -------------------------------------------------------------- event loop

    async def _publish(self, messages: list[_Message], position: int) -> None:
        """Publish one batch in order and move the position to its end.

        Stored messages go out with `publish_async` (no task, inbox or timer
        per message; one subscription collects the PubAcks), all in flight at
        once; any failure raises and the position stays, so the batch goes
        out again (deduplicated by message ID). Feed events carry no reply
        subject, except the batch's last when a proof is due (or while the
        feed's sequence is unknown: then each). Outcome notices go out with
        the rest, not after the PubAcks: the outcome is committed in the
        ledger already, and a host waits for it.
        """
        feed = [message for message in messages if message.feed]
        known = self._feed_next is not None
        prove = bool(feed) and known and self._confirm_due()
        proof = feed[-1] if prove else None
        acks: list[asyncio.Future[Any]] = []
        acked: list[_Message] = []
        feed_acks: list[asyncio.Future[Any]] = []
        try:
            for message in messages:
                headers = {"Nats-Msg-Id": message.message_id} if message.message_id else None
                try:
                    if message.message_id is None or (
                        message.feed and known and message is not proof
                    ):
                        await self._nc.publish(message.subject, message.payload, headers=headers)
                        continue
                    ack = await self._js.publish_async(
                        message.subject, message.payload, headers=headers
                    )
                except (BadSubjectError, MaxPayloadError) as exc:
                    # Checked for when the batch was read, so only a server with
                    # other limits can get here (a reconnect to another node).
                    await self._unpublishable(message, exc)
                    raise _SetAside() from exc
                acks.append(ack)
                acked.append(message)
                if message.feed:
                    feed_acks.append(ack)
            if acks:
                outcomes = await asyncio.wait_for(
                    asyncio.gather(*acks, return_exceptions=True), timeout=self._ack_timeout
                )
                await self._refused(acked, outcomes)
        except BaseException:
            for ack in acks:
                ack.cancel()  # frees its slot among the pending publishes
            raise
        before, self._position = self._position, position
        if not feed:
            if self._confirmed == before:
                self._confirmed = position  # nothing unproven before it: all stored
            return
        self._last_feed = feed[-1]
        last = feed_acks[-1].result() if feed_acks else None
        if not known:
            # Each feed event was acknowledged: all stored. The last one's
            # sequence tells the next, unless it was a copy of an older one.
            assert last is not None
            self._feed_next = None if last.duplicate else last.seq + 1
            self._proven(position)
        elif proof is not None:
            assert self._feed_next is not None and last is not None
            self._check(last, self._feed_next + len(feed) - 1, position)
        else:
            assert self._feed_next is not None
            self._feed_next += len(feed)

    async def _refused(self, messages: list[_Message], outcomes: list[Any]) -> None:
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
            raise _SetAside()

    async def _unpublishable(self, message: _Message, cause: Exception) -> None:
        if message.row is None:
            # A work item or a notice: small and well-formed by construction;
            # failing here is a fault to retry, not a message to give up on.
            raise cause
        await self._gateway.call(self._set_aside, message.row, f"{type(cause).__name__}: {cause}")

    async def _confirm_last(self) -> None:
        """Prove the feed events sent since the last proof by asking about the last one.

        Sent again with its message ID, a stored event comes back as a
        duplicate with the sequence it was stored at.
        """
        last, position = self._last_feed, self._position
        if last is None or self._feed_next is None or position is None:
            return
        ack = await self._js.publish(
            last.subject,
            last.payload,
            timeout=self._ack_timeout,
            headers={"Nats-Msg-Id": last.message_id} if last.message_id else None,
        )
        self._check(ack, self._feed_next - 1, position, copy=True)

    def _check(self, ack: Any, expected: int, position: int, *, copy: bool = False) -> None:
        """Accept `position` as stored if `ack` shows the sequence `expected`; else go back."""
        if ack.seq == expected and bool(ack.duplicate) == copy:
            self._feed_next = expected + 1
            self._proven(position)
            return
        # A feed event sent without a PubAck was not stored (or was a copy of
        # one stored before): publish again, with a PubAck each, from the
        # last proven position. JetStream drops what it already has.
        _log.warning(
            "feed sequence %s where %s was expected; publishing again from position %s",
            ack.seq,
            expected,
            self._confirmed,
        )
        self._feed_next = None
        self._position = self._confirmed

    def _proven(self, position: int) -> None:
        self._confirmed = position
        self._confirmed_at = asyncio.get_running_loop().time()
