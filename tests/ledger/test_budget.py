"""The budget counter (`ledger.budget`): counted from the ledger, asked of the view at most
once a second per caller and window. Both backends."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ledger import Ledger, OperationState, StorageConfig
from ledger.budget import LedgerBudgetCounter
from tests.ledger.helpers import ALICE, make_ledger, registry_with_limit, search

S = OperationState


class _Clocks:
    """The ledger's clock and the budget's process clock, each moved by hand."""

    def __init__(self) -> None:
        self.now = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
        self.process = 1000.0


def _ledger(storage: StorageConfig, clocks: _Clocks, limit: int, *, served: bool) -> Ledger:
    ledger = make_ledger(storage, registry=registry_with_limit(limit), clock=lambda: clocks.now)
    assert ledger.budget is not None
    ledger.budget._monotonic = lambda: clocks.process
    if served:
        ledger.budget.view_kept_current()  # as the service says at its start
    return ledger


def _count_asks(ledger: Ledger) -> list[tuple[datetime, datetime]]:
    """Record each question the budget asks the view: (the window's start, where its
    per-bucket counts start)."""
    asked: list[tuple[datetime, datetime]] = []
    original: Callable[..., tuple[int, int, dict[str, int]]] = (
        ledger.projector.accepted_by_bucket
    )

    def asking(**kwargs: Any) -> tuple[int, int, dict[str, int]]:
        asked.append((kwargs["since"], kwargs["start"]))
        return original(**kwargs)

    ledger.projector.accepted_by_bucket = asking  # type: ignore[method-assign]
    return asked


def test_what_this_ledger_stored_counts_before_its_view_holds_it(storage: StorageConfig) -> None:
    clocks = _Clocks()
    ledger = _ledger(storage, clocks, 3, served=True)
    states = [ledger.submit(search(), ALICE).state for _ in range(4)]
    assert states == [S.READY] * 3 + [S.REJECTED]
    # The view took in nothing since the first question: the count came from memory.
    assert ledger.projector.unprojected(), "the view was brought up to date meanwhile"
    ledger.close()


def test_the_view_is_asked_once_a_second_per_window(storage: StorageConfig) -> None:
    clocks = _Clocks()
    ledger = _ledger(storage, clocks, 1000, served=True)
    asked = _count_asks(ledger)
    for _ in range(20):
        assert ledger.submit(search(), ALICE).state is S.READY
    assert len(asked) == 1  # one window (per hour), asked once
    clocks.process += 1.01
    ledger.submit(search(), ALICE)
    assert len(asked) == 2
    # Asked as it is: a service keeps its view current, the budget does not write it.
    assert len(ledger.projector.unprojected()) == 21  # every call since the first question
    ledger.close()


def test_a_window_that_moved_on_is_asked_again(storage: StorageConfig) -> None:
    clocks = _Clocks()
    ledger = _ledger(storage, clocks, 2, served=False)
    asked = _count_asks(ledger)
    assert [ledger.submit(search(), ALICE).state for _ in range(3)] == [
        S.READY, S.READY, S.REJECTED
    ]
    clocks.now += timedelta(milliseconds=900)  # the window moved on less than a second
    assert ledger.submit(search(), ALICE).state is S.REJECTED
    assert len(asked) == 1
    clocks.now += timedelta(hours=1)  # the first two left it: no answer of before counts
    assert ledger.submit(search(), ALICE).state is S.READY
    assert len(asked) == 2
    ledger.close()


def test_later_questions_ask_only_about_the_windows_last_half_minute(
    storage: StorageConfig,
) -> None:
    """A busy caller's hour is counted once; after that the view is asked about its
    first ten seconds and its last half minute, kept counts cover the rest."""
    clocks = _Clocks()
    ledger = _ledger(storage, clocks, 1000, served=True)
    asked = _count_asks(ledger)
    for _ in range(30):
        assert ledger.submit(search(), ALICE).state is S.READY
        ledger.refresh()  # as a service's view refresher does
        clocks.now += timedelta(minutes=1)
        clocks.process += 2
    since, start = asked[0]
    assert start - since < timedelta(seconds=10)  # the first question: the whole window
    for since, start in asked[2:]:
        assert start - since > timedelta(minutes=58), "asked about the whole window again"
    clocks.process += 2
    # And the count is still every call of the last hour: 30, and this one.
    assert ledger.budget is not None
    window = clocks.now - timedelta(hours=1)
    assert ledger.budget.count(tenant="acme", actor="alice", tool="search_documents",
                               since=window) == 30
    ledger.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_the_count_is_the_views_whatever_the_timeline(storage: StorageConfig, seed: int) -> None:
    """Calls spread over three hours at random (bursts, pauses, two windows), asked at
    every step: the counter's answer is always the count of what the ledger holds."""
    import random

    rng = random.Random(seed)
    clocks = _Clocks()
    ledger = make_ledger(storage, registry=registry_with_limit(10**6), clock=lambda: clocks.now)
    budget = ledger.budget
    assert budget is not None
    budget._monotonic = lambda: clocks.process
    budget.view_kept_current()
    for _ in range(150):
        clocks.now += timedelta(seconds=rng.choice([0.2, 1, 3, 9.99, 10, 25, 61, 400, 1200]))
        clocks.process += 1.5  # every question is asked of the view
        if rng.random() < 0.7:
            ledger.submit(search(), ALICE)
        if rng.random() < 0.3:
            ledger.refresh()  # the view takes in what was stored, now and then
        for window in (timedelta(minutes=1), timedelta(hours=1)):
            since = clocks.now - window
            expected = sum(
                1
                for row in ledger.projector.rows(limit=10**6, current=True)
                if row.state != "rejected" and datetime.fromisoformat(row.created_at) >= since
            )
            assert budget.count(
                tenant="acme", actor="alice", tool="search_documents", since=since
            ) == expected
    ledger.close()


