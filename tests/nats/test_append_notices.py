"""Another instance's appends wake the relay at once, not at its poll (PostgreSQL's
NOTIFY, `ledger.adapters.append_notices`), against a real nats-server and PostgreSQL.

The relay's poll is moved an hour away in each test, so nothing but a notice can
be what publishes; each test first shows that, without a notice, the other
instance's events stay unpublished.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import pytest

from ledger import Ledger, StorageConfig
from ledger.adapters.append_notices import AppendNotices
from ledger.adapters.recorders import ArrayInsertRecorder
from ledger.nats import Role
from ledger.server.app import _append_notices, build_relay
from ledger.server.gateway import LedgerGateway
from ledger.server.relay import Relay
from ledger.server.relay import _relay as relay_loop
from schemas import WORK_STREAM
from tests.ledger.helpers import ALICE, make_ledger, search
from tests.nats.conftest import NatsEnv

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(90)]


async def _work_items(js: Any) -> int:
    return int((await js.stream_info(WORK_STREAM)).state.messages)


async def _until(check: Callable[[], Any], what: str, timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.05)


def _notices(
    ledger: Ledger, relay: Relay, storage: StorageConfig, named: list[str] | None = None
) -> AppendNotices:
    recorder = ledger.events.recorder
    assert isinstance(recorder, ArrayInsertRecorder)

    def on_notice(operation_ids: Sequence[str]) -> None:
        if named is not None:
            named.extend(operation_ids)
        relay.others_appended()

    return AppendNotices(
        storage.postgres_dsn or "",
        recorder.channel_name,
        own_backends=lambda: recorder.backend_pids,
        on_notice=on_notice,
        retry_after_s=0.1,
    )


async def _relaying(relay: Relay) -> None:
    await _until(lambda: asyncio.sleep(0, relay._position is not None), "the relay holds the lease")


async def test_another_instances_append_is_relayed_on_its_notice_and_own_appends_are_not_heard(
    nats_env: NatsEnv, postgres_storage: StorageConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_loop, "_POLL_S", 3600.0)
    relaying, other = make_ledger(postgres_storage), make_ledger(postgres_storage)
    gateway = LedgerGateway(relaying)
    async with nats_env.connect(Role.LEDGER, "ledger") as probe:
        js = probe.nc.jetstream()
        relay = build_relay(gateway, probe.nc)
        standby = build_relay(gateway, probe.nc)
        relay.start()
        await _relaying(relay)
        # A relay without the lease is not woken: it would only ask for the lease again.
        gateway.written.clear()
        standby.others_appended()
        assert not gateway.written.is_set()

        before = await _work_items(js)
        other.submit(search("op-notice-0"), ALICE)
        await asyncio.sleep(1.5)
        assert await _work_items(js) == before, "the poll is an hour away: nothing may go out"

        named: list[str] = []
        notices = _notices(relaying, relay, postgres_storage, named)
        notices.start()
        try:
            # Listening starts with one look: what was appended unheard goes out now.
            await _until(lambda: _equals(js, before + 1), "the unheard append relayed")
            assert notices.heard == 0

            other.submit(search("op-notice-1"), ALICE)
            await _until(lambda: _equals(js, before + 2), "the other instance's append relayed")
            assert notices.heard >= 1

            # This instance's own append sends a notice too, before the other's below
            # (one connection delivers them in commit order); only the other's is heard.
            heard = notices.heard
            relaying.submit(search("op-notice-2"), ALICE)
            other.submit(search("op-notice-3"), ALICE)
            await _until(lambda: _equals(js, before + 4), "both appends relayed")
            await asyncio.sleep(0.5)
            assert notices.heard == heard + 1
            # Each notice named what it appended: only the other instance's operations.
            assert named == ["op-notice-1", "op-notice-3"]
        finally:
            await notices.stop()
            await relay.stop()
    relaying.close()
    other.close()


async def _equals(js: Any, count: int) -> bool:
    return await _work_items(js) == count


async def test_a_killed_listening_connection_is_said_and_listened_again(
    nats_env: NatsEnv,
    postgres_storage: StorageConfig,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(relay_loop, "_POLL_S", 3600.0)
    relaying, other = make_ledger(postgres_storage), make_ledger(postgres_storage)
    gateway = LedgerGateway(relaying)
    async with nats_env.connect(Role.LEDGER, "ledger") as probe:
        js = probe.nc.jetstream()
        relay = build_relay(gateway, probe.nc)
        relay.start()
        await _relaying(relay)
        notices = _notices(relaying, relay, postgres_storage)
        notices.start()
        try:
            await asyncio.wait_for(notices.listening.wait(), 10)
            killed = notices.backend_pid
            with caplog.at_level(logging.WARNING, logger="ledger.adapters.append_notices"):
                with psycopg.connect(postgres_storage.postgres_dsn or "", autocommit=True) as db:
                    assert db.execute("SELECT pg_terminate_backend(%s)", (killed,)).fetchone()
                await _until(
                    lambda: asyncio.sleep(
                        0, notices.listening.is_set() and notices.backend_pid != killed
                    ),
                    "listening again on a new connection",
                )
            assert any("not listening" in r.getMessage() for r in caplog.records)

            before = await _work_items(js)
            other.submit(search("op-relisten-0"), ALICE)
            await _until(lambda: _equals(js, before + 1), "relayed after the reconnection")
        finally:
            await notices.stop()
            await relay.stop()
    relaying.close()
    other.close()


async def test_a_copy_another_instance_made_stale_is_dropped_before_a_command_uses_it(
    nats_env: NatsEnv, postgres_storage: StorageConfig
) -> None:
    # The service's own wiring (`ledger.server.app`): B submitted the operation and
    # holds its copy; A leases it. Without the notice, B's next command would run on
    # the copy, fail its append on the version check, and run its turn again.
    a, b = make_ledger(postgres_storage), make_ledger(postgres_storage)
    gateway = LedgerGateway(b)
    async with nats_env.connect(Role.LEDGER, "ledger") as probe:
        relay = build_relay(gateway, probe.nc)
        notices = _append_notices(b, relay)
        assert notices is not None
        notices.start()
        try:
            await asyncio.wait_for(notices.listening.wait(), 10)
            b.submit(search("op-stale-0"), ALICE)
            b.submit(search("op-stale-1"), ALICE)
            copy = b.runner.cached("op-stale-0")
            assert copy is not None and copy.version == 3
            a.lease("op-stale-0", executor="exec-1")
            await _until(
                lambda: asyncio.sleep(0, b.runner.cached("op-stale-0") is None),
                "B's stale copy dropped",
            )
            assert notices.heard == 1
            assert b.runner.cached("op-stale-1") is not None  # nobody else wrote it
            # B answers from the stored state: the lease is A's.
            assert b.status("op-stale-0").state == "executing"
        finally:
            await notices.stop()
    a.close()
    b.close()
