"""The recorders: kept result texts in the events' transaction (both backends), and the
PostgreSQL recorder's array insert, which stores exactly what the library's would.

Both recorders write the same events, awkward ones included (states with NUL and
bytes that are not UTF-8, quotes and backslashes in IDs and topics, an empty
state), each into its own schema; the rows read back straight from SQL are
identical, and a duplicate (ID, version) is the library's `IntegrityError` with
nothing of its batch stored.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import psycopg
import psycopg.conninfo
import pytest
from eventsourcing.persistence import (
    IntegrityError,
    OperationalError,
    PersistenceError,
    StoredEvent,
)
from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore
from psycopg import Notify

from ledger import Ledger, StorageConfig
from ledger.adapters.creation_lock import CREATION_LOCK_SQL, creation_lock_keys
from ledger.adapters.eventstore import EventStoreApp
from ledger.adapters.notices import AppendNotice, notice_head, notice_payloads, read_notice
from ledger.adapters.recorders import ArrayInsertRecorder
from ledger.adapters.sql import SqlDatabase
from ledger.domain.states import ResultDisposition
from tests.conftest import drop_schema, postgres_storage_or_skip
from tests.ledger.helpers import (
    ALICE,
    CREATION_LOCK_WAITS,
    SEAL_KEY,
    event_types,
    make_ledger,
    result,
    search,
    seen_waiting,
)

# One worker for this and tests/nats/test_append_notices.py (pytest-xdist): the
# headless notices sent here would be counted there, on the database's one channel.
pytestmark = pytest.mark.xdist_group("append-notices")

KEPT = {"items": [], "truncated": False, "next_cursor": "n1"}

_EVENTS = [
    StoredEvent("host/op-1", 1, "ledger.domain.operation:Operation.Proposed", b'{"a": 1}'),
    StoredEvent(
        "host/op-1", 2, "ledger.domain.operation:Operation.Validated", b"\x00\xff\x80'\""
    ),
    StoredEvent("host/o'p\"2\\", 1, "topic with 'quotes' and \\ backslash", b""),
    StoredEvent("host/op-3", 7, "t", bytes(range(256)) * 40),
]


@pytest.fixture
def two_stores() -> Iterator[tuple[EventStoreApp, PostgresApplicationRecorder, StorageConfig]]:
    ours = postgres_storage_or_skip()
    library = postgres_storage_or_skip()
    SqlDatabase(ours)  # creates the schema the events use
    SqlDatabase(library)
    app = EventStoreApp(ours)
    env = {**library.eventsourcing_env()}
    env.pop("APPLICATION_RECORDER_TOPIC")
    plain = PostgresApplicationRecorder  # what the library builds without the setting
    keep = _library_app(library, env)  # the app owns the recorder's pool: kept alive
    other = keep.recorder
    assert isinstance(other, plain) and not isinstance(other, ArrayInsertRecorder)
    try:
        yield app, other, ours
        del keep
    finally:
        drop_schema(ours)
        drop_schema(library)


def _library_app(storage: StorageConfig, env: dict[str, str]) -> EventStoreApp:
    class Plain(EventStoreApp):
        def __init__(self) -> None:
            self.storage = storage
            super(EventStoreApp, self).__init__(env=env)

    return Plain()


def _rows(recorder: PostgresApplicationRecorder) -> list[tuple[object, ...]]:
    with recorder.datastore.get_connection() as conn, conn.cursor() as cursor:
        cursor.execute(
            f'SELECT notification_id, originator_id, originator_version, topic, state'
            f' FROM "{recorder.datastore.schema}".{recorder.events_table_name}'
            " ORDER BY notification_id"
        )
        return [tuple(row.values()) for row in cursor.fetchall()]


def _drop_append_function(storage: StorageConfig) -> None:
    """Drop the schema's one append function, as a schema made without it would be."""
    with psycopg.connect(storage.postgres_dsn or "", autocommit=True) as conn:
        found = conn.execute(
            "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n"
            " ON n.oid = p.pronamespace WHERE n.nspname = %s AND p.proname LIKE"
            " 'opledger_append_%%'",
            (storage.postgres_schema,),
        ).fetchall()
        assert len(found) == 1
        conn.execute(f"DROP FUNCTION {found[0][0]}")