def test_an_answer_errs_only_upward_while_reused(storage: StorageConfig) -> None:
    """Within a second of the window's move, calls at its old end still count: a caller
    may wait a second longer, never call once more."""
    clocks = _Clocks()
    ledger = _ledger(storage, clocks, 2, served=True)
    for _ in range(2):
        assert ledger.submit(search(), ALICE).state is S.READY
    ledger.refresh()
    clocks.process += 2  # the next question is asked of the view
    clocks.now += timedelta(hours=1) - timedelta(milliseconds=500)
    assert ledger.submit(search(), ALICE).state is S.REJECTED
    clocks.now += timedelta(milliseconds=600)  # both left the window 100 ms ago...
    assert ledger.submit(search(), ALICE).state is S.REJECTED  # ...still counted
    clocks.process += 2
    assert ledger.submit(search(), ALICE).state is S.READY  # asked again
    ledger.close()


def test_another_instances_calls_count_once_this_view_holds_them(
    storage: StorageConfig,
) -> None:
    clocks = _Clocks()
    one = _ledger(storage, clocks, 3, served=True)
    other = _ledger(storage, clocks, 3, served=True)
    assert [one.submit(search(), ALICE).state for _ in range(2)] == [S.READY, S.READY]
    # The other's first question brings the view up to date: one's two count.
    assert other.submit(search(), ALICE).state is S.READY
    assert other.submit(search(), ALICE).state is S.REJECTED
    # One reuses its answer for a second: the other's call is not seen yet.
    assert one.submit(search(), ALICE).state is S.READY
    one.refresh()  # as its service's view refresher does
    clocks.process += 1.01
    assert one.submit(search(), ALICE).state is S.REJECTED
    assert other.submit(search(), ALICE).state is S.REJECTED
    one.close()
    other.close()


