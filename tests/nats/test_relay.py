"""The relay against a real server, on both storage backends.

One relay holds the lease at a time; the holder keeps its position in memory
and writes it when it stops, so the next holder continues exactly there:
nothing is published twice and nothing is skipped.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from functools import partial
from typing import Any, cast

import pytest

from ledger import Ledger, StorageConfig
from ledger.nats import Role
from ledger.server.app import build_relay
from ledger.server.gateway import LedgerGateway
from ledger.server.metrics import LedgerMetrics
from ledger.server.relay import Relay
from ledger.server.relay import _relay as relay_loop
from ledger.server.relay import publisher as relay_module
from schemas import FEED_STREAM, WORK_STREAM, feed_message_id, work_message_id
from tests.ledger.helpers import ALICE, make_ledger, search
from tests.nats.conftest import NatsEnv

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


class RecordingRelay(Relay):
    """A relay that also notes the message ID (or, for a notice, the subject) it publishes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.published: list[str] = []

    async def _publish(self, messages: list[Any], position: int) -> None:
        await super()._publish(messages, position)
        self.published.extend(message.message_id or message.subject for message in messages)


async def _stored(js: Any, stream: str) -> int:
    return int((await js.stream_info(stream)).state.messages)


async def test_one_relay_at_a_time_and_the_next_continues_where_the_last_stopped(
    nats_env: NatsEnv, storage: StorageConfig
) -> None:
    ledger: Ledger = make_ledger(storage)
    # Message IDs are operation IDs: unique per backend, or JetStream's
    # duplicate window would drop the second run's publishes.
    ids = [f"op-relay-{n}-{'pg' if storage.is_postgres else 'lite'}" for n in (1, 2, 3)]
    gateway = LedgerGateway(ledger)
    async with nats_env.connect(Role.LEDGER, "ledger") as probe:
        js = probe.nc.jetstream()
        takeovers: list[str] = []
        first = cast(RecordingRelay, build_relay(gateway, probe.nc, relay=RecordingRelay,
                                                 taken_over=lambda: takeovers.append("1")))
        second = cast(RecordingRelay, build_relay(gateway, probe.nc, relay=RecordingRelay,
                                                  taken_over=lambda: takeovers.append("2")))
        feed, work = await _stored(js, FEED_STREAM), await _stored(js, WORK_STREAM)

        ledger.submit(search(ids[0]), ALICE)  # proposed, validated, readied
        assert await first.pump() is False  # a short batch: caught up
        assert len(first.published) == 4  # three feed events and the work item
        assert await _stored(js, FEED_STREAM) == feed + 3
        assert await _stored(js, WORK_STREAM) == work + 1

        # The first holds the lease: the second publishes nothing.
        ledger.submit(search(ids[1]), ALICE)
        assert await second.pump() is False
        assert second.published == []
        await first.pump()
        assert len(first.published) == 8

        # The first stops; the second takes over from the saved position (and whoever
        # follows the events through it hears that it starts relaying: the plan
        # follower then rereads the open plans it did not see go by).
        assert takeovers == ["1"]
        await first.stop()
        await second.pump()
        assert takeovers == ["1", "2"]
        assert second.published == []  # nothing again
        ledger.submit(search(ids[2]), ALICE)
        await second.pump()
        assert len(second.published) == 4
        assert sorted(second.published) == sorted(
            [feed_message_id(ids[2], version) for version in (1, 2, 3)]
            + [work_message_id(ids[2], 1)]
        )  # its three events and the work item of its first attempt
        assert not any(ids[2] in published for published in first.published)
        assert len(set(first.published + second.published)) == 12  # nothing twice
        assert await _stored(js, FEED_STREAM) == feed + 9
        assert await _stored(js, WORK_STREAM) == work + 3
    ledger.close()


async def test_with_a_view_thread_the_relay_asks_for_refreshes_and_never_waits_for_one(
    nats_env: NatsEnv, storage: StorageConfig
) -> None:
    """The relay only asks the view thread (`refresh_soon`) while it knows every route;
    an event of an operation it never saw proposed (it took over after the proposal)
    still gets its route from the view, refreshed inline, before it is published."""
    ledger: Ledger = make_ledger(storage)
    op = f"op-soon-{'pg' if storage.is_postgres else 'lite'}"
    gateway = LedgerGateway(ledger)
    asked: list[str] = []
    async with nats_env.connect(Role.LEDGER, "ledger") as probe:
        first = cast(RecordingRelay, build_relay(
            gateway, probe.nc, relay=RecordingRelay, refresh_soon=lambda: asked.append("1")
        ))
        ledger.submit(search(op), ALICE)
        await first.pump()
        assert asked == ["1"] and len(first.published) == 4
        assert ledger.projector.position() == 0  # the relay did not refresh it itself
        await first.stop()

        ledger.lease(op, executor="e-1")
        second = cast(RecordingRelay, build_relay(
            gateway, probe.nc, relay=RecordingRelay, refresh_soon=lambda: asked.append("2")
        ))
        await second.pump()
        # The lease's event, of an operation this relay never saw proposed: published,
        # with the route the view gave once refreshed inline.
        assert second.published == [feed_message_id(op, 4)]
        assert ledger.projector.position() == ledger.event_reader.last_position()
        assert asked == ["1"]
    ledger.close()


