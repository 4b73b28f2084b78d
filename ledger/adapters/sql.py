"""A thin SQL connection for the read models, over sqlite3 or psycopg.

The read models (operations view, digest chain, results) live in the same
database as the events, so one backend choice covers everything. Statements
are written with `?` placeholders and translated for psycopg; the one exception
is the text around the generated marks of `insert_rows` and `query_in`, which
goes to PostgreSQL untranslated and so must hold no placeholder of its own.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg

from ledger.adapters.creation_lock import take_creation_lock
from ledger.adapters.storage import READ_ONLY_OPTIONS, StorageConfig

__all__ = ["SqlDatabase"]

# Rows per multi-row statement (`SqlDatabase.insert_rows`): the view and the seal write
# a few dozen at a time; a catch-up over a large log writes its batch in a few.
_ROWS_PER_STATEMENT = 500


def _numbered(first: int, count: int) -> str:
    """`$first, ..., $(first + count - 1)`: PostgreSQL's own placeholders.

    For statements with hundreds of parameters (`insert_rows`, `query_in`), run
    through `psycopg.RawCursor`, which sends them as they are. A statement with
    `%s` marks is parsed by psycopg with a regular expression, one match object per
    mark, and statements that long are not cached: in the view thread's profile
    (`bench/e2e_bench.py --storage postgres --profile`) that parse took 3.5 ms per
    500-row upsert and was the larger part of the thread's CPU, all of it holding
    the GIL the event loop needs.
    """
    return ", ".join([f"${number}" for number in range(first, first + count)])


def _numbered_rows(count: int, width: int) -> str:
    """A VALUES list of `count` rows of `width` numbered placeholders each."""
    return ", ".join(
        [f"({_numbered(row * width + 1, width)})" for row in range(count)]
    )


class SqlDatabase:
    """One connection, used by one thread at a time (a lock makes that so).

    With a read-only `storage` the connection cannot write, and opening it
    creates nothing (no folder, file, schema or table).
    """

    def __init__(self, storage: StorageConfig) -> None:
        self.storage = storage
        self.is_postgres = storage.is_postgres
        self.read_only = storage.read_only
        self._lock = threading.RLock()
        self._depth = 0
        self._conn: sqlite3.Connection | psycopg.Connection[Any]
        if storage.sqlite_path is not None and storage.read_only:
            self._conn = sqlite3.connect(
                storage.sqlite_uri(),
                uri=True,
                check_same_thread=False,
                timeout=10,
                isolation_level=None,
            )
        elif storage.read_only:
            pg = psycopg.connect(
                storage.postgres_dsn or "", autocommit=True, options=READ_ONLY_OPTIONS
            )
            if storage.postgres_schema:
                pg.execute(f'SET search_path TO "{storage.postgres_schema}"')
            self._conn = pg
        elif storage.sqlite_path is not None:
            storage.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                storage.sqlite_path, check_same_thread=False, timeout=10, isolation_level=None
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._conn = conn
        else:
            pg = psycopg.connect(storage.postgres_dsn or "", autocommit=True)
            self._conn = pg
            if storage.postgres_schema:
                with self.creating():
                    pg.execute(f'CREATE SCHEMA IF NOT EXISTS "{storage.postgres_schema}"')
                pg.execute(f'SET search_path TO "{storage.postgres_schema}"')

    def _sql(self, statement: str) -> str:
        return statement.replace("?", "%s") if self.is_postgres else statement

    @contextmanager
    def transaction(self) -> Iterator[SqlDatabase]:
        """Run the block in one transaction (re-entrant within a thread)."""
        with self._lock:
            if getattr(self, "_depth", 0):
                self._depth += 1
                try:
                    yield self
                finally:
                    self._depth -= 1
                return
            self._depth = 1
            try:
                if self.is_postgres:
                    with self._pg.transaction():
                        yield self
                else:
                    self._conn.execute("BEGIN IMMEDIATE")
                    try:
                        yield self
                    except BaseException:
                        self._conn.execute("ROLLBACK")
                        raise
                    self._conn.execute("COMMIT")
            finally:
                self._depth = 0

    @contextmanager
    def creating(self) -> Iterator[SqlDatabase]:
        """A transaction for creating schemas, tables, indexes and columns: on
        PostgreSQL it first takes the creators' lock (`ledger.adapters.creation_lock`),
        so that two processes opening one fresh database never create the same thing
        at once (one lock per schema). Nested in a transaction, the lock is held until
        the outer one ends."""
        with self.transaction():
            if self.is_postgres:  # `transaction` holds the connection's lock
                take_creation_lock(self._pg, self.storage.postgres_schema)
            yield self

    @property
    def _pg(self) -> psycopg.Connection[Any]:
        assert isinstance(self._conn, psycopg.Connection)
        return self._conn

    def execute(self, statement: str, params: Sequence[Any] = ()) -> None:
        """Run one statement."""
        with self._lock:
            self._conn.execute(self._sql(statement), params)

    def execute_count(self, statement: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; the number of rows it changed."""
        with self._lock:
            cursor = self._conn.execute(self._sql(statement), params)
            return int(cursor.rowcount)

    def executemany(self, statement: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run one statement for many parameter rows."""
        if not rows:
            return
        with self._lock:
            if self.is_postgres:
                with self._pg.cursor() as cursor:
                    cursor.executemany(self._sql(statement), rows)
            else:
                assert isinstance(self._conn, sqlite3.Connection)
                self._conn.executemany(statement, rows)

    def insert_rows(self, head: str, rows: Sequence[Sequence[Any]], tail: str = "") -> None:
        """Run `{head} VALUES (?, ...) {tail}` for every row of `rows` (all of one width).

        On PostgreSQL as few statements as can be, each with many rows in its
        VALUES list: `executemany` sends a statement per row, and at the view's
        and the seal's rates (every event a digest row, every operation a view
        row) its per-row protocol work was the larger part of the view thread's
        CPU. Two rows with the same key in one upsert are refused by PostgreSQL
        (`ON CONFLICT DO UPDATE` cannot touch a row twice): callers pass one row
        per key. SQLite keeps `executemany`, whose loop is already in C. Every row
        or none is stored, inside a transaction or not.
        """
        if not rows:
            return
        width = len(rows[0])
        if any(len(row) != width for row in rows):
            # Flattened, a short row would shift the next one's values into its columns.
            raise ValueError("insert_rows: rows of different widths")
        marks = "(" + ", ".join("?" * width) + ")"
        if not self.is_postgres:
            # In a transaction of its own if there is none: SQLite's connection is in
            # autocommit, where `executemany` would keep the rows before a failing one.
            with self.transaction():
                self.executemany(f"{head} VALUES {marks} {tail}", rows)
            return
        # PostgreSQL takes at most 65,535 parameters per statement.
        chunk = max(1, min(_ROWS_PER_STATEMENT, 65_535 // width))
        # Written with PostgreSQL's own numbered placeholders, through a raw cursor:
        # psycopg turns `%s` marks into those with a regular expression in Python,
        # uncached for long statements, and for the view's 500-row upserts that
        # parse took longer than the database did (see `_numbered`).
        # All chunks or none, also outside a transaction.
        with self.transaction(), psycopg.RawCursor(self._pg) as cursor:
            for start in range(0, len(rows), chunk):
                part = rows[start : start + chunk]
                params = [value for row in part for value in row]
                # Not prepared: each row count is another statement text, and they
                # would crowd the connection's few prepared statements out.
                cursor.execute(
                    f"{head} VALUES {_numbered_rows(len(part), width)} {tail}",
                    params,
                    prepare=False,
                )

    def query(self, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of one query."""
        with self._lock:
            cursor = self._conn.execute(self._sql(statement), params)
            return [tuple(row) for row in cursor.fetchall()]

    def tables(self) -> set[str]:
        """The names of the tables this connection sees (in its schema, for PostgreSQL)."""
        if self.is_postgres:
            rows = self.query(
                "SELECT table_name FROM information_schema.tables"
                " WHERE table_schema = current_schema()"
            )
        else:
            rows = self.query("SELECT name FROM sqlite_master WHERE type = 'table'")
        return {str(row[0]) for row in rows}

    def query_in(
        self, statement: str, values: Sequence[Any], *, chunk: int = 500
    ) -> list[tuple[Any, ...]]:
        """Rows of `statement` for every value, its `{marks}` filled in per chunk.

        `... WHERE id IN ({marks})` for a list of any length: chunks stay far
        below SQLite's parameter limit.
        """
        rows: list[tuple[Any, ...]] = []
        for start in range(0, len(values), chunk):
            part = values[start : start + chunk]
            if not self.is_postgres:
                rows.extend(self.query(statement.format(marks=", ".join("?" * len(part))), part))
                continue
            with self._lock, psycopg.RawCursor(self._pg) as cursor:
                cursor.execute(statement.format(marks=_numbered(1, len(part))), part)
                rows.extend(tuple(row) for row in cursor.fetchall())
        return rows

    def cancel(self) -> None:
        """Cancel the statement this connection is running, from any thread, without
        waiting for the connection's lock (PostgreSQL; the statement then fails)."""
        self._pg.cancel_safe()

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._conn.close()
