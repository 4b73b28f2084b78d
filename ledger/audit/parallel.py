"""Verifying a stored ledger chunk by chunk, in several processes when it pays.

The events table and the seal (`opledger_digest`) are both keyed by position,
so the positions split into consecutive chunks. Each chunk is read and
checked on its own (`ledger.audit.verify.verify_chunk`): its rows, its seal
rows, the chains inside it, the seal's running digest inside it. This process
then joins the summaries in position order (`ledger.audit.verify.stitch`),
which decides the few checks that cross a boundary. The findings are exactly
those of one sequential pass; only the work is spread.

Verification is CPU-bound Python (JSON decoding and SHA-256 per event), so
threads would not help; worker processes do, each with its own read-only
connection. They are forked when this process runs a single thread (about
10 ms each here, as much as verifying a thousand events), else started from a
fork server, since a fork copies the locks other threads hold. This process
verifies chunks too rather than wait. All take chunks in order from a shared
counter, so a worker slowed by a busy machine or a slow start just verifies
fewer. A small ledger is verified by this process alone (on PostgreSQL with
a thread reading the next chunk meanwhile). Either way no process holds more
than a few chunks of rows at a time.

A verification sees the ledger as it was when it started: every chunk reads
only up to the last event and the last seal row that existed then, so events
appended meanwhile are neither checked nor reported.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import queue
import sqlite3
import threading
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.util import Finalize
from typing import Any

import psycopg

from ledger.adapters.storage import StorageConfig
from ledger.audit.verify import (
    ChunkSummary,
    SealRow,
    StoredRow,
    VerificationReport,
    stitch,
    verify_chunk,
)

__all__ = [
    "COLD_START_THRESHOLD",
    "DEFAULT_CHUNK_SIZE",
    "PARALLEL_THRESHOLD",
    "LedgerTables",
    "verify_stored",
]

SEAL_TABLE = "opledger_digest"

DEFAULT_CHUNK_SIZE = 10_000
"""Positions per chunk: small enough to bound each process's memory and to
share the work evenly, large enough that per-chunk queries and summaries stay
a small part of it."""

_MIN_CHUNK_SIZE = 2_500
"""The smallest chunk chosen automatically: each costs a few queries and a summary."""

PARALLEL_THRESHOLD = 10_000
"""Below this many positions, this process verifies everything alone: below
it, forking a worker and opening its connection save less than they cost."""

COLD_START_THRESHOLD = 150_000
"""The same, when workers must come from a fork server not yet running: it
starts a new interpreter and imports the ledger first, about 0.7 s here."""

_forkserver_started = False

_LOCATE_BATCH = 500


@dataclass(frozen=True, slots=True)
class LedgerTables:
    """Where a ledger's events and seal are: its storage and its events table."""

    storage: StorageConfig
    events_table: str

    @property
    def position_column(self) -> str:
        """The events table's global position (SQLite has no notification ID column)."""
        return "notification_id" if self.storage.is_postgres else "rowid"


@dataclass(frozen=True, slots=True)
class _Chunk:
    after: int | None
    """Exclusive lower bound; None for the first chunk, which has none at all."""
    upto: int
    """Inclusive upper bound."""


@dataclass(frozen=True, slots=True)
class _Bounds:
    """The ledger as verification found it when it started."""

    tables: LedgerTables
    last_event: int
    """The last event position (0: none)."""
    last_sealed: int
    """The last sealed position (0: none)."""
    span: int
    """Positions from the first positive one to the last: about the number of events."""


@dataclass(frozen=True, slots=True)
class _Plan:
    """What every process needs to verify any chunk."""

    bounds: _Bounds
    chunks: tuple[_Chunk, ...]


