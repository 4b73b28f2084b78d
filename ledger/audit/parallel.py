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

The seal's signatures are keyed by position too and are checked chunk by
chunk with the seal rows they sign. Which head is the last one a trusted key
signed is decided first, in this process (usually one signature check: the
newest), since every chunk needs it to tell the events past it. The view and
the kept results are checked in one more pass, by operation rather than by
position (`ledger.audit.model`), in one snapshot of its own.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import queue
import sqlite3
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.util import Finalize
from typing import Any, TypeVar

import psycopg

from ledger.adapters.event_tables import EventTables, StoredRow
from ledger.adapters.results import RESULTS_TABLE
from ledger.adapters.storage import READ_ONLY_OPTIONS, StorageConfig
from ledger.audit.model import verify_model
from ledger.audit.seal import DIGEST_TABLE, SIGNATURES_TABLE, SignedHead, TrustedKeys
from ledger.audit.verify import (
    DEFAULT_SEAL_GRACE,
    ChunkSummary,
    SealPolicy,
    SealRow,
    SignatureRow,
    VerificationReport,
    check_anchor,
    find_signed_head,
    stitch,
    verify_chunk,
)
from ledger.domain.errors import InvalidArgument
from ledger.projections.operations_view import ROW_COLUMNS, VIEW_NAME

_T = TypeVar("_T")

Progress = Callable[[int, int], None]
"""Told (done, total) as work goes: for a progress line, never for a result."""

__all__ = [
    "COLD_START_THRESHOLD",
    "DEFAULT_CHUNK_SIZE",
    "PARALLEL_THRESHOLD",
    "EventTables",
    "trusted_head",
    "verify_stored",
]


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
class _Chunk:
    after: int | None
    """Exclusive lower bound; None for the first chunk, which has none at all."""
    upto: int
    """Inclusive upper bound."""


@dataclass(frozen=True, slots=True)
class _Bounds:
    """The ledger as verification found it when it started."""

    tables: EventTables
    last_event: int
    """The last event position (0: none)."""
    last_sealed: int
    """The last sealed position (0: none)."""
    span: int
    """Positions from the first positive one to the last: about the number of events."""
    last_signature: int = 0
    """The last signed position (0: none)."""
    has_seal: bool = True
    has_signatures: bool = True
    """Whether those tables exist (a ledger from before signatures has none)."""


@dataclass(frozen=True, slots=True)
class _Plan:
    """What every process needs to verify any chunk."""

    bounds: _Bounds
    chunks: tuple[_Chunk, ...]
    policy: SealPolicy | None = None


