"""On PostgreSQL the sweeps ask the operations view on a thread of their own
(`ledger.server.sweep_reads`): a view that answers slowly (dead row versions piled up
in its state index before a vacuum, or here a lock held on it) never stops the
service's event loop, and the sweeps still expire what ran out, by the ledger's clock.

Against a real nats-server and PostgreSQL: the attack holds an exclusive lock on the
view table until the service has answered a proposal, so a service whose sweep waits
on its loop cannot pass (it answers nothing while the lock is held)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from ledger import StorageConfig
from ledger.client import AgentHostClient
from ledger.nats import (
    NatsServer,
    connect_as,
    connect_options,
    declare_topology,
    generate_credentials,
)
from ledger.server.app import LedgerService, ServiceOptions
from ledger.service import Ledger
from schemas import ledger_operation_id
from tests.ledger.helpers import ALICE, make_ledger, registry_with_limit, search

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

SEARCH = "search_documents"


@dataclass
class World:
    """The running parties, and the ledger's clock to move."""

    ledger: Ledger
    host: AgentHostClient
    now: list[datetime]
    service: LedgerService


@asynccontextmanager
async def _world(tmp_path: Path, storage: StorageConfig) -> AsyncIterator[World]:
    creds = generate_credentials(tmp_path / "creds", hosts=["h1"], tools=[SEARCH])
    now = [datetime.now(UTC)]
    ledger = make_ledger(
        # No budget: a budget count reads the view on purpose, and this test is about
        # the sweeps alone.
        storage, registry=registry_with_limit(None), clock=lambda: now[0]
    )
    with NatsServer(tmp_path / "nats", authorization=creds.authorization_config) as server:

        async def declare(js: Any) -> None:
            await declare_topology(js, [SEARCH], ack_wait_s=10, max_deliver=5)

        service = LedgerService(
            ledger,
            ServiceOptions(
                nats_url=server.url,
                connect_options=connect_options(creds.ledger),
                declare=declare,
                sweep_interval=timedelta(milliseconds=50),
                redispatch_after=timedelta(seconds=1),
            ),
        )
        await service.start()
        host = AgentHostClient(await connect_as(server.url, creds.host("h1")), "h1")
        try:
            yield World(ledger, host, now, service)
        finally:
            await host.close()
            await service.stop()
            ledger.close()


def _sweep_waiting(service: LedgerService, watcher: psycopg.Connection[Any]) -> bool:
    """Whether the sweeps' connection waits for a lock, polled for up to 10 s."""
    for _ in range(200):
        reads = service._sweep_reads
        assert reads is not None, "no sweeps off the loop on PostgreSQL"
        pid = reads._db._pg.info.backend_pid
        if watcher.execute(
            "SELECT 1 FROM pg_locks WHERE NOT granted AND pid = %s", (pid,)
        ).fetchall():
            return True
        time.sleep(0.05)
    return False


async def _until(check: Any, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not within the time allowed"
        await asyncio.sleep(0.05)


async def test_a_locked_view_never_stops_the_loop_and_leases_still_expire(
    tmp_path: Path, postgres_storage: StorageConfig
) -> None:
    async with _world(tmp_path, postgres_storage) as world:
        ledger = world.ledger
        # A lease that runs out by the ledger's clock, not the wall's: the sweep must
        # ask the view with the ledger's "now" and let the aggregate decide.
        ledger.submit(search("op-leased"), ALICE)
        ledger.lease("op-leased", executor="gone-1")
        world.now[0] += timedelta(hours=1)
        await _until(lambda: ledger.status("op-leased").state == "outcome_unknown")

        dsn = postgres_storage.postgres_dsn or ""
        schema = postgres_storage.postgres_schema
        with psycopg.connect(dsn, autocommit=True) as watcher, psycopg.connect(dsn) as locker:
            # The service shares this test's event loop: whatever blocks, blocks on a
            # thread here, or the service could not run at all meanwhile.
            locker.execute(f'SET search_path TO "{schema}"')
            await asyncio.to_thread(
                locker.execute, "LOCK TABLE opledger_operations IN ACCESS EXCLUSIVE MODE"
            )
            # A service whose sweep waits on its loop would never answer, nor let this
            # test go on: after 15 s a watchdog lets go of the lock, and says so.
            released_by_watchdog: list[bool] = []

            def let_go() -> None:
                released_by_watchdog.append(True)
                locker.rollback()

            watchdog = threading.Timer(15.0, let_go)
            watchdog.start()
            try:
                # One of the sweep's questions is stuck behind the lock, on the sweeps'
                # own connection (whichever it is now: a question that waits too long is
                # cancelled and the next one asks over a new connection)...
                stuck = await asyncio.to_thread(_sweep_waiting, world.service, watcher)
                assert stuck, "the sweep never asked the view"
                # ...while the service answers a proposal, end to end over NATS.
                reply = await asyncio.wait_for(
                    world.host.propose(search("op-meanwhile"), ALICE), timeout=30
                )
            finally:
                watchdog.cancel()
                watchdog.join()
            assert not released_by_watchdog, "answered only once the view was free again"
            assert reply.error is None and reply.state == "ready"
            locker.rollback()  # the lock goes; the sweeps go on
        # Proposed over NATS: the ledger knows it in the host's namespace.
        meanwhile = ledger_operation_id("h1", "op-meanwhile")
        ledger.lease(meanwhile, executor="gone-2")
        world.now[0] += timedelta(hours=1)
        await _until(lambda: ledger.status(meanwhile).state == "outcome_unknown")
