"""Another instance's appends wake the relay at once, not at its poll (PostgreSQL's
NOTIFY, `ledger.adapters.append_notices`), against a real nats-server and PostgreSQL.

The relay's poll is moved an hour away in each test, so nothing but a notice can
be what publishes; each test first shows that, without a notice, the other
instance's events stay unpublished.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
import psycopg
import pytest
from nats.js.errors import NotFoundError

from ledger import Ledger, StorageConfig
from ledger.adapters.append_notices import AppendNotices
from ledger.adapters.recorders import ArrayInsertRecorder
from ledger.nats import Role
from ledger.server.app import _append_notices, build_relay
from ledger.server.gateway import LedgerGateway
from ledger.server.relay import Relay
from ledger.server.relay import _relay as relay_loop
from schemas import FEED_STREAM, WORK_STREAM, Subjects
from tests.conftest import drop_schema, postgres_storage_or_skip
from tests.ledger.helpers import ALICE, make_ledger, search
from tests.nats.conftest import NatsEnv

# One worker for this and tests/ledger/test_recorders.py: their notices share the
# database's channel, and the counts here would hear the headless ones sent there.
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.nats,
    pytest.mark.timeout(90),
    pytest.mark.xdist_group("append-notices"),
]


async def _work_items(js: Any) -> int:
    return int((await js.stream_info(WORK_STREAM)).state.messages)


async def _until(check: Callable[[], Any], what: str, timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.05)


def _notices(
    ledger: Ledger,
    relay: Relay,
    storage: StorageConfig,
    named: list[str] | None = None,
    retry_after_s: float = 0.1,
) -> AppendNotices:
    recorder = ledger.events.recorder
    assert isinstance(recorder, ArrayInsertRecorder)

    def on_notice(operation_ids: Sequence[str] | None) -> None:
        if named is not None and operation_ids is not None:
            named.extend(operation_ids)
        relay.others_appended()

    return AppendNotices(
        storage.postgres_dsn or "",
        recorder.channel_name,
        store=recorder.notice_store,
        writer=recorder.notice_writer,
        on_notice=on_notice,
        retry_after_s=retry_after_s,
    )


async def _relaying(relay: Relay) -> None:
    await _until(lambda: asyncio.sleep(0, relay._position is not None), "the relay holds the lease")


@pytest.fixture
def another_schema() -> Iterator[StorageConfig]:
    """A second ledger's schema in the same database."""
    config = postgres_storage_or_skip()
    yield config
    drop_schema(config)


@dataclass
class _Instances:
    """Two service instances' ledgers on one PostgreSQL; `relaying`'s relay runs and holds
    the relay lease (its poll an hour away); `js` sees the streams."""

    relaying: Ledger
    other: Ledger
    gateway: LedgerGateway
    relay: Relay
    probe: Any
    js: Any


@asynccontextmanager
async def _two_instances(
    nats_env: NatsEnv, storage: StorageConfig, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[_Instances]:
    monkeypatch.setattr(relay_loop, "_POLL_S", 3600.0)
    relaying, other = make_ledger(storage), make_ledger(storage)
    gateway = LedgerGateway(relaying)
    try:
        async with nats_env.connect(Role.LEDGER, "ledger") as probe:
            relay = build_relay(gateway, probe.nc)
            relay.start()
            await _relaying(relay)
            try:
                yield _Instances(relaying, other, gateway, relay, probe, probe.nc.jetstream())
            finally:
                await relay.stop()
    finally:
        relaying.close()
        other.close()


def _kill_backend(storage: StorageConfig, pid: int | None) -> None:
    with psycopg.connect(storage.postgres_dsn or "", autocommit=True) as db:
        assert db.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)


