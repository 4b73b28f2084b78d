"""The check's budget counter, backed by the ledger so limits hold across restarts.

Every proposal of a tool with a limit asks how many calls its caller made in the
last minute or hour. Asking the operations view each time cost more than the rest
of the proposal: the view brought up to date on the event loop (a transaction of
its own), then a count over every row of the window, dead row versions included.
With a budget on the bench's no-op tool that halved the throughput on both
backends, and PostgreSQL could no longer keep up with 200 operations/s.

Here the view is asked at most once a second per caller and window; what this
process stored since the view took it in is added from memory (the positions its
appends were stored at say which), and so is what the current batch checked but
has not stored yet. The view's answer is reused only while the window has moved
by a second at most, so the count errs only upward, by the calls of that second at
its old end. Another instance's calls count once this view has taken them in and
this counter asked again (about a second); two instances racing for the last call
of a budget could each take it before too.

Nor is the whole window counted at each question: that was an hour of a busy
caller's rows once a second, 150-200 ms with the event loop stopped at 200,000
operations on PostgreSQL. The view counts per ten-second bucket of creation
times; a bucket half a minute old whose calls the view all holds gets no new ones
(this process's calls the view lacks hold it open; another instance's call taken
in later than that is missed by it), so its count is kept, and a question asks
only about the window's first, partial bucket and its last half minute.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from ledger.adapters.event_tables import StoredRow
from ledger.projections.operation_row import iso_timestamp
from ledger.projections.operations_view import BUCKET_CHARS, OperationsProjector

__all__ = ["LedgerBudgetCounter", "budget_batch"]

_Key = tuple[str, str, str]
"""(tenant, actor, tool)."""

_REASK_AFTER_S = 1.0
"""How long the view's answer for a window is reused (seconds of the process's clock)."""

_WINDOW_SLACK = timedelta(seconds=1)
"""How far a window may have moved on (by the ledger's clock) and still reuse the answer."""

_REMEMBERED_FOR = timedelta(hours=1, minutes=1)
"""How long a checked operation is remembered after its batch ended, for its append:
while the longest window (`check_budget`'s hour) may still hold it, by its creation
time, and for a minute of the process's clock at least (a ledger clock that jumped
ahead and back must not make it forgotten). Until then it holds its bucket open, so a
save that comes late is still counted; an abandoned batch's only cost is that its
caller's window is asked of the view from that bucket on."""

_REMEMBERED_FOR_S = 60.0
_BUCKET = timedelta(seconds=10)
"""The view's counts are kept per bucket of creation times this long (`BUCKET_CHARS`)."""

_SETTLED_AFTER = timedelta(seconds=30)
"""A bucket this far in the past gets no new calls: its count is kept, not asked again.
(Another instance's call the view takes in later than this is missed by its bucket.)"""

_WINDOW_KEPT_FOR_S = 600.0
"""How long a window's kept counts outlive its last question (seconds, process clock)."""


@dataclass(frozen=True)
class _Asked:
    since: datetime
    position: int  # the view's position its count is as of
    count: int
    at: float  # time.monotonic() when asked


class _StoredCalls:
    """One caller's calls this process stored that the view may not hold yet: their
    positions and creation times, in the order they were stored."""

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.times: list[datetime] = []
        # Both in order (positions grow by append; times do unless the clock stepped
        # back): then a count is two binary searches, not a walk.
        self.ordered = True

    def add(self, position: int, at: datetime) -> None:
        if self.positions and (position < self.positions[-1] or at < self.times[-1]):
            self.ordered = False
        self.positions.append(position)
        self.times.append(at)

    def count(self, after: int, since: datetime) -> int:
        """Calls stored past position `after` and made at or after `since`."""
        if self.ordered:
            first = max(bisect_right(self.positions, after), bisect_left(self.times, since))
            return len(self.positions) - first
        return sum(
            1
            for position, at in zip(self.positions, self.times, strict=True)
            if position > after and at >= since
        )

    def earliest_after(self, position: int) -> datetime | None:
        """The earliest creation time of the calls stored past `position`, if any."""
        if self.ordered:
            first = bisect_right(self.positions, position)
            return self.times[first] if first < len(self.times) else None
        return min(
            (at for p, at in zip(self.positions, self.times, strict=True) if p > position),
            default=None,
        )

    def keep_after(self, position: int) -> bool:
        """Forget the calls at or before `position`; whether any are left."""
        kept = [
            (p, at) for p, at in zip(self.positions, self.times, strict=True) if p > position
        ]
        self.positions = [p for p, _ in kept]
        self.times = [at for _, at in kept]
        if not kept:
            self.ordered = True
        return bool(kept)


def _bucket_floor(moment: datetime) -> datetime:
    moment = moment.astimezone(UTC)
    return moment.replace(second=moment.second - moment.second % 10, microsecond=0)


def _bucket_ceil(moment: datetime) -> datetime:
    floor = _bucket_floor(moment)
    return floor if floor == moment else floor + _BUCKET


def _label(moment: datetime) -> str:
    return iso_timestamp(moment)[:BUCKET_CHARS]


class _Window:
    """One caller's window of one length, as the view counted it: the counts of its
    settled buckets (creation times in [`low`, `cut`)), kept so that each question
    asks the view only about the window's first bucket and its last half minute."""

    def __init__(self) -> None:
        self.low: datetime | None = None
        self.cut: datetime | None = None
        self.settled: dict[str, int] = {}
        self.used_at = 0.0

    def start(self, edge: datetime) -> datetime:
        """Where the view's per-bucket counts must start for a window whose first whole
        bucket starts at `edge`."""
        if self.low is None or self.cut is None or edge < self.low or self.cut < edge:
            # Nothing kept that covers this window's start (the first question, or a
            # clock that stepped back, or one that jumped past everything kept).
            self.low, self.cut, self.settled = edge, edge, {}
        return self.cut

    def count(
        self,
        edge: datetime,
        start: datetime,
        buckets: dict[str, int],
        settled_before: datetime,
    ) -> int:
        """Keep what settled (buckets before `settled_before`), forget what left the
        window; the window's count from its first whole bucket (`edge`) on, given the
        view's counts from `start` on."""
        cut = max(_bucket_floor(settled_before), start)
        cut_label, edge_label = _label(cut), _label(edge)
        recent = 0
        for label, count in buckets.items():
            if label < cut_label:
                self.settled[label] = count
            else:
                recent += count
        self.settled = {b: n for b, n in self.settled.items() if b >= edge_label}
        self.low, self.cut = edge, cut
        return sum(self.settled.values()) + recent


@dataclass(frozen=True)
class _Checked:
    key: _Key
    at: datetime  # the operation's creation time, as the view keeps it


class LedgerBudgetCounter:
    """Counts an actor's accepted operations of a tool: the operations view's count, and
    what this process stored or checked that the view does not hold yet.

    `stored` must hear every append of this ledger (`CommandRunner.on_stored`); a
    batch notes each operation it accepts (`note_pending`) and ends with
    `clear_pending`, stored or not.
    """

    def __init__(
        self,
        projector: OperationsProjector,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._projector = projector
        self._clock = clock
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._asked: dict[_Key, list[_Asked]] = {}
        # The view's kept counts, per caller and window length (whole seconds).
        self._windows: dict[tuple[_Key, int], _Window] = {}
        # Accepted in the batch being checked, not yet stored: counted.
        self._pending: dict[str, _Checked] = {}
        self._pending_count: dict[_Key, int] = {}
        # Checked by a batch that ended, waiting for its append (or abandoned): not
        # counted until stored; forgotten after `_REMEMBERED_FOR`.
        self._unstored: dict[str, tuple[_Checked, float]] = {}
        # Stored by this process: (position, creation time) per key, until the view
        # holds them.
        self._stored: dict[_Key, _StoredCalls] = {}
        self._view_position = 0  # the newest view position any answer was as of
        self._forgot_at = float("-inf")
        # Whether to bring the view up to date before asking it: always, unless a
        # service keeps it so (`view_kept_current`); then only the first time, for
        # what an earlier process stored and its view had not taken in.
        self._catch_up_always = True
        self._caught_up = False

    def view_kept_current(self) -> None:
        """Something else keeps the view within moments of the log (a service's view
        refresher): ask it as it is, after bringing it up to date once."""
        self._catch_up_always = False

    def count(self, *, tenant: str, actor: str, tool: str, since: datetime) -> int:
        """Operations accepted for `actor` in `tenant` and `tool` since `since`."""
        key = (tenant, actor, tool)
        asked = self._answer(key, since)
        with self._lock:
            calls = self._stored.get(key)
            stored = calls.count(asked.position, since) if calls is not None else 0
            return asked.count + stored + self._pending_count.get(key, 0)

    def note_pending(
        self,
        *,
        tenant: str,
        actor: str,
        tool: str,
        operation_id: str | None = None,
        at: datetime | None = None,
    ) -> None:
        """Count one accepted operation that is not saved yet (`operation_id` and its
        creation time `at`: to go on counting it once its append is stored)."""
        key = (tenant, actor, tool)
        with self._lock:
            self._pending_count[key] = self._pending_count.get(key, 0) + 1
            if operation_id is not None and at is not None:
                self._pending[operation_id] = _Checked(key, at)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """One batch of checks: what it accepts counts as pending until it ends, stored
        or not (`clear_pending` on the way out, whatever raised)."""
        try:
            yield
        finally:
            self.clear_pending()

    def clear_pending(self) -> None:
        """The batch ended (its append stored, to be stored at the end of the service's
        turn, or abandoned): its operations count once stored (`stored`)."""
        with self._lock:
            self._pending_count.clear()
            if not self._pending:
                return
            ended = self._monotonic()
            for operation_id, checked in self._pending.items():
                self._unstored[operation_id] = (checked, ended)
            self._pending.clear()

    def stored(self, rows: Sequence[StoredRow]) -> None:
        """An append of this ledger was stored: its new operations that a batch checked
        count from now on (at their position, until the view holds them)."""
        with self._lock:
            if not self._unstored and not self._pending:
                return
            for position, operation_id, version, _topic, _state in rows:
                if version != 1:
                    continue
                # Stored before its batch ended (a retry's own append): still counted
                # as pending until then, so no longer remembered as pending.
                found = self._unstored.pop(operation_id, None)
                checked = found[0] if found is not None else self._pending.pop(operation_id, None)
                if checked is not None:
                    calls = self._stored.get(checked.key)
                    if calls is None:
                        calls = self._stored[checked.key] = _StoredCalls()
                    calls.add(position, checked.at)
            if self._unstored:
                oldest, ended = self._clock() - _REMEMBERED_FOR, self._monotonic()
                for operation_id in [
                    o
                    for o, (checked, at) in self._unstored.items()
                    if checked.at < oldest and ended - at > _REMEMBERED_FOR_S
                ]:
                    del self._unstored[operation_id]

    def _answer(self, key: _Key, since: datetime) -> _Asked:
        now = self._monotonic()
        with self._lock:
            answers = [a for a in self._asked.get(key, ()) if now - a.at <= _REASK_AFTER_S]
            for asked in answers:
                # Only a window that moved on a little: one starting earlier would
                # miss calls, one much later would count too many.
                if asked.since <= since <= asked.since + _WINDOW_SLACK:
                    self._asked[key] = answers
                    return asked
        if self._catch_up_always or not self._caught_up:
            self._projector.catch_up()
            self._caught_up = True
        clock_now = self._clock()
        edge = _bucket_ceil(since)
        with self._lock:
            window_id = (key, round((clock_now - since).total_seconds()))
            window = self._windows.get(window_id)
            if window is None:
                window = self._windows[window_id] = _Window()
            window.used_at = now
            start = window.start(edge)
        position, edge_count, buckets = self._projector.accepted_by_bucket(
            tenant=key[0], actor=key[1], tool=key[2], since=since, edge=edge, start=start
        )
        if position < self._view_position:
            # The view went back: it is being rebuilt (`opledger ops rebuild`), and
            # holds only part of what it held. Bring it up to date here, then ask
            # again about the whole window; its kept counts are from the old view.
            self._projector.catch_up()
            with self._lock:
                window.low = window.cut = None
                start = window.start(edge)
            position, edge_count, buckets = self._projector.accepted_by_bucket(
                tenant=key[0], actor=key[1], tool=key[2], since=since, edge=edge, start=start
            )
        with self._lock:
            # A bucket settles once the view holds every call of it: none of this
            # process's calls the view lacks (stored past its position, or checked
            # and not stored yet) may be in it.
            calls = self._stored.get(key)
            unheld = [
                clock_now - _SETTLED_AFTER,
                *(checked.at for checked in self._pending.values() if checked.key == key),
                *(checked.at for checked, _ in self._unstored.values() if checked.key == key),
            ]
            if calls is not None and (earliest := calls.earliest_after(position)) is not None:
                unheld.append(earliest)
            settled_before = min(unheld)
            count = edge_count + window.count(edge, start, buckets, settled_before)
            asked = _Asked(since, position, count, now)
            self._asked[key] = [*answers, asked]
            if position > self._view_position:
                self._view_position = position
            if now - self._forgot_at >= _REASK_AFTER_S:
                # Once a second at most: it walks every caller's memory.
                self._forgot_at = now
                self._forget_what_the_view_holds()
        return asked

    def _forget_what_the_view_holds(self) -> None:
        # Answers nobody may reuse go first.
        now = self._monotonic()
        stale = [k for k, answers in self._asked.items() if answers[-1].at < now - _REASK_AFTER_S]
        for key in stale:
            del self._asked[key]
        for window_id in [
            w for w, window in self._windows.items() if window.used_at < now - _WINDOW_KEPT_FOR_S
        ]:
            del self._windows[window_id]
        # A stored operation the view held when every answer still reused for its key
        # was given is counted by each of them (and by every later one).
        for key, calls in list(self._stored.items()):
            held = min(
                (asked.position for asked in self._asked.get(key, ())),
                default=self._view_position,
            )
            if not calls.keep_after(min(held, self._view_position)):
                del self._stored[key]


def budget_batch(counter: LedgerBudgetCounter | None) -> AbstractContextManager[None]:
    """`counter.batch()`, or nothing to end where no budget is counted (`None`)."""
    return counter.batch() if counter is not None else nullcontext()
