"""The one lock that everything creating opledger's tables on PostgreSQL takes.

PostgreSQL's `CREATE ... IF NOT EXISTS` is not safe against itself: two sessions
creating the same schema, table or index at the same moment both find it absent,
and the second one's commit fails on the catalog's unique index ("duplicate key
value violates unique constraint"); two replacing one function at once fail the
second with "tuple concurrently updated". Services, operators' commands and tests
that open one fresh database together therefore create one at a time: each
creating transaction first takes this transaction-scoped advisory lock, which
PostgreSQL releases at its commit or rollback.

The lock is one per schema: what is created in one schema never collides with
another's, so deployments (or tests) in other schemas of the same database do not
wait for each other.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import psycopg

__all__ = ["CREATION_LOCK_SQL", "creation_lock_keys", "take_creation_lock"]

_log = logging.getLogger(__name__)

_OPLEDGER = 0x6F706C65  # "ople" in ASCII: the first key, the same for every schema

CREATION_LOCK_SQL = "SELECT pg_advisory_xact_lock(%s, %s)"
"""The statement that takes the lock (psycopg placeholders; see `creation_lock_keys`)."""


def _schema_name(schema: str) -> str:
    # Empty is the default schema, `public`, as the `eventsourcing` library reads it.
    return schema.strip() or "public"


def creation_lock_keys(schema: str) -> tuple[int, int]:
    """The two 32-bit keys of `pg_advisory_xact_lock` for creators in `schema` (empty:
    the default schema, `public`)."""
    name = _schema_name(schema)
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big", signed=True)
    return _OPLEDGER, digest


def take_creation_lock(
    session: psycopg.Connection[Any] | psycopg.Cursor[Any], schema: str
) -> None:
    """Take the creators' lock for `schema` in the session's open transaction, saying
    in the log when it has to wait: a start that hangs behind another creator (a
    slow one, or an operator's open transaction it waits for in turn) is then
    visible, not silent."""
    keys = creation_lock_keys(schema)
    row = session.execute("SELECT pg_try_advisory_xact_lock(%s, %s) AS taken", keys).fetchone()
    if row is not None and (row["taken"] if isinstance(row, dict) else row[0]):
        return
    _log.warning(
        "waiting for another process creating opledger's tables in schema %s",
        _schema_name(schema),
    )
    session.execute(CREATION_LOCK_SQL, keys)
