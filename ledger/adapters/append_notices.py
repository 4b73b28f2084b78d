"""PostgreSQL's word that another writer appended events, as it happens.

Several ledger services may share one PostgreSQL (the production topology), and
only one of them relays. What the others append, the relay used to learn from
its poll (`ledger.server.relay`: every quarter of a second), so an operation
whose step another instance recorded waited for that poll before its work item,
its next step or its outcome went out: with two services at 20 operations/s, a
median of 48 ms from submit to lease against 4.7 ms with one
(`bench/e2e_bench.py --storage postgres --services 1,2`).

Every append already sends a NOTIFY on the events table's channel (the
library's, kept by `ledger.adapters.recorders`, which names the operations
appended in its payloads). `AppendNotices` listens on a connection of its own,
on the event loop (psycopg's asyncio connection: no thread), and calls back for
each notice another backend sent. This process's own appends are told apart by
the backend that sent them (the recorder keeps the backends it appended
through): the relay learns of those from the gateway already, and a wake-up for
them would cost a read for nothing.

The names serve the command runner's cache as well. An instance keeps the
operations it last wrote; once another instance writes one of them, that copy is
stale, and a command on it costs a failed append (the version check) and the
whole turn run again step by step. With the operation IDs of each notice, the
instance drops those copies first and loads the operation once instead.

A notice only makes the relay look sooner and a copy be loaded again. Lost
notices (a dropped connection, a backend ID another writer reused) cost the old
poll's delay and a failed append, never an event or a wrong answer: the poll
stays, the relay reads the log by position, and every append checks versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Sequence

import psycopg
from psycopg.sql import SQL, Identifier

from ledger.adapters.recorders import NOTICE_SEPARATOR

__all__ = ["AppendNotices"]

_log = logging.getLogger(__name__)


class AppendNotices:
    """Listens for the events table's NOTIFY and calls `on_notice` for other writers'.

    `on_notice` gets the operation IDs the append named (`ledger.adapters.recorders`
    `notice_payloads`), or none: an append by the library's own statements, or the
    one look taken when listening starts, after which nothing was missed any more.
    `own_backends`: the backend IDs whose notices are this process's own appends
    (asked at each notice: the recorder's set grows as its pool opens connections).
    """

    def __init__(
        self,
        dsn: str,
        channel: str,
        *,
        own_backends: Callable[[], Collection[int]],
        on_notice: Callable[[Sequence[str]], object],
        retry_after_s: float = 1.0,
        retry_at_most_s: float = 30.0,
    ) -> None:
        self._dsn = dsn
        self._channel = channel
        self._own_backends = own_backends
        self._on_notice = on_notice
        self._retry_after_s = retry_after_s
        self._retry_at_most_s = retry_at_most_s
        self._task: asyncio.Task[None] | None = None
        self.listening = asyncio.Event()
        """Set while a connection listens (for tests and readiness)."""
        self.heard = 0
        """Notices from other writers passed on (for tests)."""
        self.backend_pid: int | None = None
        """The listening connection's backend (for tests and for `pg_stat_activity`)."""

    def start(self) -> None:
        """Listen on the running event loop until `stop`."""
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name="ledger-append-notices"
        )

    async def stop(self) -> None:
        """Stop listening and close the connection."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        delay = self._retry_after_s
        while True:
            try:
                await self._listen()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # The poll still finds everything: say so once per outage, try again.
                if self.listening.is_set() or delay == self._retry_after_s:
                    _log.warning(
                        "not listening for other instances' appends (%s: %s); the relay"
                        " polls until the connection is back",
                        type(exc).__name__,
                        exc,
                    )
                self.listening.clear()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_at_most_s)
                continue
            delay = self._retry_after_s

    async def _listen(self) -> None:
        conn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True)
        try:
            await conn.execute(SQL("LISTEN {}").format(Identifier(self._channel)))
            self.backend_pid = conn.info.backend_pid
            self.listening.set()
            # What was appended while nobody listened is found by looking once now.
            self._on_notice(())
            async for notice in conn.notifies():
                if notice.pid in self._own_backends():
                    continue
                self.heard += 1
                named = notice.payload.split(NOTICE_SEPARATOR) if notice.payload else ()
                try:
                    self._on_notice(named)
                except Exception:  # a listener's failure never ends the listening
                    _log.exception("acting on another instance's append failed")
        finally:
            self.listening.clear()
            with contextlib.suppress(Exception):
                await conn.close()
