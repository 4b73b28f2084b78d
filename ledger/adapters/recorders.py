"""The event recorders: the library's, with two changes that save the service time.

Kept result texts go in the events' own transaction. A result's settling event
records the hash of the exact envelope text the ledger keeps
(`ledger.adapters.results`); the text used to be written in a transaction of
its own once the events were stored, a second commit per batch of results and
a window in which a crash left an event naming a text that was never kept.
Here the recorders take the texts as `insert_events(..., results=rows)` and
insert them in the same transaction as the events (`CommandRunner.save` passes
them): both are stored, or neither.

On PostgreSQL, events go in as plain arrays, and an append is one statement.
`eventsourcing`'s recorder sends a batch of events as one array of a composite
type (`unnest(%s::stored_event[])`), which psycopg dumps in its text form, in
Python: every event's state escaped to hex and quoted by a regular expression.
In the ledger service that was a quarter of a millisecond of CPU per operation
on its event loop (`bench/e2e_bench.py --profile`, about 50 µs per event);
arrays of plain types in binary are dumped by psycopg's C layer (25 events of
450 bytes per transaction, through the library's own `insert_events`: 2.45
against 1.44 ms per transaction). And the library sends four statements per
append in a pipeline between BEGIN and COMMIT (lock timeout, lock, NOTIFY,
insert); here one database function, created with the library's tables and
named after its own text, runs those same statements in that order, the kept
texts' insert among them, called in autocommit as a transaction of its own.
At a moderate rate, where an append holds a few events, that halved an
append's CPU on the event loop and cut the median latency at 200
operations/s by a third (the function's docstring and issue 15's note give
the figures).

The library's own database-function insert (`POSTGRES_ENABLE_DB_FUNCTIONS`)
would bypass all this (it inserts no texts, and takes no table lock), so
`StorageConfig.eventsourcing_env` pins it off.

The NOTIFY stays on the library's channel, in the library's place, but says
more: whose events, which process, which operations (`ledger.adapters.notices`),
for the other service instances that listen (`ledger.adapters.append_notices`).

Everything else is the library's, unchanged: the tables, the EXCLUSIVE table
lock that makes commit order the notification order on PostgreSQL, the new
notification IDs and the translation of a duplicate (ID, version) into
`IntegrityError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from eventsourcing.persistence import (
    IntegrityError,
    InterfaceError,
    OperationalError,
    ProgrammingError,
    StoredEvent,
)
from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore
from eventsourcing.sqlite import SQLiteApplicationRecorder, SQLiteCursor, SQLiteDatastore
from eventsourcing.utils import retry
from psycopg import Cursor
from psycopg.errors import DuplicateObject, UndefinedFunction
from psycopg.rows import DictRow
from psycopg.sql import SQL, Composed, Identifier, Literal

from ledger.adapters.creation_lock import take_creation_lock
from ledger.adapters.notices import new_writer, notice_payloads

__all__ = [
    "POSTGRES_RECORDER_TOPIC",
    "SQLITE_RECORDER_TOPIC",
    "ArrayInsertRecorder",
    "KeptResultRow",
    "SQLiteResultsRecorder",
]

_log = logging.getLogger(__name__)

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
    """`PostgresApplicationRecorder`, with each append one call of a database function:
    events inserted from plain arrays in binary, kept result texts (`results=`) in the
    same transaction."""

    def __init__(
        self, datastore: PostgresDatastore, *, events_table_name: str = "stored_events"
    ) -> None:
        super().__init__(datastore, events_table_name=events_table_name)
        schema, table = Identifier(datastore.schema), Identifier(events_table_name)
        # The library's statements, in its order: lock timeout, the EXCLUSIVE lock
        # that makes commit order the notification order, NOTIFY, then the rows. The
        # kept texts go in under the events table's lock, so two writers never wait
        # on each other's rows.
        body = SQL(
            " RETURNS SETOF bigint LANGUAGE plpgsql AS $BODY$"
            " DECLARE notice text;"
            " BEGIN"
            "  SET LOCAL lock_timeout = '{lock_timeout}s';"
            "  LOCK TABLE {schema}.{table} IN EXCLUSIVE MODE;"
            # What was appended, named: the operation IDs, in payloads under
            # PostgreSQL's 8,000 bytes (`append_notices`), so that another instance
            # drops its copies of them before it acts on a stale one.
            "  IF cardinality(notices) = 0 THEN"
            "   NOTIFY {channel};"
            "  ELSE"
            "   FOREACH notice IN ARRAY notices LOOP"
            "    PERFORM pg_notify({channel_name}, notice);"
            "   END LOOP;"
            "  END IF;"
            # Only when there are texts: an event store without a ledger (the ledger
            # bench) has no results table.
            "  IF cardinality(refs) > 0 THEN"
            "   INSERT INTO {schema}.{results} (result_ref, operation_id, envelope)"
            "    SELECT * FROM unnest(refs, operations, envelopes)"
            "    ON CONFLICT (result_ref) DO NOTHING;"
            "  END IF;"
            "  RETURN QUERY"
            "   INSERT INTO {schema}.{table} (originator_id, originator_version, topic, state)"
            "   SELECT * FROM unnest(ids, versions, topics, states)"
            "   RETURNING notification_id;"
            " END;"
            " $BODY$"
        ).format(
            schema=schema,
            table=table,
            results=Identifier(_RESULTS),
            lock_timeout=datastore.lock_timeout,
            channel=Identifier(self.channel_name),
            channel_name=Literal(self.channel_name),
        )
        # Named after its own text: instances of two releases (a rolling upgrade)
        # each call the body they were built with, never one another's, and the
        # name stays short whatever the table is called (PostgreSQL would cut a
        # name over 63 characters, and two tables' functions could then be one).
        digest = hashlib.sha256(body.as_string(None).encode()).hexdigest()[:16]
        function = Identifier(f"opledger_append_{digest}")
        self.sql_create_statements.append(
            SQL(
                "CREATE OR REPLACE FUNCTION {schema}.{function}("
                " ids text[], versions int8[], topics text[], states bytea[],"
                " refs text[], operations text[], envelopes text[], notices text[])"
            ).format(schema=schema, function=function)
            + body
        )
        self._append: Composed = SQL(
            "SELECT notification_id FROM {schema}.{function}("
            "%b::text[], %b::int8[], %b::text[], %b::bytea[], %b::text[], %b::text[], %b::text[],"
            " %b::text[]) AS appended(notification_id)"
        ).format(schema=schema, function=function)
        self._function_missing = False
        self.notice_store = f"{datastore.schema}.{events_table_name}"
        """Whose events these are, in every append's notices (`ledger.adapters.notices`):
        the channel is shared by every schema of the database."""
        self.notice_writer = new_writer()
        """This recorder's token in its appends' notices: a listener in the same process
        knows its own appends by it."""

    def create_table(self) -> None:
        """Create the library's types, tables and functions, and ours, one creator
        at a time (`ledger.adapters.creation_lock`)."""
        # The library creates each composite type in a transaction of its own and
        # passes over the error of one that exists. Two services opening a fresh
        # schema together both found a type absent, and the second one's commit
        # failed on `pg_type_typname_nsp_index`, which the library does not pass
        # over (5 to 7 of 40 starts, four at a time, once every other creator took
        # the lock; none with this). Created here first under the creators' lock,
        # the types exist before the library's own loop runs.
        for statement in self.sql_create_statements:
            if "CREATE TYPE" in statement.as_string(None):
                with (
                    self.datastore.transaction(commit=True) as curs,
                    contextlib.suppress(DuplicateObject),
                ):
                    take_creation_lock(curs, self.datastore.schema)
                    curs.execute(statement, prepare=False)
        super().create_table()

    def _create_table(self, curs: Cursor[DictRow]) -> None:
        # Two services starting together each replace the library's function and
        # ours in their own transaction, and PostgreSQL refuses the second of two
        # concurrent replacements of one function ("tuple concurrently updated"):
        # one of the services failed to start (11 of 40 starts, two at a time, on an
        # existing schema; none with this). One creator at a time per schema, until
        # its transaction ends.
        take_creation_lock(curs, self.datastore.schema)
        super()._create_table(curs)

    def insert_events(
        self,
        stored_events: Sequence[StoredEvent],
        *,
        results: Sequence[KeptResultRow] = (),
        **kwargs: Any,
    ) -> Sequence[int] | None:
        """Store the events and the kept texts in one transaction; their notification IDs.

        One statement, in autocommit, so that it is its own transaction: the
        library sends four (lock timeout, lock, NOTIFY, insert) in a pipeline
        between BEGIN and COMMIT, and at the few events per append of a moderate
        rate psycopg's work per statement and the pipeline's own were most of an
        append's CPU (three events: 343-379 against 156-171 µs, measured on this
        repository's benchmark machine). A duplicate (ID, version) is the library's
        `IntegrityError`, and nothing of the call is stored, as before.

        Where the function was never created (a schema made by an earlier release
        and served with the library's `CREATE_TABLE` off), the library's own
        statements do the same work, more slowly, and a warning says so once.

        An append whose answer was lost (a connection cut after the commit) fails
        when it is tried again, on its own events. So an `IntegrityError` is looked
        into before it is raised: if every event is stored with exactly the state
        sent, this append is what stored them, and their positions are the answer.
        Without this, nobody in the process heard that the append was stored: the
        budget did not count the call, and the executor granted a lease was answered
        "busy" by its own lease. A cut append may also still be running (waiting
        for the table's lock: a server notices a client gone only when it answers)
        and commit after the try that follows it began; that try then waits for it
        and fails on its events, and is looked into the same way. A state holds the
        ledger clock's reading to the microsecond and the hash chain's link, so
        another writer's events are never the same bytes.
        """
        if not stored_events and not results:
            return []
        try:
            return self._insert(stored_events, results, **kwargs)
        except IntegrityError:
            # Tried again after a cut (here, or inside the library's own retry on the
            # fallback below), or the cut try was still waiting for the table's lock
            # when it was looked for and committed since: a unique check waits for the
            # conflicting row's commit, so the lookup now has its answer.
            stored = self._stored_as_sent(stored_events)
            if stored is None:
                raise
            _log.info("an append whose answer was lost had been stored: kept")
            return stored

    def _insert(
        self, stored_events: Sequence[StoredEvent], results: Sequence[KeptResultRow],
        **kwargs: Any,
    ) -> Sequence[int] | None:
        if not self._function_missing:
            try:
                appended: list[int] = self._append_in_one_statement(stored_events, results)
                return appended
            except ProgrammingError as error:
                if not isinstance(error.__cause__, UndefinedFunction):
                    raise
                self._function_missing = True
                _log.warning(
                    "the append function is missing from schema %s (tables made elsewhere,"
                    " CREATE_TABLE off): appending statement by statement, more slowly",
                    self.datastore.schema,
                )
        ids: Sequence[int] | None = super().insert_events(
            stored_events, results=results, **kwargs
        )
        return ids

    # The library's retry, for the same failures (a dropped connection, a lock timeout);
    # an append it tries again after its answer was lost is `insert_events`' to settle.
    @retry((InterfaceError, OperationalError), max_attempts=10, wait=0.2)
    def _append_in_one_statement(
        self, stored_events: Sequence[StoredEvent], results: Sequence[KeptResultRow]
    ) -> list[int]:
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute(
                self._append,
                (
                    *_event_columns(stored_events),
                    [row[0] for row in results],
                    [row[1] for row in results],
                    [row[2] for row in results],
                    self._notice_payloads(stored_events),
                ),
                prepare=True,
            )
            return [int(row["notification_id"]) for row in curs.fetchall()]

    def _stored_as_sent(self, stored_events: Sequence[StoredEvent]) -> list[int] | None:
        """The positions of these events if every one is stored with the state sent,
        in their order; else None."""
        if not stored_events:
            return None  # texts alone never conflict (ON CONFLICT DO NOTHING)
        ids, versions, _, states = _event_columns(stored_events)
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute(self._select_sent, (ids, versions))
            found = {
                (str(row["originator_id"]), int(row["originator_version"])): row
                for row in curs.fetchall()
            }
        positions: list[int] = []
        for key, state in zip(zip(ids, versions, strict=True), states, strict=True):
            row = found.get(key)
            if row is None or bytes(row["state"]) != state:
                return None
            positions.append(int(row["notification_id"]))
        return positions

    @cached_property
    def _select_sent(self) -> Composed:
        return SQL(
            "SELECT notification_id, originator_id, originator_version, state"
            " FROM {schema}.{table}"
            " WHERE (originator_id, originator_version) IN"
            " (SELECT * FROM unnest(%b::text[], %b::int8[]))"
        ).format(
            schema=Identifier(self.datastore.schema), table=Identifier(self.events_table_name)
        )

    def _insert_stored_events(
        self,
        curs: Cursor[DictRow],
        stored_events: Sequence[StoredEvent],
        *,
        results: Sequence[KeptResultRow] = (),
        **_: Any,
    ) -> None:
        # Only without the function (see `insert_events`): the library's order, lock,
        # notify, insert (its caller syncs the pipeline and reads the RETURNING rows),
        # with the kept texts under the lock and the events from the same arrays.
        self._lock_table(curs)
        payloads = self._notice_payloads(stored_events)
        if payloads:
            curs.execute(self._notify_payloads, (payloads,))
        else:
            self._notify_channel(curs)
        if results:
            curs.executemany(self._insert_results, results)
        curs.execute(self._insert_arrays, _event_columns(stored_events), prepare=True)

    def _notice_payloads(self, stored_events: Sequence[StoredEvent]) -> list[str]:
        return notice_payloads(
            self.notice_store,
            self.notice_writer,
            (str(event.originator_id) for event in stored_events),
        )

    @cached_property
    def _notify_payloads(self) -> Composed:
        return SQL("SELECT pg_notify({channel}, notice) FROM unnest(%s::text[]) AS notice").format(
            channel=Literal(self.channel_name)
        )

    @cached_property
    def _insert_arrays(self) -> Composed:
        return SQL(
            "INSERT INTO {schema}.{table} (originator_id, originator_version, topic, state)"
            " SELECT * FROM unnest(%b::text[], %b::int8[], %b::text[], %b::bytea[])"
            " RETURNING notification_id"
        ).format(
            schema=Identifier(self.datastore.schema), table=Identifier(self.events_table_name)
        )

    @cached_property
    def _insert_results(self) -> Composed:
        return SQL(_INSERT_RESULTS.format(table="{schema}.{table}", marks="%s, %s, %s")).format(
            schema=Identifier(self.datastore.schema), table=Identifier(_RESULTS)
        )


def _event_columns(
    stored_events: Sequence[StoredEvent],
) -> tuple[list[str], list[int], list[str], list[bytes]]:
    """The events as four arrays (IDs, versions, topics, states), dumped in binary by
    psycopg's C layer."""
    return (
        [str(event.originator_id) for event in stored_events],
        [event.originator_version for event in stored_events],
        [event.topic for event in stored_events],
        [bytes(event.state) for event in stored_events],
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
