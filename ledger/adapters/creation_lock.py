"""The one lock that everything creating opledger's tables on PostgreSQL takes.

PostgreSQL's `CREATE ... IF NOT EXISTS` is not safe against itself: two sessions
creating the same schema, table or index at the same moment both find it absent,
and the second one's commit fails on the catalog's unique index ("duplicate key
value violates unique constraint"); two replacing one function at once fail the
second with "tuple concurrently updated". Services, operators' commands and tests
that open one fresh database together therefore create one at a time: each
creating transaction first takes this transaction-scoped advisory lock, which
PostgreSQL releases at its commit or rollback.
"""

from __future__ import annotations

__all__ = ["CREATE_LOCK_KEY"]

CREATE_LOCK_KEY = 0x6F706C6564676572  # "opledger" in ASCII
"""The key of `pg_advisory_xact_lock` every opledger table creator takes first."""
