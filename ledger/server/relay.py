"""The relay: the ledger's outbox, published to NATS in event order.

Every appended event is mirrored on the feed; an operation that became ready
gets a work item on its tool's work queue; an operation that reached a final
state gets its outcome announced to the host that proposed it. The relay
advances its position only after JetStream acknowledged the publishes, so a
crash between commit and publish means a republish (deduplicated by message
ID), never a lost work item. One relay runs at a time per database: instances
take turns through a lease row, so two services do not dispatch twice.
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
from nats.js import JetStreamContext

from ledger._recent import Recent
from ledger.audit.export import feed_record
from ledger.audit.verify import StoredRow
from ledger.server.gateway import LedgerGateway
from ledger.server.metrics import LedgerMetrics
from ledger.service import FINAL_STATES, Ledger
from schemas import Subjects, WorkItem

__all__ = ["Relay"]

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


_POLL_S = 0.25  # how often the relay looks for events that other instances wrote
_REFRESH_EVERY_S = 0.02  # how far the operations view may fall behind while events flow
_ROUTES_KEPT = 100_000  # operations whose routes the relay remembers (oldest dropped first)
_FINAL = frozenset(state.value for state in FINAL_STATES)


@dataclass(frozen=True, slots=True)
class _Message:
    subject: str
    payload: bytes
    message_id: str | None  # None: core NATS (outcome notices are not stored)


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
        self._position: int | None = None
        self._saved_position: int | None = None
        self._held_until = datetime.min.replace(tzinfo=UTC)
        self._saved_at = datetime.min.replace(tzinfo=UTC)
        self._refreshed_at = 0.0
        self._routes: Recent[str, tuple[str, str | None, str]] = Recent(_ROUTES_KEPT)
        self._ledger.db.execute(
            "CREATE TABLE IF NOT EXISTS opledger_relay ("
            " name TEXT PRIMARY KEY, position BIGINT NOT NULL, owner TEXT, until TEXT)"
        )
        self._ledger.db.execute(
            "INSERT INTO opledger_relay (name, position) VALUES (?, 0)"
            " ON CONFLICT (name) DO NOTHING",
            (_NAME,),
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
            with contextlib.suppress(Exception):
                await self._gateway.call(self._release)

    async def _run(self) -> None:
        written = self._gateway.written
        while True:
            try:
                while await self.pump():
                    pass
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
            return False
        await self._publish(messages)
        self._position = position
        # A short batch means the relay has caught up: asking again at once
        # would cost a query per wake-up for nothing. New appends set `written`.
        return full

    # ------------------------------------------------------------- ledger thread

    def _claim(self) -> int | None:
        """Take, keep or renew the relay lease; the position to continue from, or None."""
        now = datetime.now(UTC)
        if self._position is not None and now < self._held_until - self._lease / 2:
            # Ours for a while yet; save (and so renew) now and then.
            if now - self._saved_at >= self._save_every and self._position != self._saved_position:
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
        self._position = self._saved_position = int(rows[0][0])
        self._held_until, self._saved_at = now + self._lease, now
        return self._position

    def _save(self, now: datetime) -> None:
        """Write the position and renew the lease; forget both if another relay took over."""
        changed = self._ledger.db.execute_count(
            "UPDATE opledger_relay SET position = ?, until = ? WHERE name = ? AND owner = ?",
            (self._position, (now + self._lease).isoformat(), _NAME, self._owner),
        )
        if changed:
            self._saved_position, self._held_until, self._saved_at = (
                self._position,
                now + self._lease,
                now,
            )
        else:
            _log.warning("the relay lease passed to another instance")
            self._position = self._saved_position = None

    def _release(self) -> None:
        """Save the position and let another instance take over at once."""
        if self._position is None:
            return
        self._ledger.db.execute(
            "UPDATE opledger_relay SET position = ?, owner = NULL, until = NULL"
            " WHERE name = ? AND owner = ?",
            (self._position, _NAME, self._owner),
        )
        self._position = self._saved_position = None

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
        for row in rows:
            route = self._routes.get(row[1])
            if route is not None:
                messages.extend(self._messages_for(row, *route))
        return rows[-1][0], messages, len(rows) == self._batch

    def _learn_routes(self, rows: list[StoredRow]) -> None:
        """Note each operation's tool, tool version and host from the events that name them.

        The relay reads every event anyway; keeping these three facts saves
        bringing the operations view up to date (a transaction) per batch.
        """
        for _, operation_id, _, topic, stored in rows:
            kind = topic.rsplit(".", 1)[-1]
            if kind == "Proposed":
                state = orjson.loads(stored)
                self._routes.remember(operation_id, (state["tool"], None, state.get("host", "")))
            elif kind in ("Validated", "Rejected"):
                known = self._routes.get(operation_id)
                if known is not None:
                    version = orjson.loads(stored).get("tool_version")
                    self._routes.remember(operation_id, (known[0], version, known[2]))

    def _messages_for(
        self, row: StoredRow, tool: str, tool_version: str | None, host: str
    ) -> list[_Message]:
        operation_id, version = row[1], row[2]
        contract = self._ledger.checker.catalog.get(tool)
        record = feed_record(row, contract.sensitive_arguments if contract else ())
        kind = record["type"]
        if self._metrics is not None:
            self._metrics.observe(record, tool)
        messages = [
            _Message(
                Subjects.feed(tool, kind),
                orjson.dumps(record),
                f"{operation_id}:{version}",
            )
        ]
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
                    f"{operation_id}:{version}",
                )
            )
        if kind in _SETTLING and host:
            status = self._ledger.status(operation_id, known_version=version)
            if status.final and status.state in _FINAL:
                messages.append(
                    _Message(
                        Subjects.outcome(host, operation_id),
                        status.model_dump_json().encode(),
                        None,
                    )
                )
        return messages

    # -------------------------------------------------------------- event loop

    async def _publish(self, messages: list[_Message]) -> None:
        # Every stored publish in flight at once, their PubAcks collected by one
        # subscription (`publish_async`: no task, request inbox or timer per
        # message). Any failure raises, and the position stays where it was,
        # so the whole batch is published again (deduplicated by message ID).
        # Outcome notices go out with them, not after the PubAcks: the outcome
        # is committed in the ledger already, and a host waits for it.
        acks: list[asyncio.Future[Any]] = []
        try:
            for message in messages:
                if message.message_id is None:
                    await self._nc.publish(message.subject, message.payload)
                else:
                    acks.append(
                        await self._js.publish_async(
                            message.subject,
                            message.payload,
                            headers={"Nats-Msg-Id": message.message_id},
                        )
                    )
            if acks:
                await asyncio.wait_for(asyncio.gather(*acks), timeout=self._ack_timeout)
        except BaseException:
            for ack in acks:
                ack.cancel()  # frees its slot among the pending publishes
            raise
