"""PostgreSQL's word that another writer appended events, as it happens.

Several ledger services may share one PostgreSQL (the production topology), and
only one of them relays. What the others append, the relay used to learn from
its poll (`ledger.server.relay`: every quarter of a second), so an operation
whose step another instance recorded waited for that poll before its work item,
its next step or its outcome went out: with two services at 20 operations/s, a
median of 48 ms from submit to lease against 4.7 ms with one
(`bench/e2e_bench.py --storage postgres --services 1,2`).

Every append already sends a NOTIFY on the events table's channel (the
library's, kept by `ledger.adapters.recorders`), whose payloads say whose
events table, which process and which operations (`ledger.adapters.notices`).
`AppendNotices` listens on a connection of its own, on the event loop
(psycopg's asyncio connection: no thread), and calls back for each notice
another process sent about this ledger's events. Notices of this process's own
appends are passed over (the relay learns of those from the gateway already,
and a wake-up for them would cost a read for nothing), and so are those of
ledgers in other schemas of the same database, which share the channel.

The names serve the command runner's cache as well. An instance keeps the
operations it last wrote; once another instance writes one of them, that copy is
stale, and a command on it costs a failed append (the version check) and the
whole turn run again step by step. With the operation IDs of each notice, the
instance drops those copies first and loads the operation once instead.

A notice only makes the relay look sooner and a copy be loaded again. Lost
notices (a dropped connection) cost the old poll's delay and a failed append,
never an event or a wrong answer: the poll stays, the relay reads the log by
position, and every append checks versions. After a drop, the callback hears
that notices may have been missed, and the service drops every copy it holds.
The connection is checked every half minute (and by TCP keepalives), so one
that died without a word is noticed and replaced: until every listener has read
them, PostgreSQL keeps notifications queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

import psycopg
from psycopg.sql import SQL, Identifier

from ledger.adapters.notices import notice_head, read_notice
from schemas import cancel_and_wait

__all__ = ["AppendNotices"]

_log = logging.getLogger(__name__)

_CHECK_EVERY_S = 30.0  # how often the connection is asked a question


class AppendNotices:
    """Listens for the events table's NOTIFY and calls `on_notice` for other writers'.

    `on_notice` gets the operation IDs another process appended to (of the ledger
    `store` names, `ledger.adapters.notices`); an empty sequence when a notice
    does not say which (the library's own statements, a release before this one);
    None when notices may have been missed (listening began, or began again after
    a drop): any copy may be stale. `writer`: this process's own token, whose
    notices are passed over.
    """

    def __init__(
        self,
        dsn: str,
        channel: str,
        *,
        store: str,
        writer: str,
        on_notice: Callable[[Sequence[str] | None], object],
        retry_after_s: float = 1.0,
        retry_at_most_s: float = 30.0,
    ) -> None:
        self._dsn = dsn
        self._channel = channel
        self._store = store
        self._writer = writer
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
        # Between tries (a test records the delays).
        self._sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    def start(self) -> None:
        """Listen on the running event loop until `stop`."""
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name="ledger-append-notices"
        )

    async def stop(self) -> None:
        """Stop listening and close the connection."""
        await cancel_and_wait(self._task)
        self._task = None
        self.listening.clear()
        self.backend_pid = None

    async def _run(self) -> None:
        delay = self._retry_after_s
        said = False  # the current outage was logged
        while True:
            try:
                await self._listen()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.listening.is_set():
                    # It had been listening: a new outage, retried from the first delay.
                    delay, said = self._retry_after_s, False
                    self.listening.clear()
                if not said:
                    _log.warning(
                        "not listening for other instances' appends (%s: %s); the relay"
                        " polls until the connection is back",
                        type(exc).__name__,
                        exc,
                    )
                    said = True
                await self._sleep(delay)
                delay = min(delay * 2, self._retry_at_most_s)

    async def _listen(self) -> None:
        conn = await psycopg.AsyncConnection.connect(
            self._dsn,
            autocommit=True,
            # A peer gone without a word is found by the kernel, not only by the
            # check below.
            keepalives=1,
            keepalives_idle=30,
            keepalives_interval=10,
            keepalives_count=3,
            # ... and a question left unanswered (keepalives wait for an idle socket).
            tcp_user_timeout=60_000,
        )
        try:
            await conn.execute(SQL("LISTEN {}").format(Identifier(self._channel)))
            self.backend_pid = conn.info.backend_pid
            self.listening.set()
            # Whatever was appended while nobody listened: look once, trust no copy.
            self._tell(None)
            while True:
                async for notice in conn.notifies(timeout=_CHECK_EVERY_S):
                    self._heard(notice.payload)
                # Every half minute, however busy: still there?
                async with asyncio.timeout(_CHECK_EVERY_S / 3):
                    await conn.execute("SELECT 1")
        finally:
            with contextlib.suppress(Exception):
                await conn.close()

    def _heard(self, payload: str) -> None:
        head = notice_head(payload)
        if head is not None and (head[0] != self._store or head[1] == self._writer):
            return  # another ledger's events, or this process's own append (most)
        notice = read_notice(payload) if head is not None else None
        self.heard += 1
        self._tell(notice.operation_ids if notice is not None else ())

    def _tell(self, operation_ids: Sequence[str] | None) -> None:
        try:
            self._on_notice(operation_ids)
        except Exception:  # a listener's failure never ends the listening
            _log.exception("acting on another instance's append failed")