def verify_stored(
    tables: EventTables,
    *,
    expected_head: str | None = None,
    workers: int | None = None,
    chunk_size: int | None = None,
    trusted: Sequence[str] | None = None,
    now: datetime | None = None,
    grace: timedelta = DEFAULT_SEAL_GRACE,
    anchor: SignedHead | None = None,
    model: bool = True,
    progress: Progress | None = None,
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

    `trusted`: the public keys whose seal signatures count (None: signatures
    are not looked at, the digest chain alone is checked); events past the
    last trusted head older than `grace` before `now`, or dated more than
    `grace` after it, are findings. `anchor`: a head kept earlier, which the
    seal must still hold. `model`: check the view and the kept results too.
    `progress(done, total)` is told each verified chunk (for a progress line).
    """
    if workers is not None and workers < 1:
        raise InvalidArgument("workers must be at least 1")
    if chunk_size is not None and chunk_size < 1:
        raise InvalidArgument("chunk_size must be at least 1")
    with _collector_paused():
        reader = _Reader(tables.storage)
        try:
            bounds = _bounds(reader, tables)
            signed: SignedHead | None = None
            policy: SealPolicy | None = None
            if trusted is not None:
                signed = _signed_head(reader, TrustedKeys(trusted), bounds)
                policy = SealPolicy(
                    tuple(trusted),
                    signed.position if signed is not None else 0,
                    now or datetime.now(UTC),
                    grace,
                )
            method = _start_method()
            if workers is None:
                cold = method == "forkserver" and not _forkserver_started
                threshold = COLD_START_THRESHOLD if cold else PARALLEL_THRESHOLD
                workers = _cpus() if bounds.span >= threshold else 1
            if method is None:
                workers = 1
            # In parallel, the view and results pass (by operation, not by
            # position) runs in a process of its own beside the chunks.
            beside = _start_model(tables.storage, method) if model and workers > 1 else None
            try:
                report = _verify_chunks(
                    reader,
                    bounds,
                    workers,
                    method,
                    chunk_size,
                    policy,
                    signed,
                    expected_head,
                    progress,
                )
                if anchor is not None:
                    digest = _sealed_digest(reader, bounds, anchor.position)
                    report.findings.extend(check_anchor(anchor, digest, signed))
                if model:
                    summary = (
                        beside[1].result() if beside is not None else _verify_model(tables.storage)
                    )
                    report.findings.extend(summary.findings)
                    report.view_rows_checked = summary.view_rows
                    report.results_checked = summary.results
            finally:
                if beside is not None:
                    beside[0].shutdown(wait=True, cancel_futures=True)
            return report
        finally:
            reader.close()


def _start_model(
    storage: StorageConfig, method: str | None
) -> tuple[ProcessPoolExecutor, Future[Any]] | None:
    """The view and results pass, started in a process of its own (None: cannot)."""
    if method is None:
        return None
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload([__name__])
    pool = ProcessPoolExecutor(1, mp_context=context, initializer=gc.disable)
    return pool, pool.submit(_verify_model, storage)


def _verify_chunks(
    reader: _Reader,
    bounds: _Bounds,
    workers: int,
    method: str | None,
    chunk_size: int | None,
    policy: SealPolicy | None,
    signed: SignedHead | None,
    expected_head: str | None,
    progress: Progress | None = None,
) -> VerificationReport:
    """The chunked part: events, the seal and its signatures, position by position.

    `workers` and `method` as `verify_stored` resolved them (how many processes,
    started how), before anything else started a thread or a process.
    """
    if chunk_size is None:
        chunk_size = max(
            _MIN_CHUNK_SIZE, min(DEFAULT_CHUNK_SIZE, bounds.span // (4 * workers))
        )
    plan = _plan(reader, bounds, chunk_size, policy)
    workers = min(workers, len(plan.chunks))

    def locate(hashes: Collection[str]) -> dict[str, int]:
        return _locate(reader, hashes, plan.bounds.last_sealed)

    if workers <= 1:
        alone = (
            (_verify_read(plan, *read) for read in _read_ahead(plan))
            if bounds.tables.storage.is_postgres and len(plan.chunks) > 1
            else (_verify_range(reader, plan, chunk) for chunk in plan.chunks)
        )
        return stitch(
            _told(alone, len(plan.chunks), progress),
            locate,
            expected_head=expected_head,
            policy=policy,
            signed_head=signed,
        )
    assert method is not None
    shared = _shared(reader, plan, workers - 1, method)
    return stitch(
        _told(shared, len(plan.chunks), progress),
        locate,
        expected_head=expected_head,
        policy=policy,
        signed_head=signed,
    )


def _told(chunks: Iterable[_T], total: int, progress: Progress | None) -> Iterator[_T]:
    """`chunks` as they come, telling `progress` how many of `total` are done."""
    for done, chunk in enumerate(chunks, 1):
        if progress is not None:
            progress(done, total)
        yield chunk


def trusted_head(tables: EventTables, trusted: Sequence[str]) -> SignedHead | None:
    """The last head one of the `trusted` keys signed whose digest is the seal's there."""
    reader = _Reader(tables.storage)
    try:
        return _signed_head(reader, TrustedKeys(trusted), _bounds(reader, tables))
    finally:
        reader.close()


def _signed_head(reader: _Reader, trusted: TrustedKeys, bounds: _Bounds) -> SignedHead | None:
    """The last head a trusted key signed whose digest is the seal's (newest first, paged)."""
    if not bounds.has_signatures or not bounds.has_seal:
        return None
    below = bounds.last_signature + 1
    while True:
        rows: list[SignatureRow] = [
            (int(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]))
            for r in reader.query(
                "SELECT position, running_digest, sealed_at, public_key, signature"
                f" FROM {SIGNATURES_TABLE} WHERE position < ? ORDER BY position DESC LIMIT 100",
                (below,),
            )
        ]
        if not rows:
            return None
        head = find_signed_head(
            rows, lambda position: _sealed_digest(reader, bounds, position), trusted
        )
        if head is not None:
            return head
        below = rows[-1][0]


def _sealed_digest(reader: _Reader, bounds: _Bounds, position: int) -> str | None:
    if not bounds.has_seal:
        return None
    rows = reader.query(
        f"SELECT running_digest FROM {DIGEST_TABLE} WHERE notification_id = ?", (position,)
    )
    return str(rows[0][0]) if rows else None


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


