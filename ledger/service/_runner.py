"""The command runner: load an operation, run one command on it, save its new events.

Every use case of the service layer runs its commands through here, so the
rules of concurrency live in one place: appends are atomic and versioned, a
writer that lost a race reloads and runs its command again on the fresh
state, and an answer computed from a cached copy is believed only when it
appended something (the append's version check proved the copy current).

Two pieces of the library's machinery are not used, measured:

`Application.save` collects pending events through `ProcessingEvent`, which
checks every object against the library's runtime-checkable protocols, and
on Python 3.11 those `isinstance` checks are slow: the ledger bench's happy
path (`bench/ledger_bench.py`, SQLite, 6,000 operations, three alternating
runs) did 3,722-3,792 operations/s through `Application.save` and
4,268-4,337 through `EventStore.put`. So saving here appends the collected
events with `EventStore.put`, the same recorder call, without the
snapshotting and notifying the ledger does not use.

The repository's aggregate cache (`AGGREGATE_CACHE_MAXSIZE`,
`AGGREGATE_CACHE_FASTFORWARD`) is not used, for three reasons:

- it is bounded by count only, while operations differ in size by three
  orders of magnitude (2,400 proposals of 512 KiB took the service to 1.1 GB,
  issue 11); this cache is bounded in bytes of stored history (`Recent`);
- fast-forward queries the store on every `get` to catch a cached copy up,
  and without it a stale copy would be believed; here the append's version
  check catches a stale copy, so a command on a cached operation reads nothing;
- it deep-copies the cached aggregate on every `get`: 28 µs for a settled
  operation of five events (a replay from SQLite is 101 µs), on every command.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from eventsourcing.application import AggregateNotFoundError
from eventsourcing.persistence import IntegrityError, StoredEvent

from ledger._recent import Recent
from ledger.adapters.event_tables import EventTableReader, StoredRow
from ledger.adapters.eventstore import EventStoreApp
from ledger.adapters.recorders import KeptResultRow
from ledger.domain.errors import LedgerError, OperationConflict, OperationNotFound
from ledger.domain.operation import Operation
from ledger.domain.plan import Plan
from schemas import OpledgerError

__all__ = ["Command", "CommandRunner", "OneAppendAbandoned"]

_log = logging.getLogger(__name__)
T = TypeVar("T")
# Operations read per query by `CommandRunner.load`: few enough that one query's
# histories stay small (an operation's may be a few MiB), many enough for a batch.
_LOAD_CHUNK = 32
Command = Callable[[Operation], T]
"""A command on one loaded operation: it triggers events, or refuses by raising."""


class OneAppendAbandoned(OpledgerError):
    """A `CommandRunner.one_append` block could not keep its changes apart: nothing of it
    was saved (the caller runs its work again, one save per step).

    Deliberately not a `LedgerError`: those are one item's refusal, which the
    runner hands back as that item's answer; this one must end the whole block.
    """

    code = "ONE_APPEND_ABANDONED"
    retryable = True


class CommandRunner:
    """Loads, runs commands on and saves operations, with a cache of recent writes."""

    def __init__(
        self,
        events: EventStoreApp,
        tables: EventTableReader,
        *,
        conflict_retries: int = 5,
        # A few seconds of traffic: operations in flight are what commands
        # touch. More costs GC time: every cached aggregate is walked by each
        # full collection (10,000 made 30-50 ms pauses in the service).
        cache_size: int = 2_000,
        # And bounded in bytes (of stored history; the objects weigh a few
        # times that): 2,000 operations of 512 KiB would be a gigabyte.
        cache_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.events = events
        self.tables = tables
        self._conflict_retries = conflict_retries
        # Operations this instance wrote last, for commands only. A stale entry
        # is harmless: its append fails on the version check and the command
        # runs again on the stored state; a refusal from a cached state is
        # likewise re-checked against the stored one before it is believed.
        self._cache: Recent[str, Operation] = Recent(cache_size, max_weight=cache_bytes)
        self._cache_bytes = cache_bytes
        self._cache_lock = threading.Lock()
        # Inside `one_append`: the operations saved so far (their events not yet
        # appended).
        self._held: dict[str, Operation] | None = None
        # Kept result texts commands asked to store with their operation's events
        # (`keep_with_events`): operation ID → reference → row.
        self._kept: dict[str, dict[str, KeptResultRow]] = {}
        self._stored_listeners: list[Callable[[Sequence[StoredRow]], object]] = []

    # ------------------------------------------------------------------ loading

    def get(self, operation_id: str, *, version: int | None = None) -> Operation:
        """The stored operation as of now, or as of `version` (inside `one_append`: with
        what the block saved so far, which is stored once the block ends)."""
        if self._held is not None and version is None and operation_id in self._held:
            return self._held[operation_id]
        try:
            operation: Operation = self.events.repository.get(
                operation_id, version=version, projector_func=_replay
            )
        except AggregateNotFoundError:
            raise OperationNotFound("no such operation", operation_id=operation_id) from None
        if not isinstance(operation, Operation):
            # A plan's ID (`<host>/<id>~plan`): not an operation, and no operation's
            # command may run on it (an approval page's call route denied a plan so).
            raise OperationNotFound("no such operation", operation_id=operation_id)
        return operation

    def load(
        self, operation_ids: Iterable[str], *, remember: bool = True
    ) -> dict[str, Operation]:
        """The operations among these that this process holds no copy of, read a few
        dozen per query and kept as copies unless not to `remember` (an operation
        unknown, not an operation, or unreadable is left out: `get` says so when asked).

        For a batch of commands or statuses on operations another instance wrote
        last (several services on one database): a round trip per few dozen
        instead of one replay each. A single one is left to `get`, as fast. What
        is read is bounded by the copies' own budget in bytes: past it, the rest
        is left to `get` too.
        """
        wanted = [
            operation_id
            for operation_id in dict.fromkeys(operation_ids)
            if self.cached(operation_id) is None
        ]
        if len(wanted) < 2:
            return {}
        mapper = self.events.mapper
        loaded: dict[str, Operation] = {}
        weight = 0
        for start in range(0, len(wanted), _LOAD_CHUNK):
            histories: dict[str, list[StoredEvent]] = {}
            for row in self.tables.events_of(wanted[start : start + _LOAD_CHUNK]):
                histories.setdefault(str(row[0]), []).append(
                    StoredEvent(str(row[0]), int(row[1]), str(row[2]), bytes(row[3]))
                )
            for operation_id, stored in histories.items():
                try:
                    operation = _replay(None, (mapper.to_domain_event(e) for e in stored))
                except Exception:  # one unreadable operation: `get` reports it on its own
                    continue
                if isinstance(operation, Operation):
                    loaded[operation_id] = operation
                    weight += operation.history_bytes
            if weight >= self._cache_bytes:
                break
        if remember:
            with self._cache_lock:
                for operation_id, operation in loaded.items():
                    self._cache.remember(operation_id, operation, operation.history_bytes)
        return loaded

    def history(self, operation_id: str) -> list[Any]:
        """Every stored event of one operation, oldest first."""
        events = list(self.events.events.get(operation_id))
        if not events:
            raise OperationNotFound("no such operation", operation_id=operation_id)
        return events

    def current(self, operation_id: str, *, known_version: int | None = None) -> Operation:
        """The operation, from this process's copy when that is provably current.

        `known_version`: the caller saw the operation reach this version. Without
        it, one index lookup says whether the copy is current (another instance
        may have written since); a replay decodes every event.
        """
        cached = self.cached(operation_id)
        if cached is not None and known_version is None:
            known_version = self.tables.stored_version(operation_id)
        if cached is not None and known_version is not None and cached.version >= known_version:
            return cached
        return self.get(operation_id)

    @property
    def cached_bytes(self) -> int:
        """The stored-history bytes of the operations cached now (bounded)."""
        with self._cache_lock:
            return self._cache.weight

    def cached(self, operation_id: str) -> Operation | None:
        """This process's last written copy, if it still has one (maybe stale)."""
        if self._held is not None and operation_id in self._held:
            return self._held[operation_id]
        with self._cache_lock:
            return self._cache.get(operation_id)

    # ------------------------------------------------------------------- saving

    def save(self, *operations: Operation | Plan) -> None:
        """Append the new events of `operations` atomically, and remember them (inside
        `one_append`: at the block's end, with everything else the block saved). A
        plan is saved with the operations of its steps; it is never cached here."""
        if self._held is not None:
            for operation in operations:
                if not isinstance(operation, Operation):
                    raise OneAppendAbandoned("a plan is saved on its own, never in a block")
                held = self._held.setdefault(operation.id, operation)
                if held is not operation:
                    # Two copies of one operation with changes of their own: they
                    # cannot both be appended; the steps run again, each on its own.
                    raise OneAppendAbandoned(f"two copies of {operation.id} changed")
            return
        events = [event for operation in operations for event in operation.collect_events()]
        kept = [
            row for operation in operations for row in self._kept.pop(operation.id, {}).values()
        ]
        try:
            recordings = self.events.events.put(events, results=kept)
        except BaseException:
            self.forget(*(operation.id for operation in operations))
            raise
        with self._cache_lock:
            for operation in operations:
                if isinstance(operation, Operation):
                    self._cache.remember(operation.id, operation, operation.history_bytes)
        if self._stored_listeners and recordings:
            # The events are stored: nothing here may look like a failed save (the
            # gateway would run the turn's commands again on top of what is stored).
            try:
                rows = [
                    (n.id, str(n.originator_id), n.originator_version, n.topic, n.state)
                    for n in (recording.notification for recording in recordings)
                ]
                for listener in self._stored_listeners:
                    listener(rows)
            except Exception:
                _log.exception("a listener to stored events failed")

    def on_stored(self, listener: Callable[[Sequence[StoredRow]], object]) -> None:
        """Call `listener` with the rows of every append once it is stored (committed),
        as the table holds them: (position, operation ID, version, topic, state)."""
        self._stored_listeners.append(listener)

    def keep_with_events(self, operation_id: str, reference: str, text: str) -> None:
        """Store this kept result text in the same transaction as the operation's next
        saved events (the ones a command just triggered that bind it by hash): both
        are stored, or neither (`ledger.adapters.recorders`). A command run again
        (a lost race) keeps again; a copy forgotten keeps nothing."""
        self._kept.setdefault(operation_id, {})[reference] = (reference, operation_id, text)

    def forget(self, *operation_ids: str) -> None:
        """Drop cached copies (after a failed command or append), and what they kept."""
        for operation_id in operation_ids:
            self._kept.pop(operation_id, None)
        if self._held is not None and any(oid in self._held for oid in operation_ids):
            # A command failed on an operation an earlier step of the block changed:
            # its copy may hold half of that command's events. Nothing is kept.
            raise OneAppendAbandoned(f"a command failed on {operation_ids[0]}, changed before")
        with self._cache_lock:
            for operation_id in operation_ids:
                self._cache.pop(operation_id, None)

    def evict(self, operation_ids: Iterable[str]) -> None:
        """Drop the cached copies of operations another writer has just appended to
        (`ledger.adapters.append_notices`): a command then loads the stored state
        once, instead of failing its append on a stale copy and running again."""
        with self._cache_lock:
            for operation_id in operation_ids:
                self._cache.pop(operation_id, None)

    def evict_all(self) -> None:
        """Drop every cached copy: another writer's appends may have gone unheard."""
        with self._cache_lock:
            self._cache.clear()

    @contextmanager
    def one_append(self) -> Iterator[None]:
        """Every save inside the block becomes one append at its end.

        For a service that serves several kinds of requests in one turn (new
        proposals, leases, results): one transaction instead of one per kind.
        Inside, loading an operation the block changed gives the changed copy, so
        a later step builds on an earlier one's events. If anything in the block
        raises, or the append fails (another writer won a race: `IntegrityError`),
        nothing of the block is stored, the copies it changed are forgotten, and the
        exception goes to the caller, who runs the steps again one save each.
        """
        if self._held is not None:
            raise RuntimeError("one_append blocks do not nest")
        self._held = {}
        try:
            yield
            held = list(self._held.values())
            self._held = None
            if held:
                self.save(*held)
        except BaseException:
            abandoned = list(self._held or ())
            self._held = None
            self.forget(*abandoned)
            raise

    # ---------------------------------------------------------------- commands

    def update(self, operation_id: str, command: Command[T], *, use_cache: bool = True) -> T:
        """Run `command` on the operation and save; on a lost race, again on fresh state.

        A cached operation may be stale (another process wrote since). An answer
        that appends events is safe anyway: the append's version check fails
        and the command runs again on the stored state. An answer that appends
        nothing (a refusal, "busy", "done", a duplicate) is believed only when
        it was computed from the stored state.
        """
        operation = self.cached(operation_id) if use_cache else None
        for _ in range(self._conflict_retries):
            from_cache = operation is not None
            if operation is None:
                operation = self.get(operation_id)
            try:
                answer = command(operation)
            except LedgerError:
                self.forget(operation_id)
                if from_cache:
                    operation = None  # believe a refusal only from the stored state
                    continue
                raise
            except BaseException:
                self.forget(operation_id)
                raise
            if not operation.pending_events:
                if from_cache:
                    operation = None
                    continue
                return answer
            try:
                self.save(operation)
            except IntegrityError:
                _log.debug("lost a race on %s; retrying", operation_id)
                operation = None
                continue
            return answer
        raise OperationConflict(
            "too many concurrent writers on this operation", operation_id=operation_id
        )

    def batch(self, items: Sequence[tuple[str, Command[T]]]) -> list[T | LedgerError]:
        """Run one command per operation and save all changes in one append.

        Each item gets its own answer, or the error that refused it alone. A
        lost race falls back to running the items one by one.
        """
        if len({operation_id for operation_id, _ in items}) != len(items):
            return [self.one(operation_id, command) for operation_id, command in items]
        # Copies read just now are the stored state, not a cache to check again.
        loaded = self.load(operation_id for operation_id, _ in items)
        answers: list[T | LedgerError] = []
        changed: list[Operation] = []
        recheck: list[int] = []  # answers that appended nothing, from a cached state
        for index, (operation_id, command) in enumerate(items):
            fresh = loaded.pop(operation_id, None)
            cached = None if fresh is not None else self.cached(operation_id)
            try:
                operation = fresh or cached or self.get(operation_id)
                answers.append(command(operation))
            except LedgerError as error:
                self.forget(operation_id)
                answers.append(error)
                if cached is not None:
                    recheck.append(index)
                continue
            except BaseException:
                # An outage or a bug: nothing of the batch is saved, so the copies the
                # commands before it changed (and the texts they kept) are dropped.
                self.forget(*(op for op, _ in items[: index + 1]))
                raise
            if operation.pending_events:
                changed.append(operation)
            elif cached is not None:
                recheck.append(index)
        try:
            self.save(*changed)
        except IntegrityError:
            return [self.one(operation_id, command) for operation_id, command in items]
        for index in recheck:  # see `update`: believe no-op answers from stored state only
            answers[index] = self.one(*items[index], use_cache=False)
        return answers

    def one(
        self, operation_id: str, command: Command[T], *, use_cache: bool = True
    ) -> T | LedgerError:
        """`update`, with a refusal returned instead of raised."""
        try:
            return self.update(operation_id, command, use_cache=use_cache)
        except LedgerError as error:
            return error


def _replay(operation: Operation | None, events: Iterable[Any]) -> Operation | None:
    """Apply stored events in order (the library's projector, minus a costly
    runtime protocol check per event on Python 3.11)."""
    for event in events:
        operation = event.mutate(operation)
    return operation