def test_the_service_stores_events_with_the_array_recorder(
    two_stores: tuple[EventStoreApp, PostgresApplicationRecorder, StorageConfig],
) -> None:
    app, _, _ = two_stores
    assert isinstance(app.recorder, ArrayInsertRecorder)


def test_array_insert_stores_the_same_rows_and_ids_as_the_library(
    two_stores: tuple[EventStoreApp, PostgresApplicationRecorder, StorageConfig],
) -> None:
    app, library, _ = two_stores
    ours = app.recorder
    assert isinstance(ours, ArrayInsertRecorder)
    ids_ours = [ours.insert_events(_EVENTS[:2]), ours.insert_events(_EVENTS[2:])]
    ids_library = [library.insert_events(_EVENTS[:2]), library.insert_events(_EVENTS[2:])]
    assert ids_ours == ids_library == [[1, 2], [3, 4]]
    stored = _rows(ours)
    assert stored == _rows(library)
    assert [bytes(cast(bytes, row[4])) for row in stored] == [e.state for e in _EVENTS]
    assert [row[1] for row in stored] == [e.originator_id for e in _EVENTS]


def test_a_duplicate_version_is_an_integrity_error_and_stores_nothing_of_its_batch(
    two_stores: tuple[EventStoreApp, PostgresApplicationRecorder, StorageConfig],
) -> None:
    app, _, storage = two_stores
    app.recorder.insert_events(_EVENTS[:1])
    fresh = StoredEvent("host/op-9", 1, "t", b"{}")
    with pytest.raises(IntegrityError):
        app.recorder.insert_events([fresh, _EVENTS[0]])
    with psycopg.connect(storage.postgres_dsn or "") as conn:
        count = conn.execute(
            f'SELECT count(*) FROM "{storage.postgres_schema}".opledger_events'
        ).fetchone()
    assert count == (1,)
    # And the recorder goes on working after the refused batch (the refused one
    # used up sequence numbers, as the library's does: positions may have gaps).
    assert len(app.recorder.insert_events([fresh]) or []) == 1


def _notices_of(
    listener: psycopg.Connection[Any],
    count: int,
    ours: ArrayInsertRecorder,
    *,
    pids: Collection[int] = (),
) -> list[Notify]:
    """The next `count` notices on `listener` from this test's writers: those naming
    `ours`'s store, and any sent by a session in `pids`. The channel is the whole
    database's (named after the table, in every schema), and a test running beside
    this one (pytest-xdist) notifies on it too; waits up to 5 s in all."""
    kept: list[Notify] = []
    deadline = time.monotonic() + 5
    while len(kept) < count and (left := deadline - time.monotonic()) > 0:
        for notice in listener.notifies(timeout=left, stop_after=1):
            head = notice_head(notice.payload)
            if notice.pid in pids or (head is not None and head[0] == ours.notice_store):
                kept.append(notice)
    return kept


def test_an_append_holds_the_table_lock_to_its_commit_so_ids_follow_commit_order(
    two_stores: tuple[EventStoreApp, PostgresApplicationRecorder, StorageConfig],
) -> None:
    # Another writer (another service instance) is inside an append: it called the
    # append function and has not committed. Our append must wait for it (the
    # library's EXCLUSIVE lock, now taken inside the function), or a reader tailing
    # the log could pass over the other writer's lower IDs before they commit.
    app, _, storage = two_stores
    ours = app.recorder
    assert isinstance(ours, ArrayInsertRecorder)
    dsn, schema = storage.postgres_dsn or "", storage.postgres_schema
    table = f'"{schema}".opledger_events'
    with (
        psycopg.connect(dsn, autocommit=True) as listener,
        psycopg.connect(dsn, autocommit=True) as watcher,
        psycopg.connect(dsn) as other,
    ):
        listener.execute(f'LISTEN "{ours.channel_name}"')
        rows = other.execute(
            ours._append, (["host/other"], [1], ["t"], [b"{}"], [], [], [], ["host/other"])
        ).fetchall()
        first = rows[0][0]
        held = watcher.execute(
            "SELECT mode, granted FROM pg_locks WHERE relation = %s::regclass AND pid = %s",
            (table, other.info.backend_pid),
        ).fetchall()
        assert ("ExclusiveLock", True) in held
        pool = ThreadPoolExecutor(1)
        appended = pool.submit(ours.insert_events, [StoredEvent("host/ours", 1, "t", b"{}")])
        waiting = seen_waiting(
            watcher,
            "SELECT mode FROM pg_locks WHERE relation = %s::regclass AND NOT granted",
            (table,),
        )
        assert waiting == [("ExclusiveLock",)]
        assert not appended.done()
        other.commit()
        ids = appended.result(timeout=30)
        pool.shutdown()
        assert ids is not None and ids[0] > first
        # Each append notified the log's readers once it committed.
        notices = _notices_of(listener, 2, ours, pids={other.info.backend_pid})
        assert [notice.channel for notice in notices] == [ours.channel_name] * 2
        # The other's was its own text; ours names whose events, which process, and
        # what it appended, for other instances (`ledger.adapters.notices`).
        assert notices[0].payload == "host/other"
        assert read_notice(notices[1].payload) == AppendNotice(
            ours.notice_store, ours.notice_writer, ("host/ours",)
        )