@pytest.mark.parametrize("stored", [True, False])
def test_a_checked_call_counts_once_stored_and_never_if_not(
    storage: StorageConfig, stored: bool
) -> None:
    """A batch's accepted calls count for the batch, then only if their append stored them."""
    clocks = _Clocks()
    ledger = _ledger(storage, clocks, 2, served=True)
    budget = ledger.budget
    assert budget is not None
    ledger.submit(search(), ALICE)  # the first question, answered before what follows
    key = {"tenant": "acme", "actor": "alice", "tool": "search_documents"}
    budget.note_pending(**key, operation_id="op-checked", at=clocks.now)
    since = clocks.now - timedelta(hours=1)
    assert budget.count(**key, since=since) == 2
    budget.clear_pending()
    assert budget.count(**key, since=since) == 1  # not stored (yet): not counted
    if stored:  # as the runner says once an append is stored, past the view's position
        budget.stored([(10**12, "op-checked", 1, "Proposed", b"")])
    assert budget.count(**key, since=since) == (2 if stored else 1)
    ledger.close()


def test_stored_calls_count_exactly_when_the_clock_stepped_back() -> None:
    """The two binary searches hold only while times grow with positions; a clock that
    stepped back falls back to looking at each call."""
    from ledger.budget import _StoredCalls

    start = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
    calls = _StoredCalls()
    for position, seconds in [(10, 0), (11, 5), (12, 10), (13, 3), (14, 20)]:
        calls.add(position, start + timedelta(seconds=seconds))
    assert not calls.ordered
    assert calls.count(after=10, since=start + timedelta(seconds=4)) == 3  # 11, 12, 14
    assert calls.count(after=12, since=start) == 2
    assert calls.keep_after(12) and calls.positions == [13, 14]
    assert not calls.keep_after(14) and calls.ordered
    ordered = _StoredCalls()
    for position in range(5):
        ordered.add(position, start + timedelta(seconds=position))
    assert ordered.ordered
    assert ordered.count(after=1, since=start + timedelta(seconds=3)) == 2
    assert ordered.count(after=3, since=start) == 1


def test_a_view_being_rebuilt_is_brought_up_to_date_before_it_is_believed(
    storage: StorageConfig,
) -> None:
    """`opledger ops rebuild` empties the view and projects it again in batches: a
    question answered meanwhile must not count only what the view holds again."""
    clocks = _Clocks()
    ledger = _ledger(storage, clocks, 3, served=True)
    for _ in range(3):
        assert ledger.submit(search(), ALICE).state is S.READY
        ledger.refresh()
        clocks.process += 2
    with ledger.db.transaction():  # the rebuild's first step, by another handle
        ledger.db.execute("DELETE FROM opledger_operations")
        ledger.db.execute("UPDATE opledger_positions SET position = 0 WHERE name = ?",
                          ("operations_view",))
    assert ledger.submit(search(), ALICE).state is S.REJECTED
    ledger.close()


def test_calls_of_a_tool_without_a_limit_are_not_remembered(storage: StorageConfig) -> None:
    ledger = make_ledger(storage, registry=registry_with_limit(None))
    for _ in range(20):
        assert ledger.submit(search(), ALICE).state is S.READY
    budget = ledger.budget
    assert budget is not None
    assert not budget._stored and not budget._unstored and not budget._pending
    ledger.close()


