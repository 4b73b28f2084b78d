"""The event recorders: the library's, with two changes that save the service time.

Kept result texts go in the events' own transaction. A result's settling event
records the hash of the exact envelope text the ledger keeps
(`ledger.adapters.results`); the text used to be written in a transaction of
its own once the events were stored, a second commit per batch of results and
a window in which a crash left an event naming a text that was never kept.
Here the recorders take the texts as `insert_events(..., results=rows)` and
insert them in the same transaction as the events (`CommandRunner.save` passes
them): both are stored, or neither.

On PostgreSQL, events go in as four plain arrays. `eventsourcing`'s recorder
sends a batch of events as one array of a composite type
(`unnest(%s::stored_event[])`), which psycopg dumps in its text form, in
Python: every event's state escaped to hex and quoted by a regular expression.
In the ledger service that was a quarter of a millisecond of CPU per operation
on its event loop (`bench/e2e_bench.py --profile`, about 50 µs per event);
four arrays of plain types in binary are dumped by psycopg's C layer (25
events of 450 bytes per transaction, through the library's own `insert_events`:
2.45 against 1.44 ms per transaction).

The library's database-function insert (`POSTGRES_ENABLE_DB_FUNCTIONS`) would
bypass both, so `StorageConfig.eventsourcing_env` pins it off.

Everything else is the library's, unchanged: the tables, the EXCLUSIVE table
lock that makes commit order the notification order on PostgreSQL, the
NOTIFY, the new notification IDs and the translation of a duplicate (ID,
version) into `IntegrityError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eventsourcing.persistence import StoredEvent
from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore
from eventsourcing.sqlite import SQLiteApplicationRecorder, SQLiteCursor, SQLiteDatastore
from psycopg import Cursor
from psycopg.rows import DictRow
from psycopg.sql import SQL, Composed, Identifier

__all__ = [
    "POSTGRES_RECORDER_TOPIC",
    "SQLITE_RECORDER_TOPIC",
    "ArrayInsertRecorder",
    "KeptResultRow",
    "SQLiteResultsRecorder",
]

KeptResultRow = tuple[str, str, str]
"""(result reference, operation ID, exact envelope text): a row of `opledger_results`."""

# `ledger.adapters.results.RESULTS_TABLE` (not imported: that module's connection
# imports the storage settings, which import this). The first text kept under a
# reference wins.
_RESULTS = "opledger_results"
_INSERT_RESULTS = (
    "INSERT INTO {table} (result_ref, operation_id, envelope) VALUES ({marks})"
    " ON CONFLICT (result_ref) DO NOTHING"
)


class ArrayInsertRecorder(PostgresApplicationRecorder):
    """`PostgresApplicationRecorder`, with events inserted from plain arrays in binary and
    kept result texts (`results=`) in the same transaction."""

    def __init__(
        self, datastore: PostgresDatastore, *, events_table_name: str = "stored_events"
    ) -> None:
        super().__init__(datastore, events_table_name=events_table_name)
        self._insert_arrays: Composed = SQL(
            "INSERT INTO {schema}.{table} (originator_id, originator_version, topic, state)"
            " SELECT * FROM unnest(%b::text[], %b::int8[], %b::text[], %b::bytea[])"
            " RETURNING notification_id"
        ).format(
            schema=Identifier(datastore.schema),
            table=Identifier(events_table_name),
        )
        self._insert_results: Composed = SQL(
            _INSERT_RESULTS.format(table="{schema}.{table}", marks="%s, %s, %s")
        ).format(schema=Identifier(datastore.schema), table=Identifier(_RESULTS))

    def _insert_stored_events(
        self,
        curs: Cursor[DictRow],
        stored_events: Sequence[StoredEvent],
        *,
        results: Sequence[KeptResultRow] = (),
        **_: Any,
    ) -> None:
        # The library's order: lock, notify, insert (its caller syncs the
        # pipeline and reads the RETURNING rows). The kept texts go in under the
        # events table's lock, so two writers never wait on each other's rows.
        self._lock_table(curs)
        self._notify_channel(curs)
        if results:
            curs.executemany(self._insert_results, results)
        curs.execute(
            self._insert_arrays,
            (
                [str(event.originator_id) for event in stored_events],
                [event.originator_version for event in stored_events],
                [event.topic for event in stored_events],
                [bytes(event.state) for event in stored_events],
            ),
            prepare=True,
        )


class SQLiteResultsRecorder(SQLiteApplicationRecorder):
    """`SQLiteApplicationRecorder`, with kept result texts (`results=`) in the events'
    transaction."""

    def __init__(self, datastore: SQLiteDatastore, events_table_name: str = "stored_events"):
        super().__init__(datastore, events_table_name)
        self._insert_results = _INSERT_RESULTS.format(table=_RESULTS, marks="?, ?, ?")

    def _insert_events(
        self,
        c: SQLiteCursor,
        stored_events: Sequence[StoredEvent],
        *,
        results: Sequence[KeptResultRow] = (),
        **kwargs: Any,
    ) -> Sequence[int] | None:
        if results:
            c.executemany(self._insert_results, results)
        return super()._insert_events(c, stored_events, **kwargs)


POSTGRES_RECORDER_TOPIC = f"{__name__}:{ArrayInsertRecorder.__name__}"
"""The PostgreSQL recorder's topic, for the library's `APPLICATION_RECORDER_TOPIC`."""
SQLITE_RECORDER_TOPIC = f"{__name__}:{SQLiteResultsRecorder.__name__}"
"""The SQLite recorder's topic, for the library's `APPLICATION_RECORDER_TOPIC`."""