def test_an_append_of_many_operations_names_each_once_in_notices_postgresql_accepts(
    two_stores: tuple[EventStoreApp, PostgresApplicationRecorder, StorageConfig],
) -> None:
    # 120 operations with IDs of the longest kind (257 characters), three events each:
    # 31 KB of names, four times what one notice may carry.
    app, _, storage = two_stores
    ours = app.recorder
    assert isinstance(ours, ArrayInsertRecorder)
    ids = [f"{'h' * 128}/{n:0128d}" for n in range(120)]
    events = [StoredEvent(i, version, "t", b"{}") for i in ids for version in (1, 2, 3)]
    payloads = notice_payloads(ours.notice_store, ours.notice_writer, ids)
    assert len(payloads) > 1 and all(len(p.encode()) < 8000 for p in payloads)
    with psycopg.connect(storage.postgres_dsn or "", autocommit=True) as listener:
        listener.execute(f'LISTEN "{ours.channel_name}"')
        assert ours.insert_events(events)
        notices = _notices_of(listener, len(payloads), ours)
    read = [read_notice(notice.payload) for notice in notices]
    assert all(n is not None and n.writer == ours.notice_writer for n in read)
    assert [i for n in read if n is not None for i in n.operation_ids] == ids


def test_without_its_function_the_recorder_appends_statement_by_statement(
    two_stores: tuple[EventStoreApp, PostgresApplicationRecorder, StorageConfig],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A schema made by an earlier release and served with the library's CREATE_TABLE
    # off has no append function: appends still work, with the same rows, the same
    # duplicate refusal and the texts in the same transaction, and a warning says so.
    app, library, storage = two_stores
    ours = app.recorder
    assert isinstance(ours, ArrayInsertRecorder)
    _drop_append_function(storage)
    with psycopg.connect(storage.postgres_dsn or "", autocommit=True) as listener:
        listener.execute(f'LISTEN "{ours.channel_name}"')
        ids = [ours.insert_events(_EVENTS[:2]), ours.insert_events(_EVENTS[2:])]
        notices = _notices_of(listener, 2, ours)
    # Their notices name what they appended, as the function's do.
    assert [notice.payload for notice in notices] == [
        payload
        for part in (_EVENTS[:2], _EVENTS[2:])
        for payload in notice_payloads(
            ours.notice_store, ours.notice_writer, (str(e.originator_id) for e in part)
        )
    ]
    assert ids == [library.insert_events(_EVENTS[:2]), library.insert_events(_EVENTS[2:])]
    assert _rows(ours) == _rows(library)
    assert "append function is missing" in caplog.text
    with pytest.raises(IntegrityError):
        ours.insert_events([StoredEvent("host/op-9", 1, "t", b"{}"), _EVENTS[0]])
    assert len(_rows(ours)) == 4


def test_recorders_of_long_table_names_each_append_to_their_own_table() -> None:
    # The function is named after its text, so two tables whose names share a long
    # prefix never share one (PostgreSQL cuts names over 63 characters).
    storage = postgres_storage_or_skip()
    SqlDatabase(storage)  # creates the schema
    params = psycopg.conninfo.conninfo_to_dict(storage.postgres_dsn or "")
    datastore = PostgresDatastore(
        dbname=str(params.get("dbname", "postgres")),
        host=str(params.get("host", "127.0.0.1")),
        port=str(params.get("port", "5432")),
        user=str(params.get("user", "postgres")),
        password=str(params.get("password", "")),
        schema=storage.postgres_schema or "",
        originator_id_type="text",
    )
    try:
        prefix = "t" * 54
        alpha = ArrayInsertRecorder(datastore, events_table_name=f"{prefix}_alpha")
        bravo = ArrayInsertRecorder(datastore, events_table_name=f"{prefix}_bravo")
        alpha.create_table()
        bravo.create_table()
        alpha.insert_events(_EVENTS[:1])
        bravo.insert_events(_EVENTS[:2])
        assert (len(_rows(alpha)), len(_rows(bravo))) == (1, 2)
    finally:
        datastore.close()
        drop_schema(storage)


def test_services_starting_together_create_the_tables_one_at_a_time(
    postgres_storage: StorageConfig,
) -> None:
    # Two services starting at once both replace the append functions; PostgreSQL
    # refuses the second of two concurrent replacements, and a service failed to
    # start. Here a creator holds the lock (as a starting service would): another
    # one's table creation is seen waiting for it, and finishes once it is released.
    SqlDatabase(postgres_storage)
    EventStoreApp(postgres_storage)  # an existing database, as on every restart
    dsn = postgres_storage.postgres_dsn or ""
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as watcher:
        holder.execute(CREATION_LOCK_SQL, creation_lock_keys(postgres_storage.postgres_schema))
        pool = ThreadPoolExecutor(1)
        started = pool.submit(EventStoreApp, postgres_storage)
        waiting = seen_waiting(
            watcher,
            CREATION_LOCK_WAITS,
            creation_lock_keys(postgres_storage.postgres_schema),
        )
        assert waiting == [("advisory",)]
        assert not started.done()
        holder.commit()
        assert isinstance(started.result(timeout=30), EventStoreApp)
        pool.shutdown()


# ------------------------------------------------- kept results with the events


def test_a_result_and_its_kept_text_are_stored_together_or_not_at_all(
    storage: StorageConfig,
) -> None:
    """The text a settling event binds goes in the events' own transaction: with the
    results table gone (the write of the text fails), the settling event is not stored
    either, so no event ever names a text that was never kept; once the table is back,
    the same result is recorded with its text, and verify finds nothing."""
    ledger = make_ledger(storage)
    ledger.submit(search("op-1"), ALICE)
    grant = ledger.lease("op-1", executor="exec-1")
    _stored_together_or_not_at_all(ledger, grant.fencing_token)


def _stored_together_or_not_at_all(ledger: Ledger, token: int | None) -> None:
    """Record op-1's result with the results table gone, then back (see above)."""
    before = event_types(ledger, "op-1")
    ledger.db.execute("ALTER TABLE opledger_results RENAME TO opledger_results_away")
    with pytest.raises(PersistenceError):  # the library's wrapping of the database error
        ledger.record_result(result("op-1", token, data=KEPT))
    ledger.db.execute("ALTER TABLE opledger_results_away RENAME TO opledger_results")
    assert event_types(ledger, "op-1") == before  # nothing of the failed transaction
    assert ledger.db.query("SELECT COUNT(*) FROM opledger_results")[0][0] == 0

    ledger.record_result(result("op-1", token, data=KEPT))
    assert event_types(ledger, "op-1")[-1] == "Succeeded"
    status = ledger.status("op-1")
    assert status.result is not None and status.result.data == KEPT
    ledger.refresh()
    report = ledger.audit.verify(trusted_keys=[SEAL_KEY.public_key])
    assert report.ok, report.findings


def test_without_the_append_function_a_result_and_its_text_still_go_in_together(
    postgres_storage: StorageConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """The library's statements, used where the append function is missing, keep the
    texts in the events' transaction too: the same sequence as above."""
    ledger = make_ledger(postgres_storage)
    ledger.submit(search("op-1"), ALICE)
    grant = ledger.lease("op-1", executor="exec-1")
    _drop_append_function(postgres_storage)
    _stored_together_or_not_at_all(ledger, grant.fencing_token)
    assert "append function is missing" in caplog.text


def test_a_batch_of_results_keeps_its_texts_in_its_one_append(storage: StorageConfig) -> None:
    """Results recorded together (the service's batch): one append carries every settling
    event and every text they bind; the same results again keep nothing more."""
    ledger = make_ledger(storage)
    grants = {}
    for n in (1, 2, 3):
        ledger.submit(search(f"op-{n}"), ALICE)
        grants[n] = ledger.lease(f"op-{n}", executor="exec-1").fencing_token
    envelopes = [result(f"op-{n}", grants[n], data=KEPT) for n in (1, 2, 3)]
    appends: list[int] = []
    put = ledger.runner.events.events.put

    def counted(events: Any, **kwargs: Any) -> Any:
        appends.append(len(kwargs.get("results", ())))
        return put(events, **kwargs)

    ledger.runner.events.events.put = counted  # type: ignore[method-assign,assignment]
    ledger.recording.record_results(envelopes)
    assert appends == [3]  # one append, three texts in it
    ledger.recording.record_results(envelopes)  # redelivered: duplicates, nothing kept
    rows = ledger.db.query("SELECT result_ref FROM opledger_results ORDER BY result_ref")
    assert [str(row[0]) for row in rows] == [f"result:op-{n}:1" for n in (1, 2, 3)]
    for n in (1, 2, 3):
        status = ledger.status(f"op-{n}")
        assert status.result is not None and status.result.data == KEPT


def test_a_result_naming_another_attempt_under_the_lease_is_refused_and_keeps_nothing(
    storage: StorageConfig,
) -> None:
    """An executor holding attempt 2's lease reports a success as attempt 1, whose failed
    text is kept: refused, so no event binds a text another one already holds."""
    now = [datetime.now(UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    ledger.submit(search("op-1"), ALICE)
    first = ledger.lease("op-1", executor="exec-1")
    flaky = {"code": "UPSTREAM", "message": "flaky", "category": "TRANSIENT", "retryable": True}
    ledger.record_result(result("op-1", first.fencing_token, ok=False, error=flaky))
    now[0] += timedelta(seconds=30)
    second = ledger.lease("op-1", executor="exec-1")
    assert second.attempt == 2
    before = event_types(ledger, "op-1")
    spoofed = result("op-1", second.fencing_token, attempt=1, data=KEPT)
    assert ledger.record_result(spoofed) is ResultDisposition.REFUSED
    assert event_types(ledger, "op-1") == before
    assert ledger.record_result(result("op-1", second.fencing_token, attempt=2, data=KEPT)) is (
        ResultDisposition.ACCEPTED
    )
    ledger.refresh()
    report = ledger.audit.verify(trusted_keys=[SEAL_KEY.public_key])
    assert report.ok, report.findings


def test_a_batch_that_fails_midway_keeps_no_text_for_later(
    storage: StorageConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database fails while a batch of results is read (after an earlier item kept
    its text): nothing of it is stored, and that text does not ride along with a later,
    unrelated append of the same operation (verify would name it as bound by nothing)."""
    now = [datetime.now(UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    grants = {}
    for n in (1, 2):
        ledger.submit(search(f"op-{n}"), ALICE)
        grants[n] = ledger.lease(f"op-{n}", executor="exec-1").fencing_token
    runner = ledger.runner
    # op-2 is read from the store (as after a restart), on its own: several would be
    # read together before any command ran (`CommandRunner.load`).
    runner.forget("op-2")
    get = runner.get

    def failing_get(operation_id: str, **kwargs: Any) -> Any:
        if operation_id == "op-2":
            raise OperationalError("connection lost")
        return get(operation_id, **kwargs)

    monkeypatch.setattr(runner, "get", failing_get)
    with pytest.raises(OperationalError):
        ledger.recording.record_results(
            [result(f"op-{n}", grants[n], data=KEPT) for n in (1, 2)]
        )
    monkeypatch.setattr(runner, "get", get)
    now[0] += timedelta(hours=1)  # the lease ran out before the result came again
    ledger.expire_leases()
    ledger.lease("op-1", executor="exec-2")  # a later append of op-1
    assert ledger.db.query("SELECT COUNT(*) FROM opledger_results")[0][0] == 0
    ledger.refresh()
    report = ledger.audit.verify(trusted_keys=[SEAL_KEY.public_key])
    assert report.ok, report.findings