def test_items_settled_one_by_one_after_a_lost_race_are_counted_once(
    storage: StorageConfig,
) -> None:
    """A batch whose append lost to another writer twice is settled item by item: each
    item stored must not also stay counted as pending for the next one."""
    clocks = _Clocks()
    one = make_ledger(storage, registry=registry_with_limit(4), clock=lambda: clocks.now)
    other = make_ledger(storage, registry=registry_with_limit(4), clock=lambda: clocks.now)
    assert one.budget is not None

    def never_reused() -> float:
        clocks.process += 5  # every question asked of the view: only pending can err
        return clocks.process

    one.budget._monotonic = never_reused
    assert other.submit(search("id1", "q1"), ALICE, "h").state is S.READY
    looked_up = one.runner.tables.stored_ids
    raced: list[OperationState] = []

    def racing(ids: Any) -> set[str]:
        found = looked_up(ids)
        if not raced:  # the other stores id2 between this lookup and this append
            raced.append(other.submit(search("id2", "q2"), ALICE, "h").state)
        return found

    one.runner.tables.stored_ids = racing  # type: ignore[method-assign,assignment]
    answers = one.submit_many([(search(f"id{n}", f"q{n}"), ALICE, "h") for n in (1, 2, 3, 4)])
    assert raced == [S.READY]
    assert [answer.state for answer in answers] == [S.READY] * 4  # type: ignore[union-attr]
    one.close()
    other.close()