def _bounds(reader: _Reader, tables: EventTables) -> _Bounds:
    """The ledger's extent now. MIN and MAX of a primary key are index look-ups, not scans."""
    present = reader.tables()
    has_seal, has_signatures = DIGEST_TABLE in present, SIGNATURES_TABLE in present
    ((last_event,),) = reader.query(tables.last_position_sql(), ())
    last_sealed = last_signature = None
    if has_seal:
        ((last_sealed,),) = reader.query(f"SELECT MAX(notification_id) FROM {DIGEST_TABLE}", ())
    if has_signatures:
        ((last_signature,),) = reader.query(f"SELECT MAX(position) FROM {SIGNATURES_TABLE}", ())
    ((first,),) = reader.query(tables.first_position_sql(), ())
    last_event = int(last_event) if last_event is not None else 0
    last_sealed = int(last_sealed) if last_sealed is not None else 0
    last_signature = int(last_signature) if last_signature is not None else 0
    # Forged rows at zero or below do not count: there are none in a sound ledger.
    span = max(last_event, last_sealed) - (int(first) if first is not None else 1) + 1
    return _Bounds(
        tables,
        last_event,
        last_sealed,
        max(span, 0),
        last_signature,
        has_seal,
        has_signatures,
    )


def _plan(
    reader: _Reader, bounds: _Bounds, chunk_size: int, policy: SealPolicy | None = None
) -> _Plan:
    """Consecutive chunks covering every event, seal row and signature within `bounds`.

    The first chunk has no lower bound, so a row at any position (even the
    lowest 64-bit integer) is read. A chunk starts at the next position that
    holds an event, a seal row or a signature, so a forged row far from the
    others (at the highest 64-bit integer, say) adds one chunk, not a chunk
    per empty range.
    """
    position, events = bounds.tables.position_column, bounds.tables.events_table
    top = max(bounds.last_event, bounds.last_sealed, bounds.last_signature)
    tables = [(events, position)]
    if bounds.has_seal:
        tables.append((DIGEST_TABLE, "notification_id"))
    if bounds.has_signatures:
        tables.append((SIGNATURES_TABLE, "position"))
    chunks: list[_Chunk] = []
    after: int | None = None
    while True:
        since = (after,) if after is not None else ()
        nexts = []
        for table, column in tables:
            above = f"WHERE {column} > ?" if after is not None else ""
            ((at,),) = reader.query(f"SELECT MIN({column}) FROM {table} {above}", since)
            nexts.append(at)
        start = min((int(at) for at in nexts if at is not None), default=None)
        if start is None or start > top:
            return _Plan(bounds, tuple(chunks), policy)
        upto = min(start + chunk_size - 1, top)
        chunks.append(_Chunk(after, upto))
        after = upto


_Read = tuple[Sequence[StoredRow], Sequence[SealRow], Sequence[SignatureRow]]


def _verify_range(reader: _Reader, plan: _Plan, chunk: _Chunk) -> ChunkSummary:
    return _verify_read(plan, *_read_range(reader, plan, chunk))


def _verify_read(
    plan: _Plan,
    rows: Sequence[StoredRow],
    seal: Sequence[SealRow],
    signatures: Sequence[SignatureRow],
) -> ChunkSummary:
    return verify_chunk(
        rows, seal, plan.bounds.last_sealed, signatures=signatures, policy=plan.policy
    )


def _read_range(reader: _Reader, plan: _Plan, chunk: _Chunk) -> _Read:
    """The rows, the seal rows and the signatures of one chunk, each in position order."""
    bounds = plan.bounds
    sealed_lower = "notification_id > ? AND " if chunk.after is not None else ""
    signed_lower = "position > ? AND " if chunk.after is not None else ""
    bound = (chunk.after,) if chunk.after is not None else ()
    rows: Sequence[StoredRow] = reader.query(  # (int, str, int, str, bytes)
        bounds.tables.rows_upto_sql(after=chunk.after is not None),
        (*bound, min(chunk.upto, bounds.last_event)),
    )
    seal: Sequence[SealRow] = ()
    if bounds.has_seal:
        seal = reader.query(  # (int, str, int, str, str)
            "SELECT notification_id, operation_id, version, event_hash, running_digest"
            f" FROM {DIGEST_TABLE} WHERE {sealed_lower}notification_id <= ?"
            " ORDER BY notification_id",
            (*bound, min(chunk.upto, bounds.last_sealed)),
        )
    signatures: Sequence[SignatureRow] = ()
    if bounds.has_signatures and plan.policy is not None:
        signatures = reader.query(  # (int, str, str, str, str)
            "SELECT position, running_digest, sealed_at, public_key, signature"
            f" FROM {SIGNATURES_TABLE} WHERE {signed_lower}position <= ? ORDER BY position",
            (*bound, min(chunk.upto, bounds.last_signature)),
        )
    return rows, seal, signatures


