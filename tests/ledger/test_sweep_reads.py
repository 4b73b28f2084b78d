"""`SweepReads`: the sweeps' questions to the operations view, on a connection of their
own (PostgreSQL, where the service asks them off the loop). Each answers what the view
on the ledger's own connection answers; a lost connection fails one sweep, and the
next one asks over a new connection."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import psycopg
import pytest

from ledger import StorageConfig
from ledger.server.sweep_reads import SweepReads
from tests.ledger.helpers import ALICE, email, make_ledger, search, seen_waiting

pytestmark = pytest.mark.anyio


async def test_the_answers_are_the_views_and_a_lost_connection_is_replaced(
    postgres_storage: StorageConfig,
) -> None:
    ledger = make_ledger(postgres_storage)
    ledger.submit(search("op-leased"), ALICE)
    grant = ledger.lease("op-leased", executor="e-1")
    ledger.submit(search("op-ready"), ALICE)
    ledger.submit(email("op-waiting"), ALICE)
    ledger.refresh()
    assert grant.lease_expires_at is not None
    later = grant.lease_expires_at + timedelta(seconds=1)
    reads = SweepReads(ledger)
    try:
        view = ledger.projector
        assert await reads.lease_expiry_candidates(later) == ["op-leased"]
        assert await reads.lease_expiry_candidates(later) == view.lease_expiry_candidates(later)
        assert await reads.lease_expiry_candidates(grant.lease_expires_at - timedelta(1)) == []
        waiting = await reads.waiting_since_before(later)
        assert list(waiting) == view.waiting_since_before(later)
        assert {row[0] for row in waiting} == {"op-ready", "op-waiting"}
        due = ledger.clock() + timedelta(hours=1)
        assert await reads.approval_expiry_candidates(due) == ["op-waiting"]
        assert await reads.approval_expiry_candidates(due) == view.approval_expiry_candidates(due)
        assert await reads.approval_expiry_candidates(ledger.clock()) == []

        # The server drops the sweeps' connection (a restart, a failover).
        dsn = postgres_storage.postgres_dsn or ""
        with psycopg.connect(dsn, autocommit=True) as admin:
            # With a timeout, it returns once the backend is gone.
            admin.execute(
                "SELECT pg_terminate_backend(%s, 5000)", (reads._db._pg.info.backend_pid,)
            )
        with pytest.raises(psycopg.OperationalError):
            await reads.lease_expiry_candidates(later)  # this sweep fails, and says so
        assert await reads.lease_expiry_candidates(later) == ["op-leased"]  # the next asks anew
    finally:
        reads.close()
        ledger.close()


async def test_closing_while_a_question_waits_cancels_it_and_opens_nothing_new(
    postgres_storage: StorageConfig,
) -> None:
    """A sweep stuck on a locked view at stop: `close` cancels the question instead of
    waiting for it (nor would the process's exit wait), and the failed question does
    not open a replacement connection after the close."""
    ledger = make_ledger(postgres_storage)
    ledger.submit(email("op-waiting"), ALICE)
    ledger.refresh()
    reads = SweepReads(ledger)
    dsn = postgres_storage.postgres_dsn or ""
    with psycopg.connect(dsn, autocommit=True) as watcher, psycopg.connect(dsn) as locker:
        locker.execute(f'SET search_path TO "{postgres_storage.postgres_schema}"')
        locker.execute("LOCK TABLE opledger_operations IN ACCESS EXCLUSIVE MODE")
        question = asyncio.ensure_future(reads.approval_expiry_candidates(ledger.clock()))
        pid = reads._db._pg.info.backend_pid
        waiting = await asyncio.to_thread(
            seen_waiting, watcher, "SELECT pid FROM pg_locks WHERE NOT granted AND pid = %s",
            (pid,),
        )
        assert waiting, "the question never waited on the lock"
        reads.close()  # returns at once: it only cancels
        with pytest.raises(psycopg.errors.QueryCanceled):
            await asyncio.wait_for(question, timeout=10)
        assert reads._db is not None and reads._db._pg.closed  # closed by the worker
        with pytest.raises(RuntimeError, match="closed"):
            await reads.approval_expiry_candidates(ledger.clock())
        locker.rollback()
    ledger.close()
