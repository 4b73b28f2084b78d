"""The operations view and the seal, brought up to date on a thread of their own.

While events flow, the relay asks for the view and the seal to catch up every
quarter second. Done inline, that stopped the service's event loop for the
whole catch-up: on PostgreSQL 27 ms each time (a profile at 200 operations/s:
147 refreshes, 4.0 s of 48), mostly waiting for the database, and every
proposal, lease and result that arrived meanwhile waited too. Here the
catch-up runs on its own thread over its own connection, so the loop serves
requests while the thread waits for PostgreSQL (psycopg releases the GIL
while it waits). Measured on PostgreSQL at 100 operations/s, two interleaved
pairs: p50 13.2 and 11.0 against 17.6 and 14.9 ms, p99 36 and 29 against 39
and 39 ms.

The thread takes the ledger's sealer (`ReadModels.moved_to`): from then on only
it seals, so one sealer remembers everything it signed, which is what makes
it refuse to seal over a seal someone cut back or erased. The loop may still
bring the view itself up to date (a route the relay needs, a budget count):
the view's rows and position commit together under a row lock, and the
sealer reuses what a catch-up read only when it follows on from the view's
locked position (`OperationsProjector.catch_up`), so neither the view nor the
seal skips or repeats an event, whichever wrote last.
"""

from __future__ import annotations

import logging
import threading
import time

from ledger.adapters.sql import SqlDatabase
from ledger.server.transient import log_failure
from ledger.service import Ledger, ReadModels

__all__ = ["ViewRefresher"]

_log = logging.getLogger(__name__)

_FAILURES_BEFORE_UNHEALTHY = 3


class ViewRefresher:
    """Refreshes the view of `ledger` and seals it, on its own thread, when asked."""

    def __init__(self, ledger: Ledger) -> None:
        self._storage = ledger.db.storage
        self._db = SqlDatabase(self._storage)
        self._home = ledger.read_models  # where the sealer goes back to at stop
        self._models: ReadModels = ledger.read_models.moved_to(self._db)
        self._due = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._failure_logged = float("-inf")
        self._failures = 0
        self.refreshes = 0
        """Refreshes run so far (for tests and metrics)."""

    @property
    def healthy(self) -> bool:
        """False after several refreshes in a row failed: whoever relies on the view
        being kept close (the sweeps) should refresh it themselves meanwhile."""
        return self._failures < _FAILURES_BEFORE_UNHEALTHY

    def start(self) -> None:
        """Start the thread (it waits for `refresh_soon`)."""
        self._thread = threading.Thread(target=self._run, name="ledger-view", daemon=True)
        self._thread.start()

    def refresh_soon(self) -> None:
        """Ask for a refresh without waiting for it (asks made meanwhile make one)."""
        self._due.set()

    def stop(self) -> None:
        """Finish the refresh under way, seal everything now (the service's last seal,
        made by the one sealer), give the sealer back to the ledger and close the
        connection."""
        self._stopping = True
        self._due.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            if self._thread.is_alive():
                # Still in a catch-up: closing its connection under it would leave it
                # failing; it is a daemon, and whatever it did not seal, the next
                # service seals (from the heads this one signed).
                _log.error("the view thread did not stop within 60 s; not sealing the tail")
                return
        try:
            self._models.seal_now()
        except Exception as exc:
            log_failure(_log, "could not seal the last events before stopping", exc)
        finally:
            # Only now: while the thread could still seal, the ledger must not.
            self._home.take_sealer_from(self._models)
            self._db.close()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._stopping:
                return
            try:
                self._models.refresh()
            except Exception as exc:  # the next ask tries again, on a new connection
                self._failed(exc)
                continue
            self._failures = 0
            self.refreshes += 1

    def _failed(self, exc: Exception) -> None:
        self._failures += 1
        now = time.monotonic()
        if now - self._failure_logged >= 10:  # asked every quarter second
            self._failure_logged = now
            log_failure(_log, "bringing the view up to date failed", exc)
        # The connection may be what failed (`SqlDatabase` does not reconnect): the
        # next refresh runs on a new one, with the same sealer.
        try:
            db = SqlDatabase(self._storage)
        except Exception:
            return  # the database is down: the next ask tries again
        old, self._db = self._db, db
        self._models = self._models.moved_to(db)
        try:
            old.close()
        except Exception:
            _log.debug("closing the failed view connection failed", exc_info=True)