def _read_ahead(plan: _Plan) -> Iterator[_Read]:
    """Every chunk's rows and seal rows in order, the next read while this one is checked.

    For PostgreSQL: a query's rows arrive only after the server has produced
    them, and meanwhile this process would wait. A thread with a connection
    of its own reads one chunk ahead (psycopg waits without the GIL), which
    made one-process verification about 30% faster here. Not for SQLite: its
    reads hold the GIL, and there it made verification slower.
    """
    ahead: queue.Queue[_Read | BaseException] = queue.Queue(maxsize=1)
    stop = threading.Event()

    def hand_over(item: _Read | BaseException) -> bool:
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
            f"SELECT event_hash, MAX(notification_id) FROM {DIGEST_TABLE}"
            f" WHERE notification_id <= ? AND event_hash IN ({marks}) GROUP BY event_hash",
            (last_sealed, *batch),
        ):
            located[str(event_hash)] = int(position)
    return located


class _Reader:
    """A read-only connection of one process's own.

    `snapshot`: every query sees the database as of the first one (one
    read-only transaction until `close`), and `stream` may be used.
    """

    def __init__(self, storage: StorageConfig, *, snapshot: bool = False) -> None:
        self._sqlite: sqlite3.Connection | None = None
        self._postgres: psycopg.Connection[Any] | None = None
        self._streams = 0
        if storage.sqlite_path is not None:
            uri = storage.sqlite_path.resolve().as_uri() + "?mode=ro"
            self._sqlite = sqlite3.connect(uri, uri=True, timeout=10, isolation_level=None)
            if snapshot:
                self._sqlite.execute("BEGIN")
            return
        self._postgres = psycopg.connect(
            storage.postgres_dsn or "", autocommit=not snapshot, options=READ_ONLY_OPTIONS
        )
        if snapshot:
            self._postgres.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
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

    def stream(
        self, statement: str, params: Sequence[Any] = (), size: int = 2_000
    ) -> Iterator[tuple[Any, ...]]:
        """The rows of one query, `size` at a time (several streams may be open at once)."""
        if self._sqlite is not None:
            cursor = self._sqlite.execute(statement, params)
            while rows := cursor.fetchmany(size):
                yield from rows
            return
        assert self._postgres is not None
        self._streams += 1
        # A server-side cursor: the server keeps the rows, not this process.
        with self._postgres.cursor(name=f"opledger_verify_{self._streams}", binary=True) as cur:
            cur.itersize = size
            cur.execute(statement.replace("?", "%s"), params)
            yield from cur

    def tables(self) -> set[str]:
        """The tables this connection sees (in its schema, for PostgreSQL)."""
        if self._sqlite is not None:
            rows = self.query("SELECT name FROM sqlite_master WHERE type = 'table'", ())
        else:
            rows = self.query(
                "SELECT table_name FROM information_schema.tables"
                " WHERE table_schema = current_schema()",
                (),
            )
        return {str(row[0]) for row in rows}

    def close(self) -> None:
        """Close the connection."""
        if self._sqlite is not None:
            self._sqlite.close()
        if self._postgres is not None:
            self._postgres.close()


def _verify_model(storage: StorageConfig) -> Any:
    """The view and the kept results against the events, in one snapshot, by operation."""
    reader = _Reader(storage, snapshot=True)
    try:
        present = reader.tables()
        # Code point order in both: SQLite's default; PostgreSQL's only with "C".
        collate = ' COLLATE "C"' if storage.is_postgres else ""
        view_position = 0
        if "opledger_positions" in present:
            rows = reader.query(
                "SELECT position FROM opledger_positions WHERE name = ?", (VIEW_NAME,)
            )
            view_position = int(rows[0][0]) if rows else 0
        events = reader.stream(EventTables(storage).rows_by_operation_sql())
        view: Iterator[tuple[Any, ...]] = iter(())
        if "opledger_operations" in present:
            # A view made before a column existed (and not opened for writing since:
            # a backup, an auditor's copy) reads it as empty, as the service would.
            have = _view_columns(reader, storage)
            columns = [c if c in have else f"NULL AS {c}" for c in ROW_COLUMNS]
            view = reader.stream(
                f"SELECT {', '.join(columns)} FROM opledger_operations"
                f" ORDER BY operation_id{collate}"
            )
        results: Iterator[Any] = iter(())
        if RESULTS_TABLE in present:
            results = reader.stream(
                f"SELECT result_ref, operation_id, envelope FROM {RESULTS_TABLE}"
                f" ORDER BY operation_id{collate}, result_ref{collate}"
            )
        return verify_model(events, view, results, view_position=view_position)
    finally:
        reader.close()


def _view_columns(reader: _Reader, storage: StorageConfig) -> set[str]:
    """The columns the operations view's table has."""
    if storage.is_postgres:
        rows = reader.query(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = current_schema() AND table_name = ?",
            ("opledger_operations",),
        )
        return {str(row[0]) for row in rows}
    return {str(row[1]) for row in reader.query("PRAGMA table_info(opledger_operations)", ())}


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
