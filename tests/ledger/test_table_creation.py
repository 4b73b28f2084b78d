"""Processes opening one fresh PostgreSQL database together create its tables one at a time.

`CREATE ... IF NOT EXISTS` is not safe against itself on PostgreSQL: two sessions that
both find a schema or table absent both create it, and the second one's commit fails
on the catalog's unique index. Every creator therefore takes the creators' advisory
lock first (`ledger.adapters.creation_lock`). These tests show each creator waiting for
a holder of that lock, and services starting together on a fresh schema all starting.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from ledger import StorageConfig
from ledger.adapters.creation_lock import CREATION_LOCK_SQL, creation_lock_keys
from ledger.adapters.eventstore import EventStoreApp
from ledger.adapters.results import ResultStore
from ledger.adapters.sql import SqlDatabase
from ledger.audit.seal import Sealer
from ledger.bootstrap import build_ledger
from ledger.projections.operations_view import OperationsProjector
from ledger.server.relay.position import RelayPositions
from tests.conftest import drop_schema, postgres_storage_or_skip
from tests.ledger.helpers import CREATION_LOCK_WAITS, SEAL_KEY, seen_waiting

Creator = Callable[[StorageConfig, EventStoreApp | None], object]
"""(storage, the event store opened before the lock was held, if the schema has one)
→ what it creates; the creator under test is the only one that can wait."""


def _open_database(storage: StorageConfig, _: EventStoreApp | None) -> object:
    return SqlDatabase(storage)  # creates the schema


def _event_store(storage: StorageConfig, _: EventStoreApp | None) -> object:
    return EventStoreApp(storage)  # the library's types, tables and functions, and ours


def _results(storage: StorageConfig, _: EventStoreApp | None) -> object:
    return ResultStore(SqlDatabase(storage))


def _relay_positions(storage: StorageConfig, _: EventStoreApp | None) -> object:
    return RelayPositions(SqlDatabase(storage))


def _operations_view(storage: StorageConfig, events: EventStoreApp | None) -> object:
    assert events is not None
    return OperationsProjector(SqlDatabase(storage), events.recorder)


def _sealer(storage: StorageConfig, events: EventStoreApp | None) -> object:
    assert events is not None
    return Sealer(SqlDatabase(storage), events.recorder, SEAL_KEY)


def _whole_ledger(storage: StorageConfig, _: EventStoreApp | None) -> object:
    return build_ledger(storage)


@pytest.mark.parametrize(
    "create",
    [
        _open_database,
        _event_store,
        _results,
        _relay_positions,
        _operations_view,
        _sealer,
        _whole_ledger,
    ],
    ids=[
        "schema", "events", "results", "relay-positions", "operations-view", "seal",
        "build-ledger",
    ],
)
def test_every_creator_waits_for_the_creators_lock(
    postgres_storage: StorageConfig, create: Creator, caplog: pytest.LogCaptureFixture
) -> None:
    # Each creator, opened while another process holds the lock (as one starting
    # at the same moment would), is seen waiting for it and creates nothing
    # until it is released. A creator that skipped the lock would finish at once.
    # What it needs is opened before the lock is held, so that only its own
    # creation can wait (the event store's would wait for it too).
    events = None
    if create is not _open_database:
        SqlDatabase(postgres_storage)  # the schema exists
    if create not in (_open_database, _event_store):
        events = EventStoreApp(postgres_storage)  # and the events; not the rest
    dsn = postgres_storage.postgres_dsn or ""
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as watcher:
        holder.execute(CREATION_LOCK_SQL, creation_lock_keys(postgres_storage.postgres_schema))
        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(create, postgres_storage, events)
            waiting = seen_waiting(
                watcher,
                CREATION_LOCK_WAITS,
                creation_lock_keys(postgres_storage.postgres_schema),
                unless=started.done,
            )
            assert waiting, f"finished without the lock: {started.result()!r}"
            assert not started.done()
            if create is _event_store:
                # Not even the library's composite types, which it creates each in
                # a transaction of its own before its tables.
                types = watcher.execute(
                    "SELECT t.typname FROM pg_type t JOIN pg_namespace n"
                    " ON n.oid = t.typnamespace WHERE n.nspname = %s",
                    (postgres_storage.postgres_schema,),
                ).fetchall()
                assert types == []
            holder.commit()
            started.result(timeout=30)
    # The wait is said, so that a start hanging behind another creator is visible.
    waits = [r for r in caplog.records if "waiting for another process" in r.getMessage()]
    assert waits and postgres_storage.postgres_schema in waits[0].getMessage()


def test_services_opening_one_fresh_database_together_all_start() -> None:
    # The race itself, without a lock held by the test: four services open one
    # fresh schema at the same moment, six times. Before every creator took the
    # lock, 31 of 40 starts (ten rounds) failed in each of three runs, on
    # `pg_namespace_nspname_index` (the schema) or `pg_type_typname_nsp_index`
    # (a table's or the library's composite type).
    failures: list[str] = []
    for _ in range(6):
        storage = postgres_storage_or_skip()
        try:
            with ThreadPoolExecutor(4) as pool:
                starts = [pool.submit(build_ledger, storage) for _ in range(4)]
                for start in starts:
                    try:
                        start.result(timeout=60)
                    except Exception as exc:  # the failure is what is counted
                        failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        finally:
            drop_schema(storage)
    assert failures == []


def test_creators_in_another_schema_do_not_wait(postgres_storage: StorageConfig) -> None:
    # One lock per schema: a creator holding one schema's lock (a slow start, an
    # operator's open transaction) never holds up a deployment in another schema.
    other = postgres_storage_or_skip()
    dsn = postgres_storage.postgres_dsn or ""
    try:
        with psycopg.connect(dsn) as holder:
            holder.execute(CREATION_LOCK_SQL, creation_lock_keys(postgres_storage.postgres_schema))
            with ThreadPoolExecutor(1) as pool:
                pool.submit(build_ledger, other).result(timeout=30)
    finally:
        drop_schema(other)


def test_the_default_schema_has_the_librarys_name() -> None:
    # The library reads an empty schema as `public`: both name one lock.
    assert creation_lock_keys("") == creation_lock_keys("public")
    assert creation_lock_keys("a") != creation_lock_keys("b")