class LosingRelay(RecordingRelay):
    """Its first publish of one feed event goes where no stream stores it."""

    def __init__(self, *args: Any, lose: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lose: str | None = lose

    async def _publish(self, messages: list[Any], position: int) -> None:
        sent = []
        for message in messages:
            if message.message_id == self.lose:
                self.lose = None
                message = replace(message, subject="ops.nowhere")
            sent.append(message)
        await super()._publish(sent, position)


def _saved(ledger: Ledger) -> int:
    return int(ledger.db.query("SELECT position FROM opledger_relay")[0][0])


async def test_feed_events_without_pubacks_are_proven_by_a_later_one(
    nats_env: NatsEnv, storage: StorageConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger: Ledger = make_ledger(storage)
    suffix = "pg" if storage.is_postgres else "lite"
    gateway = LedgerGateway(ledger)
    monkeypatch.setattr(relay_module, "_CONFIRM_EVERY_S", 3600.0)  # no proof falls due
    async with nats_env.connect(Role.LEDGER, "ledger") as probe:
        js = probe.nc.jetstream()
        relay = build_relay(gateway, probe.nc, relay=RecordingRelay)
        feed = await _stored(js, FEED_STREAM)
        ledger.submit(search(f"op-proof-1-{suffix}"), ALICE)
        await relay.pump()  # the feed's next sequence is learnt: a PubAck each
        first = relay._position
        assert relay._confirmed == first
        ledger.submit(search(f"op-proof-2-{suffix}"), ALICE)
        await relay.pump()  # sent without PubAcks (the work item still has one)
        assert relay._position != first and relay._confirmed == first  # not yet proven
        assert await relay.pump() is False  # caught up; no proof due yet
        assert relay._confirmed == first
        monkeypatch.setattr(relay_module, "_CONFIRM_EVERY_S", 0.0)
        assert await relay.pump() is False  # caught up: asks about the last event again
        assert relay._confirmed == relay._position
        assert await _stored(js, FEED_STREAM) == feed + 6
        await relay.stop()
    assert _saved(ledger) == ledger.stored_rows_after(0, 100_000)[-1][0]
    ledger.close()


async def test_a_lost_feed_event_is_noticed_and_sent_again_once(
    nats_env: NatsEnv, storage: StorageConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger: Ledger = make_ledger(storage)
    suffix = "pg" if storage.is_postgres else "lite"
    lost = f"op-lost-2-{suffix}"
    gateway = LedgerGateway(ledger)
    monkeypatch.setattr(relay_module, "_CONFIRM_EVERY_S", 3600.0)
    async with nats_env.connect(Role.LEDGER, "ledger") as probe:
        js = probe.nc.jetstream()
        relay = cast(
            LosingRelay,
            build_relay(gateway, probe.nc, relay=partial(LosingRelay, lose=f"{lost}:2")),
        )
        feed = await _stored(js, FEED_STREAM)
        ledger.submit(search(f"op-lost-1-{suffix}"), ALICE)
        await relay.pump()
        proven = relay._confirmed
        ledger.submit(search(lost), ALICE)
        await relay.pump()  # its Validated event is lost, and nobody said so
        ledger.submit(search(f"op-lost-3-{suffix}"), ALICE)
        monkeypatch.setattr(relay_module, "_CONFIRM_EVERY_S", 0.0)
        await relay.pump()  # this batch's last event carries the proof: it fails
        assert relay._confirmed == proven and relay._position == proven  # back to the proof
        while await relay.pump():
            pass
        assert await relay.pump() is False
        # Everything after the proven position went out again, with a PubAck each;
        # JetStream kept one copy of each event.
        assert relay.published.count(f"{lost}:2") == 2
        assert await _stored(js, FEED_STREAM) == feed + 9
        assert relay._confirmed == relay._position
        await relay.stop()
    assert _saved(ledger) == ledger.stored_rows_after(0, 100_000)[-1][0]
    ledger.close()


async def test_the_instance_that_takes_the_relay_over_says_so_and_reports_its_lag(
    nats_env: NatsEnv, storage: StorageConfig, caplog: pytest.LogCaptureFixture
) -> None:
    ledger: Ledger = make_ledger(storage)
    suffix = "pg" if storage.is_postgres else "lite"
    gateway = LedgerGateway(ledger)
    metrics_a, metrics_b = LedgerMetrics(instance="ledger-a"), LedgerMetrics(instance="ledger-b")
    async with nats_env.connect(Role.LEDGER, "ledger") as probe:
        first = build_relay(gateway, probe.nc, metrics=metrics_a, instance="ledger-a")
        second = build_relay(gateway, probe.nc, metrics=metrics_b, instance="ledger-b")
        with caplog.at_level(logging.INFO, logger="ledger.server.relay"):
            for n in range(3):
                ledger.submit(search(f"op-lag-{n}-{suffix}"), ALICE)
            # A batch of one event at a time: the lag is what is left after it.
            first._batch = 1
            await first.pump()
            assert metrics_a.registry.get_sample_value("opledger_relay_lag_events") == 8.0
            await second.pump()  # the lease is the first's
            assert metrics_b.registry.get_sample_value("opledger_relay_lag_events") == 0.0
            await first.stop()
            await second.pump()
        taken = [r.getMessage() for r in caplog.records if "now relays" in r.getMessage()]
        assert len(taken) == 2, taken
        assert taken[0].startswith("relay: ledger-a@") and taken[1].startswith("relay: ledger-b@")
    ledger.close()


async def test_a_standby_relay_asks_for_the_lease_at_its_poll_not_after_each_batch(
    nats_env: NatsEnv, storage: StorageConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two instances' relays on one ledger, running. The gateway wakes the relay after
    # every batch it writes; the one without the lease used to ask for it each time
    # (a query per batch). It asks at its poll only, and still takes over at once
    # when the holder lets go.
    monkeypatch.setattr(relay_loop, "_POLL_S", 0.2)
    ledger: Ledger = make_ledger(storage)
    suffix = "pg" if storage.is_postgres else "lite"
    gateway = LedgerGateway(ledger)
    async with nats_env.connect(Role.LEDGER, "ledger") as probe:
        holder = build_relay(gateway, probe.nc)
        holder.start()
        while holder._position is None:
            await asyncio.sleep(0.01)
        standby = cast(RecordingRelay, build_relay(gateway, probe.nc, relay=RecordingRelay))
        asks = 0
        take = standby._positions.take

        def counted_take(*args: Any) -> int | None:
            nonlocal asks
            asks += 1
            return take(*args)

        monkeypatch.setattr(standby._positions, "take", counted_take)
        standby.start()
        started = asyncio.get_running_loop().time()
        for _ in range(100):  # a hundred batches written in about half a second
            gateway.written.set()
            await asyncio.sleep(0.005)
        elapsed = asyncio.get_running_loop().time() - started
        assert 1 <= asks <= elapsed / 0.2 + 2, (asks, elapsed)

        await holder.stop()  # lets go of the lease
        ledger.submit(search(f"op-standby-{suffix}"), ALICE)
        gateway.written.set()
        for _ in range(300):
            if standby.published:
                break
            await asyncio.sleep(0.01)
        assert any(f"op-standby-{suffix}" in m for m in standby.published)
        await standby.stop()
    ledger.close()


async def test_a_relay_told_to_stop_as_its_pubacks_arrive_stops(
    nats_env: NatsEnv, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worst moment for a stop: its cancel lands in the same turn of the loop as
    # the batch's last PubAck. Python 3.11's `asyncio.wait_for` then returned the
    # PubAcks and dropped the cancel (fixed in 3.12), so the relay went on to wait
    # for its next wake-up, and `stop()` waited for the relay: a service that never
    # finished stopping (seen under load in tests/nats/test_append_notices.py).
    ledger: Ledger = make_ledger(StorageConfig.sqlite(tmp_path / "ledger.db"))
    gateway = LedgerGateway(ledger)
    async with nats_env.connect(Role.LEDGER, "ledger") as probe:
        relay = build_relay(gateway, probe.nc)
        publisher_js = relay._publisher._js
        publish_async = publisher_js.publish_async
        acks: list[asyncio.Future[Any]] = []
        stopping: list[asyncio.Task[None]] = []

        def stop_once_all_acked(_: object) -> None:
            # Runs before the batch's gather hears of the last PubAck (registered
            # first), so the stop's cancel and the PubAcks meet in one turn.
            if not stopping and all(ack.done() for ack in acks):
                stopping.append(asyncio.get_running_loop().create_task(relay.stop()))

        async def publish_then_stop(*args: Any, **kwargs: Any) -> asyncio.Future[Any]:
            ack: asyncio.Future[Any] = await publish_async(*args, **kwargs)
            acks.append(ack)
            ack.add_done_callback(stop_once_all_acked)
            return ack

        monkeypatch.setattr(publisher_js, "publish_async", publish_then_stop)
        ledger.submit(search("op-stop-at-ack"), ALICE)  # one batch: 3 feed events, 1 item
        relay.start()
        async with asyncio.timeout(15):
            while not stopping:
                await asyncio.sleep(0.01)
        try:
            async with asyncio.timeout(10):
                await stopping[0]
        except TimeoutError:
            raise AssertionError("the relay's stop did not end: its cancel was lost") from None
        assert relay._task is not None and relay._task.done()
    ledger.close()