class _FakeView:
    """The two questions the counter asks the operations view, over rows the test
    puts in: (position, creation time), all of one caller, all accepted."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, datetime]] = []
        self.position = 0
        self.log_end = 0

    def catch_up(self) -> int:
        self.position = max(self.position, self.log_end)
        return 0

    def accepted_by_bucket(
        self, *, since: datetime, edge: datetime, start: datetime, **_caller: str
    ) -> tuple[int, int, dict[str, int]]:
        from ledger.projections.operation_row import iso_timestamp

        held = [at for position, at in self.rows if position <= self.position]
        buckets: dict[str, int] = {}
        for at in held:
            if at >= start:
                label = iso_timestamp(at)[:18]
                buckets[label] = buckets.get(label, 0) + 1
        return self.position, sum(1 for at in held if since <= at < edge), buckets


_KEY = {"tenant": "acme", "actor": "alice", "tool": "search_documents"}
"""The one caller of the tests over a fake view."""


def _over_a_fake_view(*, served: bool) -> tuple[_Clocks, _FakeView, LedgerBudgetCounter]:
    """A budget counter asking a fake view, on clocks the test moves (`served`: as a
    service's, which keeps the view current)."""
    clocks = _Clocks()
    view = _FakeView()
    budget = LedgerBudgetCounter(
        view,  # type: ignore[arg-type]
        clock=lambda: clocks.now, monotonic=lambda: clocks.process,
    )
    if served:
        budget.view_kept_current()
    return clocks, view, budget


def _hour_counter(clocks: _Clocks, budget: LedgerBudgetCounter) -> Callable[[], int]:
    """`_KEY`'s count over the last hour, each time two seconds of the process later
    (so that no answer is reused)."""

    def count() -> int:
        clocks.process += 2
        return budget.count(**_KEY, since=clocks.now - timedelta(hours=1))

    return count


def test_a_call_checked_long_before_it_is_stored_holds_its_bucket_open() -> None:
    """A bucket settles only once the view holds all of this process's calls in it,
    those checked and not stored yet included (a save held to the end of a turn)."""
    clocks, view, budget = _over_a_fake_view(served=True)
    count = _hour_counter(clocks, budget)
    checked_at = clocks.now
    assert count() == 0
    budget.note_pending(**_KEY, operation_id="op-x", at=checked_at)
    budget.clear_pending()  # the batch ended; its save waits
    clocks.now += timedelta(seconds=40)
    assert count() == 0  # not stored: not counted, and its bucket not settled either
    budget.stored([(1, "op-x", 1, "Proposed", b"")])
    clocks.now += timedelta(seconds=5)
    assert count() == 1  # from memory
    view.rows.append((1, checked_at))
    view.position = 1  # the view takes it in
    clocks.now += timedelta(seconds=5)
    assert count() == 1  # from the view's bucket, asked again


def test_a_call_saved_late_is_still_counted_once_the_view_holds_it() -> None:
    """Its save comes after other appends and more than half a minute later: its bucket
    stays open until it is stored and the view holds it (the attack review's case: it
    was forgotten after 30 s, its bucket settled without it, and the hour missed it)."""
    clocks, view, budget = _over_a_fake_view(served=True)
    count = _hour_counter(clocks, budget)
    checked_at = clocks.now
    assert count() == 0
    budget.note_pending(**_KEY, operation_id="op-x", at=checked_at)
    budget.clear_pending()  # the batch ended; its save waits
    clocks.now += timedelta(seconds=45)
    clocks.process += 31
    budget.stored([(1, "op-other", 1, "Proposed", b"")])  # another append meanwhile
    assert count() == 0
    budget.stored([(2, "op-x", 1, "Proposed", b"")])
    view.rows.append((2, checked_at))
    view.position = 2
    for _ in range(3):
        clocks.now += timedelta(seconds=5)
        assert count() == 1


@pytest.mark.parametrize("served", [True, False])
def test_the_count_never_falls_short_over_random_timelines(served: bool) -> None:
    """A differential test against a fake view (the attack review's, fast enough for
    hundreds of timelines): ledger clock steps forward, back and onto bucket edges,
    process clock steps around the one-second reuse, a view that lags, catches up or
    goes back, batches stored in parts, ended or abandoned. At every check (the
    minute, then the hour, as `check_budget` asks) the count is at least the calls
    stored or pending since the window's start."""
    import random

    key = _KEY
    for seed in range(150):
        rng = random.Random(seed)
        clocks, view, budget = _over_a_fake_view(served=served)
        pending: list[tuple[str, datetime]] = []
        unstored: list[tuple[str, datetime, float]] = []
        stored: list[datetime] = []
        made = 0
        for _ in range(300):
            move = rng.random()
            if move < 0.25:
                step = rng.choice([
                    timedelta(seconds=rng.choice([0.5, 1, 9.999999, 10, 10.000001, 29, 31, 40])),
                    timedelta(minutes=rng.choice([1, 5, 59, 60, 61])),
                    -timedelta(seconds=rng.choice([1, 9, 10, 11, 35, 600])),
                    timedelta(microseconds=rng.randint(0, 20_000_000)),
                ])
                clocks.now += step
                if rng.random() < 0.2:  # exactly on a bucket's edge
                    clocks.now = clocks.now.replace(
                        second=clocks.now.second // 10 * 10, microsecond=0
                    )
                clocks.process += rng.choice([0.0, 0.999, 1.0, 1.001, 2, 31])
            elif move < 0.6:
                for window in (timedelta(minutes=1), timedelta(hours=1)):
                    since = clocks.now - window
                    truth = sum(1 for at in stored if at >= since) + len(pending)
                    counted = budget.count(**key, since=since)
                    assert counted >= truth, (seed, window, counted, truth)
                made += 1
                pending.append((f"op-{made}", clocks.now))
                budget.note_pending(**key, operation_id=f"op-{made}", at=clocks.now)
            elif move < 0.7:
                budget.clear_pending()
                unstored += [(op, at, clocks.process) for op, at in pending]
                pending = []
            elif move < 0.82 and unstored:
                # Some of the ended batches' saves arrive (within half a minute).
                batch = [u for u in unstored[: rng.randint(1, len(unstored))]
                         if clocks.process - u[2] < 29]
                rows = []
                for operation_id, at, _ in batch:
                    view.log_end += 1
                    view.rows.append((view.log_end, at))
                    stored.append(at)
                    rows.append((view.log_end, operation_id, 1, "Proposed", b""))
                unstored = [u for u in unstored if u not in batch]
                budget.stored(rows)
                unstored = [u for u in unstored if clocks.process - u[2] < 29]  # abandoned
            elif move < 0.95:
                view.position = rng.choice([
                    view.log_end,
                    rng.randint(view.position, max(view.position, view.log_end)),
                    rng.randint(0, view.position),  # a rebuild under way
                ])
            else:
                clocks.process += rng.choice([0.2, 1.01, 3])
