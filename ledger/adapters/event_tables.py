"""SQL on the event store's own tables: the one place that knows their names and columns.

The `eventsourcing` recorders own the events table; the ledger reads it
directly where the library's API has no query for what is needed (which of
many IDs exist, an operation's newest version) and where auditors must see
every row, not what the notification log chooses to show.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ledger.adapters.sql import SqlDatabase
from ledger.adapters.storage import StorageConfig

__all__ = ["EventTables", "StoredRow", "position_column"]

StoredRow = tuple[int, str, int, str, bytes]
"""One stored event as read from SQL: (position, originator_id, version, topic, state)."""


_ROW_COLUMNS = "originator_id, originator_version, topic, state"


def position_column(storage: StorageConfig) -> str:
    """The events table's global position column (SQLite's recorder has no
    notification ID column: its `rowid` is the position)."""
    return "notification_id" if storage.is_postgres else "rowid"


@dataclass(frozen=True, slots=True)
class EventTables:
    """Where a ledger's events are: its storage and the events table the library made."""

    storage: StorageConfig

    @property
    def events_table(self) -> str:
        """The events table's name (chosen by the library, see `StorageConfig`)."""
        return self.storage.events_table

    @property
    def position_column(self) -> str:
        """The events table's global position."""
        return position_column(self.storage)

    # The statements readers outside this module run on their own connections
    # (verification's read-only snapshot readers, in worker processes). Each
    # selects a `StoredRow`: (position, originator_id, version, topic, state).

    def last_position_sql(self) -> str:
        """The highest position (an index look-up)."""
        return f"SELECT MAX({self.position_column}) FROM {self.events_table}"

    def first_position_sql(self) -> str:
        """The lowest position above zero (rows at zero or below are forged)."""
        column = self.position_column
        return f"SELECT MIN({column}) FROM {self.events_table} WHERE {column} > 0"

    def rows_upto_sql(self, *, after: bool) -> str:
        """Rows up to a position (parameter), and after one (a first parameter) if `after`."""
        column = self.position_column
        lower = f"{column} > ? AND " if after else ""
        return (
            f"SELECT {column}, {_ROW_COLUMNS} FROM {self.events_table}"
            f" WHERE {lower}{column} <= ? ORDER BY {column}"
        )

    def rows_by_operation_sql(self) -> str:
        """Every row, by operation ID in code point order, then by version."""
        # Code point order in both: SQLite's default; PostgreSQL's only with "C".
        collate = ' COLLATE "C"' if self.storage.is_postgres else ""
        return (
            f"SELECT {self.position_column}, {_ROW_COLUMNS} FROM {self.events_table}"
            f" ORDER BY originator_id{collate}, originator_version"
        )


class EventTableReader:
    """Queries on the events table, over one database connection."""

    def __init__(self, db: SqlDatabase, tables: EventTables) -> None:
        self._db = db
        self.tables = tables
        self._events = tables.events_table
        self._position = tables.position_column

    def stored_ids(self, operation_ids: Iterable[str | None]) -> set[str]:
        """Which of these operation IDs have events (batched `IN` queries)."""
        ids = [operation_id for operation_id in dict.fromkeys(operation_ids) if operation_id]
        rows = self._db.query_in(
            f"SELECT originator_id FROM {self._events}"
            " WHERE originator_id IN ({marks}) AND originator_version = 1",
            ids,
        )
        return {str(row[0]) for row in rows}

    def ids_ending(self, suffix: str) -> list[str]:
        """Every aggregate ID that ends with `suffix` (a scan: for a service's start, not
        for every request)."""
        rows = self._db.query(
            f"SELECT DISTINCT originator_id FROM {self._events}"
            " WHERE originator_version = 1 AND originator_id LIKE ?",
            (f"%{suffix}",),
        )
        return sorted(str(row[0]) for row in rows)

    def events_of(self, operation_ids: Sequence[str]) -> list[tuple[Any, ...]]:
        """Every stored event of these operations, by operation, then by version: (ID,
        version, topic, state) rows, the library's `StoredEvent` fields (batched `IN`)."""
        return self._db.query_in(
            f"SELECT {_ROW_COLUMNS} FROM {self._events}"
            " WHERE originator_id IN ({marks}) ORDER BY originator_id, originator_version",
            list(operation_ids),
        )

    def stored_version(self, operation_id: str) -> int | None:
        """The newest stored version of one operation, or None if it has no events."""
        rows = self._db.query(
            f"SELECT MAX(originator_version) FROM {self._events} WHERE originator_id = ?",
            (operation_id,),
        )
        return int(rows[0][0]) if rows and rows[0][0] is not None else None

    def last_position(self) -> int:
        """The highest stored position (0 for an empty ledger)."""
        rows = self._db.query(self.tables.last_position_sql())
        return int(rows[0][0]) if rows and rows[0][0] is not None else 0

    def rows_after(self, position: int, limit: int) -> list[StoredRow]:
        """Up to `limit` stored rows after `position`, in position order."""
        column = self._position
        return self._db.query(  # both drivers return (int, str, int, str, bytes)
            f"SELECT {column}, {_ROW_COLUMNS}"
            f" FROM {self._events} WHERE {column} > ? ORDER BY {column} LIMIT ?",
            (position, limit),
        )

    def rows(self, page: int = 10_000) -> Iterator[StoredRow]:
        """Every row of the events table in position order, straight from SQL.

        Auditors read the table itself, not the library's notification log, so
        that no row can hide at a position the log does not show.
        """
        column = self._position
        # `>=` on the first page: a row at the lowest 64-bit position must not hide either.
        after, above = -(2**63), ">="
        while True:
            rows = self._db.query(
                f"SELECT {column}, {_ROW_COLUMNS}"
                f" FROM {self._events} WHERE {column} {above} ? ORDER BY {column} LIMIT ?",
                (after, page),
            )
            # Both drivers already return (int, str, int, str, bytes): no conversion.
            yield from rows
            if len(rows) < page:
                return
            after, above = int(rows[-1][0]), ">"