async def test_another_instances_append_is_relayed_on_its_notice_and_own_appends_are_not_heard(
    nats_env: NatsEnv,
    postgres_storage: StorageConfig,
    another_schema: StorageConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with _two_instances(nats_env, postgres_storage, monkeypatch) as pair:
        js = pair.js
        # A relay without the lease is not woken: it would only ask for the lease again.
        standby = build_relay(pair.gateway, pair.probe.nc)
        pair.gateway.written.clear()
        standby.others_appended()
        assert not pair.gateway.written.is_set()

        before = await _work_items(js)
        pair.other.submit(search("op-notice-0"), ALICE)
        await asyncio.sleep(1.5)
        assert await _work_items(js) == before, "the poll is an hour away: nothing may go out"

        named: list[str] = []
        notices = _notices(pair.relaying, pair.relay, postgres_storage, named)
        notices.start()
        try:
            # Listening starts with one look: what was appended unheard goes out now.
            await _until(lambda: _equals(js, before + 1), "the unheard append relayed")
            assert notices.heard == 0

            pair.other.submit(search("op-notice-1"), ALICE)
            await _until(lambda: _equals(js, before + 2), "the other instance's append relayed")
            assert notices.heard >= 1

            # This instance's own append sends a notice too, and so does a ledger in
            # another schema of the database (the channel is the table's name), both
            # before the other's below (one connection delivers them in commit order):
            # only the other's is heard.
            heard = notices.heard
            elsewhere = make_ledger(another_schema)
            elsewhere.submit(search("op-notice-2"), ALICE)
            pair.relaying.submit(search("op-notice-2"), ALICE)
            pair.other.submit(search("op-notice-3"), ALICE)
            await _until(lambda: _equals(js, before + 4), "both appends relayed")
            await asyncio.sleep(0.5)
            assert notices.heard == heard + 1
            # Each notice named what it appended: only the other instance's operations.
            assert named == ["op-notice-1", "op-notice-3"]
            elsewhere.close()
        finally:
            await notices.stop()


async def _equals(js: Any, count: int) -> bool:
    return await _work_items(js) == count


async def test_each_killed_listening_connection_is_said_and_listened_again_at_once(
    nats_env: NatsEnv,
    postgres_storage: StorageConfig,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with _two_instances(nats_env, postgres_storage, monkeypatch) as pair:
        notices = _notices(pair.relaying, pair.relay, postgres_storage, retry_after_s=0.25)
        waited: list[float] = []

        async def recorded_sleep(delay: float) -> None:
            waited.append(delay)
            await asyncio.sleep(delay)

        notices._sleep = recorded_sleep
        notices.start()
        try:
            await asyncio.wait_for(notices.listening.wait(), 10)
            with caplog.at_level(logging.WARNING, logger="ledger.adapters.append_notices"):
                for drop in range(4):
                    killed = notices.backend_pid
                    _kill_backend(postgres_storage, killed)
                    await _until(
                        lambda killed=killed: asyncio.sleep(  # type: ignore[misc]
                            0, notices.listening.is_set() and notices.backend_pid != killed
                        ),
                        f"listening again after drop {drop + 1}",
                    )
            # Each new outage is retried from the first delay, rather than doubling
            # across outages that each ended (0.25, 0.5, 1, 2 s).
            assert waited == [0.25] * 4
            said = [r for r in caplog.records if "not listening" in r.getMessage()]
            assert len(said) == 4  # each drop said once

            before = await _work_items(pair.js)
            pair.other.submit(search("op-relisten-0"), ALICE)
            await _until(lambda: _equals(pair.js, before + 1), "relayed after the reconnections")
        finally:
            await notices.stop()


async def test_the_services_wiring_drops_stale_copies_and_wakes_the_relay(
    nats_env: NatsEnv, postgres_storage: StorageConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `ledger.server.app`'s own listener. B relays, submitted two operations and holds
    # their copies; A leases one. Without the notice, B would publish A's event at its
    # poll (an hour away here), and B's next command on that operation would run on
    # the stale copy, fail its append on the version check, and run its turn again.
    async with _two_instances(nats_env, postgres_storage, monkeypatch) as pair:
        a, b, js = pair.other, pair.relaying, pair.js
        notices = _append_notices(b, pair.relay)
        assert notices is not None
        notices.start()
        try:
            await asyncio.wait_for(notices.listening.wait(), 10)
            work = await _work_items(js)
            b.submit(search("op-stale-0"), ALICE)
            b.submit(search("op-stale-1"), ALICE)
            pair.gateway.written.set()  # as the gateway does after its own appends
            await _until(lambda: _equals(js, work + 2), "B's own operations dispatched")
            copy = b.runner.cached("op-stale-0")
            assert copy is not None and copy.version == 3

            a.lease("op-stale-0", executor="exec-1")
            await _until(
                lambda: asyncio.sleep(0, b.runner.cached("op-stale-0") is None),
                "B's stale copy dropped",
            )
            # By its subject, not by a count of the feed: the feed is another stream
            # than the work items, stored on its own, so a count taken once the work
            # items are in may still lack B's own events (seen: 1 of 6).
            await _until(
                lambda: _feed_holds(js, "op-stale-0", "LeaseClaimed"),
                "A's LeaseClaimed published by B's relay",
            )
            assert notices.heard == 1
            assert b.runner.cached("op-stale-1") is not None  # nobody else wrote it
            assert b.status("op-stale-0").state == "executing"  # from the stored state

            # Notices missed while the connection was down: no copy is trusted after.
            _kill_backend(postgres_storage, notices.backend_pid)
            await _until(
                lambda: asyncio.sleep(0, b.runner.cached("op-stale-1") is None),
                "every copy dropped after the listener came back",
            )
        finally:
            await notices.stop()


async def _feed_holds(js: Any, operation_id: str, event_type: str) -> bool:
    """The feed's last `event_type` event of `search` operations is `operation_id`'s."""
    try:
        message = await js.get_last_msg(FEED_STREAM, Subjects.feed("search_documents", event_type))
    except NotFoundError:
        return False
    return bool(orjson.loads(message.data)["operation_id"] == operation_id)
