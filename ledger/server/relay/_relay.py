"""The relay itself: follows the event log, builds each event's messages, publishes them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from nats.aio.client import Client

from ledger._recent import Recent
from ledger.adapters.event_tables import StoredRow
from ledger.domain.event_kinds import event_kind
from ledger.server.gateway import LedgerGateway
from ledger.server.metrics import LedgerMetrics
from ledger.server.relay.messages import (
    RelayMessage,
    Route,
    SensitiveArguments,
    learn_routes,
    messages_for,
)
from ledger.server.relay.position import RelayPositions, SetAsideRecord
from ledger.server.relay.publisher import Proof, RelayPublisher, SetAside
from ledger.server.transient import log_failure
from schemas import OperationStatus, cancel_and_wait

__all__ = ["Relay", "RelayPorts"]

_log = logging.getLogger("ledger.server.relay")

# How often the relay looks for events that other instances wrote. On PostgreSQL their
# appends' notices wake it at once (`others_appended`); the poll is what is left when a
# notice is lost, and the takeover of a relay lease another instance gave up.
_POLL_S = 0.25
# How far the operations view (and the seal) may fall behind while events flow. Every
# refresh is its own transactions (view, then seal: about eight statements); at 0.02 s
# they were a fifth of the service's PostgreSQL statements. Readers of the view fold in
# what it has not taken in yet (`OperationsProjector.rows(current=True)`).
_REFRESH_EVERY_S = 0.25
# Operations whose routes the relay remembers (oldest dropped first; a forgotten one is
# asked of the view). About 450 bytes each: at 100,000 they were 45 MB of the service.
_ROUTES_KEPT = 20_000


@dataclass(frozen=True, slots=True)
class RelayPorts:
    """What the relay uses of the ledger, and nothing more (the composition root
    passes the real ones: `ledger.server.app.relay_ports`)."""

    rows_after: Callable[[int, int], Sequence[StoredRow]]
    """(position, limit) → the stored events after `position`, in order."""
    refresh: Callable[[], object]
    """Bring the operations view up to date (it knows operations proposed long ago)."""
    routes: Callable[[Iterable[str]], Mapping[str, Route]]
    """operation IDs → (tool, tool version, host) of those the view knows."""
    sensitive_arguments: SensitiveArguments
    """tool → the pointers its contract marks sensitive (hashed on the feed)."""
    status: Callable[[str, int, str], OperationStatus]
    """(host's operation ID, version just read, host) → its status; raises if unreadable."""
    note_set_aside: Callable[[str, int, int, str], object]
    """(operation ID, position, version, reason): record `Operation.PublicationSetAside`."""
    final_states: frozenset[str]
    """The states whose outcome is announced to the host."""
    attention_states: frozenset[str] = frozenset({"needs_resolution"})
    """The states, not final, announced to the host all the same: a person must act."""
    last_position: Callable[[], int] | None = None
    """The newest stored event's position (for the relay-lag gauge; None: not measured)."""
    prefetch: Callable[[Sequence[str]], object] | None = None
    """operation IDs whose statuses `status` is about to be asked for → read what they
    need in one go (one round trip per batch, not per outcome notice); None: nothing."""
    observe: Callable[[Sequence[StoredRow]], object] | None = None
    """Every batch of events the relay read, before it is published (the plan follower
    learns from it which plans have steps that moved); None: nobody."""
    refresh_soon: Callable[[], object] | None = None
    """Ask for `refresh` to run elsewhere without waiting for it (a thread of its own,
    `ledger.server.view_refresher`); the relay then refreshes inline only when it needs
    a route the view must know. None: every refresh inline."""
    forget_appended: Callable[[], object] | None = None
    """Another writer appended: forget the rows this process kept for the relay
    (`AppendedRows.forget`), which end where this process's appends end and so
    would hide the other's rows until the next poll. None: nothing kept."""
    taken_over: Callable[[], object] | None = None
    """Called when this instance takes the relay lease (at its first batch, or from
    another instance): whoever learns from `observe` missed what the relay read
    before (the plan follower rereads the open plans); None: nobody."""


class Relay:
    """Follows the event log and publishes what each event means for others."""

    def __init__(
        self,
        gateway: LedgerGateway,
        nc: Client,
        ports: RelayPorts,
        positions: RelayPositions,
        *,
        batch: int = 500,
        lease: timedelta = timedelta(seconds=10),
        save_every: timedelta = timedelta(milliseconds=200),
        ack_timeout: timedelta = timedelta(seconds=5),
        metrics: LedgerMetrics | None = None,
        instance: str | None = None,
    ) -> None:
        self._gateway = gateway
        self._ports = ports
        self._positions = positions
        self._publisher = RelayPublisher(
            nc, ack_timeout=ack_timeout.total_seconds(), set_aside=self._set_aside_later
        )
        self._batch = batch
        self._lease = lease
        self._save_every = save_every
        self._metrics = metrics
        # Who holds the relay, as the positions row and the logs name it: the
        # service instance's name where it has one, and always this process.
        host = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self._owner = f"{instance}@{host}" if instance else host
        self._task: asyncio.Task[None] | None = None
        # While this instance holds the relay lease, its position lives here;
        # the row is written at most every `save_every` (and on stop), which
        # also renews the lease. A crash republishes what came after the
        # saved position: JetStream drops the copies by message ID, hosts
        # ignore an outcome they already have, the ledger a result it has.
        self._position: int | None = None  # published up to here
        self._confirmed: int | None = None  # known stored up to here (what is saved)
        self._saved_position: int | None = None
        self._held_until = datetime.min.replace(tzinfo=UTC)
        self._saved_at = datetime.min.replace(tzinfo=UTC)
        self._refreshed_at = 0.0
        self._routes: Recent[str, Route] = Recent(_ROUTES_KEPT)
        # Positions ahead of ours already set aside, so that reading them
        # again (after a failed batch, a restart) does not try them again.
        self._set_aside_positions: set[int] = set()

    def start(self) -> None:
        """Run the relay until `stop`."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ledger-relay")

    def others_appended(self) -> None:
        """Another instance appended events (`ledger.adapters.append_notices`): publish
        them now, not at the next poll. Nothing while another instance relays: waking
        would only ask for the relay lease again."""
        if self._position is not None:
            if self._ports.forget_appended is not None:
                self._ports.forget_appended()
            self._gateway.written.set()

    async def stop(self) -> None:
        """Stop relaying (what was not published is published by the next relay)."""
        await cancel_and_wait(self._task)
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
            except SetAside:
                # Read the batch again without what was set aside.
                self._position = None
                continue
            except Exception as exc:
                log_failure(_log, "relay failed; retrying", exc)
                self._position = None  # read the position again from the row
                await asyncio.sleep(1)
            if self._position is None:
                # Another instance relays: this one asks for the lease at each poll
                # only. Its own batches are the holder's to publish, and asking after
                # each was a query per batch (a tenth of a standby's loop with two
                # services on PostgreSQL).
                await asyncio.sleep(_POLL_S)
                written.clear()
                continue
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
            if self._confirmed != self._position and self._publisher.confirm_due():
                await self._confirm_last()
            return False
        await self._publish(messages, position)
        # A short batch means the relay has caught up: asking again at once
        # would cost a query per wake-up for nothing. New appends set `written`.
        return full

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
        position = self._positions.take(self._owner, now, now + self._lease)
        if position is None:
            if self._metrics is not None:
                self._metrics.relay_lag.set(0)  # another instance relays, and reports
            return None
        _log.info("relay: %s now relays, from position %d", self._owner, position)
        if self._ports.taken_over is not None:
            try:
                self._ports.taken_over()
            except Exception:  # a follower's catch-up never costs the relay its turn
                _log.exception("relay: catching up after the takeover failed")
        self._position = self._confirmed = self._saved_position = position
        self._set_aside_positions = self._positions.set_aside_after(position)
        self._publisher.forget_sequence()  # another relay may have written since
        self._held_until, self._saved_at = now + self._lease, now
        return self._position

    def _save(self, now: datetime) -> None:
        """Write the position and renew the lease; forget both if another relay took over."""
        assert self._confirmed is not None
        if self._positions.save(self._owner, self._confirmed, now + self._lease):
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
        self._positions.release(self._owner, self._confirmed)
        self._position = self._confirmed = self._saved_position = None

    def _read_batch(self) -> tuple[int | None, list[RelayMessage], bool] | None:
        position = self._claim()
        if position is None:
            return None
        ports = self._ports
        rows = list(ports.rows_after(position, self._batch))
        if not rows:
            if self._metrics is not None:
                self._metrics.relay_lag.set(0)
            return None, [], False
        learn_routes(rows, self._routes)
        if ports.observe is not None:
            try:
                ports.observe(rows)
            except Exception:  # an observer never costs the events their publication
                _log.exception("relay: the observer of a batch failed")
        missing = {row[1] for row in rows if row[1] not in self._routes}
        now = time.monotonic()
        if missing or now - self._refreshed_at >= _REFRESH_EVERY_S:
            # Keep the view a little behind, never far: bringing it up to date
            # blocks the loop, so it is done often enough to stay short. And
            # operations proposed before this relay's position (a restart, a
            # takeover) are known to the view once it has caught up.
            if missing or ports.refresh_soon is None:
                ports.refresh()
            else:
                ports.refresh_soon()  # nothing here waits for the view: not on the loop
            self._refreshed_at = now
            if self._metrics is not None and ports.last_position is not None:
                # What is left once this batch is out (positions may have gaps).
                self._metrics.relay_lag.set(max(ports.last_position() - rows[-1][0], 0))
        if missing:
            for operation_id, found in ports.routes(missing).items():
                self._routes.remember(operation_id, found)
        if ports.prefetch is not None:
            announced = [
                row[1]
                for row in rows
                if (kind := event_kind(row[3].rsplit(".", 1)[-1])) is not None
                and (kind.settles or kind.notifies)
            ]
            if announced:
                try:
                    ports.prefetch(announced)
                except Exception as exc:  # a shortcut only: each status reads on its own
                    _log.warning("relay: reading results ahead failed: %s", exc)
        messages: list[RelayMessage] = []
        limit = self._publisher.payload_limit()
        observe = self._metrics.observe if self._metrics is not None else None
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
                messages.extend(
                    messages_for(
                        row,
                        route,
                        limit=limit,
                        sensitive=ports.sensitive_arguments,
                        final_status=self._final_status,
                        observe=observe,
                    )
                )
            except Exception as exc:
                # Nothing about one event may stop the feed, outcomes and work
                # for everyone: what cannot be published is set aside, said
                # so, and the relay moves on.
                self._set_aside(row, f"{type(exc).__name__}: {exc}")
        return rows[-1][0], messages, len(rows) == self._batch

    def _final_status(
        self, operation_id: str, version: int, host: str, final: bool = True
    ) -> OperationStatus | None:
        try:
            status = self._ports.status(operation_id, version, host)
        except Exception as exc:
            _log.warning("no outcome notice for %s/%s: %s", host, operation_id, exc)
            return None
        if final and not (status.final and status.state in self._ports.final_states):
            return None
        if not final and (status.final or status.state not in self._ports.attention_states):
            return None
        return status

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
        first = self._positions.set_aside(
            SetAsideRecord(position, operation_id, version, reason, datetime.now(UTC))
        )
        if first and self._metrics is not None:
            self._metrics.relay_set_aside.inc()
        if not first or kind == "PublicationSetAside":
            # Seen before (a restart before the position was saved), or the note
            # itself: noting a note that cannot be published would never end.
            return
        try:
            self._ports.note_set_aside(operation_id, position, version, reason)
        except Exception:
            # Not an operation we can load (a row that was never ours): the
            # table row, the metric and the log line stand for it.
            _log.exception("relay: could not note the set-aside event on %s", operation_id)

    async def _set_aside_later(self, row: StoredRow, reason: str) -> None:
        await self._gateway.call(self._set_aside, row, reason)

    # -------------------------------------------------------------- event loop

    async def _publish(self, messages: list[RelayMessage], position: int) -> None:
        """Publish one batch in order and move the position to its end (what is
        proven stored moves `_confirmed`; see `RelayPublisher.publish`)."""
        proof = await self._publisher.publish(messages)
        before, self._position = self._position, position
        if proof is Proof.NO_FEED:
            if self._confirmed == before:
                self._confirmed = position  # nothing unproven before it: all stored
        else:
            self._settle(proof, position)

    async def _confirm_last(self) -> None:
        position = self._position
        if position is None:
            return
        self._settle(await self._publisher.confirm_last(), position)

    def _settle(self, proof: Proof, position: int) -> None:
        if proof is Proof.STORED:
            self._confirmed = position
        elif proof is Proof.LOST:
            _log.warning("publishing again from position %s", self._confirmed)
            self._position = self._confirmed
