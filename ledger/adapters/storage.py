"""Where the ledger keeps its events: SQLite (embedded default) or PostgreSQL.

`StorageConfig` is the one place that turns an operator's choice (a file path
or a DSN) into the environment the `eventsourcing` library reads, and into a
connection for the SQL read models that live beside the events.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict

from ledger.adapters.recorders import POSTGRES_RECORDER_TOPIC, SQLITE_RECORDER_TOPIC
from ledger.domain.errors import InvalidArgument

__all__ = ["READ_ONLY_OPTIONS", "StorageConfig"]

READ_ONLY_OPTIONS = "-c default_transaction_read_only=on"
"""libpq `options` for a PostgreSQL session in which every transaction is read-only."""

_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """Either `sqlite_path` or `postgres_dsn` (with an optional schema) is set.

    `read_only`: every connection made from this configuration can only read
    (SQLite `mode=ro`, PostgreSQL read-only transactions), creates no file,
    folder, schema or table. For the commands that only look.
    """

    sqlite_path: Path | None = None
    postgres_dsn: str | None = None
    postgres_schema: str = ""
    read_only: bool = False

    def __post_init__(self) -> None:
        if (self.sqlite_path is None) == (self.postgres_dsn is None):
            raise InvalidArgument("give exactly one of sqlite_path and postgres_dsn")
        if self.postgres_schema and not _IDENTIFIER.match(self.postgres_schema):
            raise InvalidArgument(f"not a plain schema name: {self.postgres_schema!r}")

    @classmethod
    def sqlite(cls, path: Path | str) -> StorageConfig:
        """Events in one SQLite file."""
        return cls(sqlite_path=Path(path))

    @classmethod
    def postgres(cls, dsn: str, schema: str = "") -> StorageConfig:
        """Events in PostgreSQL, optionally in their own schema."""
        return cls(postgres_dsn=dsn, postgres_schema=schema)

    @property
    def is_postgres(self) -> bool:
        """Whether this is the PostgreSQL backend."""
        return self.postgres_dsn is not None

    def reading(self) -> StorageConfig:
        """The same storage, opened read-only."""
        return replace(self, read_only=True)

    @property
    def events_table(self) -> str:
        """The events table the `eventsourcing` recorders use for this backend.

        The library names it, not us: `stored_events` in SQLite, the
        application's name plus `_events` in PostgreSQL.
        """
        return "opledger_events" if self.is_postgres else "stored_events"

    def sqlite_uri(self) -> str:
        """The SQLite file as a URI, read-only when this configuration is."""
        assert self.sqlite_path is not None
        uri = self.sqlite_path.resolve().as_uri()
        return uri + "?mode=ro" if self.read_only else uri

    def describe(self) -> str:
        """Where the events are, without any password."""
        if self.sqlite_path is not None:
            return f"sqlite:{self.sqlite_path}"
        params = conninfo_to_dict(self.postgres_dsn or "")
        where = f"{params.get('host', 'localhost')}:{params.get('port', 5432)}"
        suffix = f" schema {self.postgres_schema}" if self.postgres_schema else ""
        return f"postgresql://{params.get('user', '')}@{where}/{params.get('dbname', '')}{suffix}"

    def eventsourcing_env(self) -> dict[str, str]:
        """The environment for `eventsourcing.Application` (string operation IDs)."""
        env = {"ORIGINATOR_ID_TYPE": "text"}
        if self.read_only:
            env["CREATE_TABLE"] = "no"
        if self.sqlite_path is not None:
            if self.read_only:
                # The library connects with `uri=True`: a read-only URI it is.
                env |= {
                    "PERSISTENCE_MODULE": "eventsourcing.sqlite",
                    "SQLITE_DBNAME": self.sqlite_uri(),
                    "SQLITE_LOCK_TIMEOUT": "10",
                }
                return env
            self.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
            env |= {
                "PERSISTENCE_MODULE": "eventsourcing.sqlite",
                "SQLITE_DBNAME": str(self.sqlite_path),
                "SQLITE_LOCK_TIMEOUT": "10",
                # Kept results in the events' transaction (`ledger.adapters.recorders`).
                "APPLICATION_RECORDER_TOPIC": SQLITE_RECORDER_TOPIC,
            }
            return env
        params = conninfo_to_dict(self.postgres_dsn or "")
        env |= {
            "PERSISTENCE_MODULE": "eventsourcing.postgres",
            "POSTGRES_DBNAME": str(params.get("dbname", "postgres")),
            "POSTGRES_HOST": str(params.get("host", "127.0.0.1")),
            "POSTGRES_PORT": str(params.get("port", "5432")),
            "POSTGRES_USER": str(params.get("user", "postgres")),
            "POSTGRES_PASSWORD": str(params.get("password", "")),
            "POSTGRES_POOL_SIZE": "4",
            "POSTGRES_MAX_OVERFLOW": "4",
            "POSTGRES_LOCK_TIMEOUT": "10",
            # Events go in as plain arrays, with the kept results in their
            # transaction (`ledger.adapters.recorders`).
            "APPLICATION_RECORDER_TOPIC": POSTGRES_RECORDER_TOPIC,
            # Its insert path; the library's database function would bypass it (and
            # the library reads this from the process environment too).
            "POSTGRES_ENABLE_DB_FUNCTIONS": "n",
        }
        if self.postgres_schema:
            env["POSTGRES_SCHEMA"] = self.postgres_schema
        return env