def verify_stored(
    tables: LedgerTables,
    *,
    expected_head: str | None = None,
    workers: int | None = None,
    chunk_size: int | None = None,
) -> VerificationReport:
    """Verify the ledger in `tables`, at most `chunk_size` positions at a time.

    `workers` is how many processes verify chunks, this one included: None
    means one per CPU this process may use when the ledger spans at least
    `PARALLEL_THRESHOLD` positions (`COLD_START_THRESHOLD` when workers would
    need a fork server not yet started), else 1; 1 means this process alone.
    `chunk_size` None means about four chunks per process, at most
    `DEFAULT_CHUNK_SIZE` positions each. Every process reads through its own
    read-only connection. The report does not depend on `workers` or
    `chunk_size`.

    Workers are forked when this process runs a single thread, else started
    from a fork server (which, like any multiprocessing "spawn", imports the
    main module unless it is a package's `__main__`: a script that verifies
    from a threaded process needs the `if __name__ == "__main__"` guard).
    """
    if workers is not None and workers < 1:
        raise ValueError("workers must be at least 1")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError("chunk_size must be at least 1")
    with _collector_paused():
        reader = _Reader(tables.storage)
        try:
            bounds = _bounds(reader, tables)
            method = _start_method()
            if workers is None:
                cold = method == "forkserver" and not _forkserver_started
                threshold = COLD_START_THRESHOLD if cold else PARALLEL_THRESHOLD
                workers = _cpus() if bounds.span >= threshold else 1
            if method is None:
                workers = 1
            if chunk_size is None:
                chunk_size = max(
                    _MIN_CHUNK_SIZE, min(DEFAULT_CHUNK_SIZE, bounds.span // (4 * workers))
                )
            plan = _plan(reader, bounds, chunk_size)
            workers = min(workers, len(plan.chunks))

            def locate(hashes: Collection[str]) -> dict[str, int]:
                return _locate(reader, hashes, plan.bounds.last_sealed)

            if workers <= 1:
                last_sealed = plan.bounds.last_sealed
                alone = (
                    (verify_chunk(rows, seal, last_sealed) for rows, seal in _read_ahead(plan))
                    if tables.storage.is_postgres and len(plan.chunks) > 1
                    else (_verify_range(reader, plan, chunk) for chunk in plan.chunks)
                )
                return stitch(alone, locate, expected_head=expected_head)
            assert method is not None
            shared = _shared(reader, plan, workers - 1, method)
            return stitch(shared, locate, expected_head=expected_head)
        finally:
            reader.close()


def _cpus() -> int:
    # The CPUs this process may run on, which can be fewer than the machine's.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def _start_method() -> str | None:
    """How this process can start workers: "fork", "forkserver", or None (it cannot)."""
    if multiprocessing.current_process().daemon:
        return None  # a daemonic process (a pool's worker, say) may not have children
    methods = multiprocessing.get_all_start_methods()
    # A fork copies every lock as it is at that instant, held ones included,
    # and only the forking thread: the child of a process whose other threads
    # were inside SQLite or OpenSSL waits forever on their locks (seen here:
    # a worker stuck in SQLite's global mutex). So fork only a single thread;
    # with others about, start workers from a fork server, a clean process.
    if "fork" in methods and threading.active_count() == 1:
        return "fork"
    if "forkserver" in methods:
        return "forkserver"
    return None


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while verifying (then restore it).

    Verification keeps a chunk of rows alive at a time and allocates much
    besides, which sets off full collections that walk the whole heap of the
    process, the application around it included, to free nothing: 5-20% of
    the time, measured. Reference counting still frees everything verification
    lets go of.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _shared(reader: _Reader, plan: _Plan, helpers: int, method: str) -> Iterator[ChunkSummary]:
    """Every chunk's summary in position order, verified by this process and `helpers` more.

    Each process claims the next chunk from a shared counter when it is free,
    so the work divides by speed, not in fixed shares. The pool always has a
    task queued beyond the ones running, so a worker never waits for this
    process to notice it finished; a task that finds no chunk left returns
    None. Summaries are yielded as soon as all before them are in.
    """
    # Forked workers start with everything already imported; a fork server's
    # children too (it preloads this module), once it runs. Either way they
    # use none of this process's connections, only their own.
    global _forkserver_started
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload([__name__])
    claimed = context.Value("q", 0)
    pool = ProcessPoolExecutor(
        helpers,
        mp_context=context,
        initializer=_start_worker,
        initargs=(plan, claimed),
    )
    try:
        ready: dict[int, ChunkSummary] = {}
        tasks: set[Future[tuple[int, ChunkSummary] | None]] = set()
        total = len(plan.chunks)
        for index in range(total):
            while index not in ready:
                for task in [task for task in tasks if task.done()]:
                    tasks.discard(task)
                    result = task.result()  # a worker's error is raised here
                    if result is not None:
                        ready[result[0]] = result[1]
                if index in ready:
                    break
                while len(tasks) <= helpers and claimed.value < total:
                    tasks.add(pool.submit(_verify_next))
                mine = _claim(claimed, total)
                if mine is not None:
                    ready[mine] = _verify_range(reader, plan, plan.chunks[mine])
                elif tasks:
                    wait(tasks, return_when=FIRST_COMPLETED)
                else:  # every chunk is claimed and no task is left to deliver it
                    raise RuntimeError(f"chunk {index} of the verification was lost")
            yield ready.pop(index)
        _forkserver_started = _forkserver_started or method == "forkserver"
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _claim(claimed: Synchronized[int], total: int) -> int | None:
    """The next chunk nobody has taken, now taken; None when all are."""
    with claimed.get_lock():
        index = claimed.value
        if index >= total:
            return None
        claimed.value = index + 1
        return index


def _bounds(reader: _Reader, tables: LedgerTables) -> _Bounds:
    """The ledger's extent now. MIN and MAX of a primary key are index look-ups, not scans."""
    position, events = tables.position_column, tables.events_table
    ((last_event,),) = reader.query(f"SELECT MAX({position}) FROM {events}", ())
    ((last_sealed,),) = reader.query(f"SELECT MAX(notification_id) FROM {SEAL_TABLE}", ())
    ((first,),) = reader.query(f"SELECT MIN({position}) FROM {events} WHERE {position} > 0", ())
    last_event = int(last_event) if last_event is not None else 0
    last_sealed = int(last_sealed) if last_sealed is not None else 0
    # Forged rows at zero or below do not count: there are none in a sound ledger.
    span = max(last_event, last_sealed) - (int(first) if first is not None else 1) + 1
    return _Bounds(tables, last_event, last_sealed, max(span, 0))


def _plan(reader: _Reader, bounds: _Bounds, chunk_size: int) -> _Plan:
    """Consecutive chunks covering every event and seal row within `bounds`.

    The first chunk has no lower bound, so a row at any position (even the
    lowest 64-bit integer) is read. A chunk starts at the next position that
    holds an event or a seal row, so a forged row far from the others (at the
    highest 64-bit integer, say) adds one chunk, not a chunk per empty range.
    """
    position, events = bounds.tables.position_column, bounds.tables.events_table
    top = max(bounds.last_event, bounds.last_sealed)
    chunks: list[_Chunk] = []
    after: int | None = None
    while True:
        above = f"WHERE {position} > ?" if after is not None else ""
        sealed_above = "WHERE notification_id > ?" if after is not None else ""
        since = (after,) if after is not None else ()
        ((next_event,),) = reader.query(f"SELECT MIN({position}) FROM {events} {above}", since)
        ((next_sealed,),) = reader.query(
            f"SELECT MIN(notification_id) FROM {SEAL_TABLE} {sealed_above}", since
        )
        start = min((int(at) for at in (next_event, next_sealed) if at is not None), default=None)
        if start is None or start > top:
            return _Plan(bounds, tuple(chunks))
        upto = min(start + chunk_size - 1, top)
        chunks.append(_Chunk(after, upto))
        after = upto


def _verify_range(reader: _Reader, plan: _Plan, chunk: _Chunk) -> ChunkSummary:
    return verify_chunk(*_read_range(reader, plan, chunk), plan.bounds.last_sealed)


def _read_range(
    reader: _Reader, plan: _Plan, chunk: _Chunk
) -> tuple[Sequence[StoredRow], Sequence[SealRow]]:
    """The rows and the seal rows of one chunk, each in position order."""
    position, bounds = plan.bounds.tables.position_column, plan.bounds
    lower = f"{position} > ? AND " if chunk.after is not None else ""
    sealed_lower = "notification_id > ? AND " if chunk.after is not None else ""
    bound = (chunk.after,) if chunk.after is not None else ()
    rows: Sequence[StoredRow] = reader.query(  # (int, str, int, str, bytes)
        f"SELECT {position}, originator_id, originator_version, topic, state"
        f" FROM {bounds.tables.events_table} WHERE {lower}{position} <= ? ORDER BY {position}",
        (*bound, min(chunk.upto, bounds.last_event)),
    )
    seal: Sequence[SealRow] = reader.query(  # (int, str, int, str, str)
        "SELECT notification_id, operation_id, version, event_hash, running_digest"
        f" FROM {SEAL_TABLE} WHERE {sealed_lower}notification_id <= ? ORDER BY notification_id",
        (*bound, min(chunk.upto, bounds.last_sealed)),
    )
    return rows, seal


def _read_ahead(plan: _Plan) -> Iterator[tuple[Sequence[StoredRow], Sequence[SealRow]]]:
    """Every chunk's rows and seal rows in order, the next read while this one is checked.

    For PostgreSQL: a query's rows arrive only after the server has produced
    them, and meanwhile this process would wait. A thread with a connection
    of its own reads one chunk ahead (psycopg waits without the GIL), which
    made one-process verification about 30% faster here. Not for SQLite: its
    reads hold the GIL, and there it made verification slower.
    """
    ahead: queue.Queue[tuple[Sequence[StoredRow], Sequence[SealRow]] | BaseException] = queue.Queue(
        maxsize=1
    )
    stop = threading.Event()

    def hand_over(item: tuple[Sequence[StoredRow], Sequence[SealRow]] | BaseException) -> bool:
        while not stop.is_set():  # the consumer may have given up
            try:
                ahead.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            reader = _Reader(plan.bounds.tables.storage)
            try:
                for chunk in plan.chunks:
                    if not hand_over(_read_range(reader, plan, chunk)):
                        return
            finally:
                reader.close()
        except BaseException as error:  # raised again in the consumer's thread
            hand_over(error)

    thread = threading.Thread(target=read, name="opledger-verify-reader", daemon=True)
    thread.start()
    try:
        for _ in plan.chunks:
            item = ahead.get()
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def _locate(reader: _Reader, hashes: Collection[str], last_sealed: int) -> dict[str, int]:
    """The last sealed position of each hash (asked only about mismatches, so rarely)."""
    wanted = sorted(hashes)
    located: dict[str, int] = {}
    for start in range(0, len(wanted), _LOCATE_BATCH):
        batch = wanted[start : start + _LOCATE_BATCH]
        marks = ", ".join("?" * len(batch))
        for event_hash, position in reader.query(
            f"SELECT event_hash, MAX(notification_id) FROM {SEAL_TABLE}"
            f" WHERE notification_id <= ? AND event_hash IN ({marks}) GROUP BY event_hash",
            (last_sealed, *batch),
        ):
            located[str(event_hash)] = int(position)
    return located


class _Reader:
    """A read-only connection of one process's own."""

    def __init__(self, storage: StorageConfig) -> None:
        self._sqlite: sqlite3.Connection | None = None
        self._postgres: psycopg.Connection[Any] | None = None
        if storage.sqlite_path is not None:
            uri = storage.sqlite_path.resolve().as_uri() + "?mode=ro"
            self._sqlite = sqlite3.connect(uri, uri=True, timeout=10, isolation_level=None)
            return
        self._postgres = psycopg.connect(storage.postgres_dsn or "", autocommit=True)
        if storage.postgres_schema:
            self._postgres.execute(f'SET search_path TO "{storage.postgres_schema}"')

    def query(self, statement: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """Rows of one statement with `?` placeholders."""
        if self._sqlite is not None:
            return self._sqlite.execute(statement, params).fetchall()
        assert self._postgres is not None
        # Binary results: a bytea arrives as its bytes rather than as hex text
        # to decode, about a microsecond less per event. The Python types are
        # the same (int, str, bytes).
        cursor = self._postgres.cursor(binary=True)
        return cursor.execute(statement.replace("?", "%s"), params).fetchall()

    def close(self) -> None:
        """Close the connection."""
        if self._sqlite is not None:
            self._sqlite.close()
        if self._postgres is not None:
            self._postgres.close()


# ------------------------------------------------------------------ workers

_worker: tuple[_Reader, _Plan, Synchronized[int]] | None = None


def _start_worker(plan: _Plan, claimed: Synchronized[int]) -> None:
    """Open this worker's own connection, for every chunk it will verify."""
    global _worker
    # The worker lives for one verification and makes no reference cycles
    # worth collecting: the collector would only walk the forked heap (and
    # might finalize this copy of the parent's objects).
    gc.disable()
    reader = _Reader(plan.bounds.tables.storage)
    Finalize(None, reader.close, exitpriority=10)
    _worker = (reader, plan, claimed)


def _verify_next() -> tuple[int, ChunkSummary] | None:
    """Claim the next chunk and verify it; None when every chunk is taken."""
    assert _worker is not None, "the pool's initializer sets the worker up"
    reader, plan, claimed = _worker
    index = _claim(claimed, len(plan.chunks))
    if index is None:
        return None
    return index, _verify_range(reader, plan, plan.chunks[index])
