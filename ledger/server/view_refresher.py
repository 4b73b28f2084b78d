"""The operations view and the seal, brought up to date on a thread of their own.

While events flow, the relay asks for the view and the seal to catch up every
quarter second. Done inline, that stopped the service's event loop for the
whole catch-up: on PostgreSQL 27 ms each time (a profile at 200 operations/s:
147 refreshes, 4.0 s of 48), mostly waiting for the database, and every
proposal, lease and result that arrived meanwhile waited too; that stall was
the p99 of the whole path. Here the catch-up runs on its own thread over its
own connection, so the loop serves requests while the thread waits for
PostgreSQL (psycopg releases the GIL while it waits).

Nothing reads the view believing it current: readers that must be current fold
in what it has not taken in yet (`OperationsProjector.rows(current=True)`), and
the relay still refreshes inline when it needs a route the view must know. The
view's rows and position commit in one transaction and the seal takes its
position row `FOR UPDATE`, so this thread and an inline refresh (the sweeps')
serialize in the database and never skip or repeat an event.
"""

from __future__ import annotations

import logging
import threading
import time

from ledger.adapters.sql import SqlDatabase
from ledger.projections.operations_view import OperationsProjector
from ledger.server.transient import log_failure
from ledger.service import Ledger, ReadModels

__all__ = ["ViewRefresher"]

_log = logging.getLogger(__name__)


class ViewRefresher:
    """Refreshes the view and the seal of `ledger` on its own thread, when asked."""

    def __init__(self, ledger: Ledger) -> None:
        self._db = SqlDatabase(ledger.db.storage)
        projector = OperationsProjector(self._db, ledger.events.recorder, create=False)
        sealer = ledger.sealer.on(self._db) if ledger.sealer is not None else None
        self._models = ReadModels(projector, sealer)
        self._due = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._failure_logged = float("-inf")
        self.refreshes = 0
        """Refreshes run so far (for tests and metrics)."""

    def start(self) -> None:
        """Start the thread (it waits for `refresh_soon`)."""
        self._thread = threading.Thread(target=self._run, name="ledger-view", daemon=True)
        self._thread.start()

    def refresh_soon(self) -> None:
        """Ask for a refresh without waiting for it (asks made meanwhile make one)."""
        self._due.set()

    def stop(self) -> None:
        """Finish the refresh under way, stop the thread and close its connection."""
        self._stopping = True
        self._due.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._db.close()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._stopping:
                return
            try:
                self._models.refresh()
                self.refreshes += 1
            except Exception as exc:  # the next ask tries again; the inline refreshes go on
                now = time.monotonic()
                if now - self._failure_logged >= 10:  # asked every quarter second
                    self._failure_logged = now
                    log_failure(_log, "bringing the view up to date failed", exc)
