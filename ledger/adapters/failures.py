"""Which failures are the database's own (an outage) and which are one request's data.

The gateway fails every caller of a batch at once on an outage (each would wait out
the same timeout) and answers each request on its own otherwise; the sweeps end on
an outage and go on past one operation that cannot be expired. Both ask here.
"""

from __future__ import annotations

import sqlite3

import psycopg
from eventsourcing.persistence import DataError, PersistenceError

__all__ = ["is_outage"]

_DATABASE_FAILURES: tuple[type[Exception], ...] = (
    PersistenceError,
    sqlite3.Error,
    psycopg.Error,
    OSError,
)
"""Failures of the database itself, not of any one request."""

_BAD_DATA: tuple[type[Exception], ...] = (DataError, psycopg.DataError, sqlite3.DataError)
"""What the database says about one request's data (PostgreSQL cannot store a NUL in
text): that request's failure. Taken for an outage, one executor's malformed result
failed every proposal, lease and result of its gateway turn (an attack review
reproduced it)."""


def is_outage(exc: BaseException) -> bool:
    """Whether `exc` is the database failing, rather than one request or its data."""
    return isinstance(exc, _DATABASE_FAILURES) and not isinstance(exc, _BAD_DATA)
