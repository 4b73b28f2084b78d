"""The sweeps' questions to the operations view, asked off the event loop.

Every sweep asks the view which approvals and leases may have run out and which
operations have waited too long for a work item. On PostgreSQL those queries walk
the view's state index, and every row version an operation left behind (proposed,
ready, executing, succeeded: the view rewrites its row at each step) stays in that
index until the table is vacuumed. Measured at 200,000 operations (`bench/e2e_bench.py --storage
postgres --prefill 1000000`, a server without autovacuum): 24 and 55 ms per sweep,
the event loop stopped for both, and the p99 at 200 operations/s went from about
25 to 100 ms. Autovacuum shortens that, but only every so often: between its runs
the dead versions pile up again.

Here those queries run on a worker thread over a connection of their own, so the
loop serves requests while PostgreSQL walks the index (psycopg releases the GIL
while it waits). They only name candidates: the aggregates, loaded on the loop,
still decide what expires and what is published again, so an answer a moment old
changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TypeVar

from ledger.adapters.sql import SqlDatabase
from ledger.projections.operations_view import OperationsProjector
from ledger.service import Ledger

__all__ = ["SweepReads"]

T = TypeVar("T")


class SweepReads:
    """The view's sweep queries for `ledger`, answered on a worker thread (one at a
    time: the service's one sweep task asks them in turn) over a read-only connection
    of its own."""

    def __init__(self, ledger: Ledger) -> None:
        # Read-only: it only asks, and opening it creates nothing (no schema, no lock).
        self._storage = ledger.db.storage.reading()
        self._recorder = ledger.projector.recorder
        self._db = SqlDatabase(self._storage)
        self._view = OperationsProjector(self._db, self._recorder, create=False)
        # Guards the connection's lifecycle between the worker thread and `close`.
        self._guard = threading.Lock()
        self._asking = False
        self._closed = False

    async def approval_expiry_candidates(self, now: datetime) -> list[str]:
        """`OperationsProjector.approval_expiry_candidates`, off the loop."""
        return await self._ask(lambda view: view.approval_expiry_candidates(now))

    async def lease_expiry_candidates(self, now: datetime) -> list[str]:
        """`OperationsProjector.lease_expiry_candidates`, off the loop."""
        return await self._ask(lambda view: view.lease_expiry_candidates(now))

    async def waiting_since_before(
        self, moment: datetime
    ) -> Sequence[tuple[str, str, str | None, int, str, str | None]]:
        """`OperationsProjector.waiting_since_before`, off the loop."""
        return await self._ask(lambda view: view.waiting_since_before(moment))

    async def _ask(self, question: Callable[[OperationsProjector], T]) -> T:
        return await asyncio.to_thread(self._answer, question)

    def _answer(self, question: Callable[[OperationsProjector], T]) -> T:
        with self._guard:
            if self._closed:
                raise RuntimeError("the sweeps' view connection is closed")
            self._asking = True
        try:
            return question(self._view)
        except Exception:
            # The connection may be what failed (a restarted server; `SqlDatabase`
            # does not reconnect): the next sweep asks over a new one. The sweep
            # logs this failure and asks on the loop this time.
            self._replace_connection()
            raise
        finally:
            with self._guard:
                self._asking = False
                closed_meanwhile = self._closed
            if closed_meanwhile:
                with contextlib.suppress(Exception):
                    self._db.close()

    def _replace_connection(self) -> None:
        with self._guard:
            if self._closed:
                return  # `_answer` closes what is left
        try:
            db = SqlDatabase(self._storage)
        except Exception:
            return  # the database is down: the next sweep tries again
        old, self._db = self._db, db
        self._view = OperationsProjector(db, self._recorder, create=False)
        with contextlib.suppress(Exception):
            old.close()

    def cancel(self) -> None:
        """Cancel the question under way, if any (a sweep that gave up waiting for it):
        it fails, and the next question asks over a new connection."""
        with self._guard:
            asking, db = self._asking, self._db
        if asking and db.is_postgres:
            with contextlib.suppress(Exception):
                db.cancel()

    def close(self) -> None:
        """Close the connection. A question still waiting on it (a view locked at stop)
        is cancelled first, so that neither this call nor the process's exit waits for
        it; the worker thread then closes the connection itself."""
        with self._guard:
            self._closed = True
            asking = self._asking
        if asking:
            self.cancel()
            return
        self._db.close()
