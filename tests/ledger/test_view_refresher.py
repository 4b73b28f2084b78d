"""The view and the seal, refreshed on a thread of their own (`ViewRefresher`), on both
backends: the view and the seal it writes are exactly what an inline refresh writes,
and the thread interleaved with inline refreshes (the service's sweeps) and with
appends neither skips nor repeats an event, nor breaks the signed chain."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from ledger import Ledger, StorageConfig
from ledger.server.view_refresher import ViewRefresher
from tests.ledger.helpers import ALICE, SEAL_KEY, make_ledger, search


def _wait_for(refresher: ViewRefresher, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while refresher.refreshes < count:
        assert time.monotonic() < deadline, f"only {refresher.refreshes} refreshes"
        time.sleep(0.01)


def _head_position(ledger: Ledger) -> int:
    rows = ledger.db.query("SELECT MAX(position) FROM opledger_seal_signatures")
    return int(rows[0][0] or 0)


def _view_counts(ledger: Ledger) -> dict[str, int]:
    rows = ledger.db.query("SELECT state, COUNT(*) FROM opledger_operations GROUP BY state")
    return {str(state): int(count) for state, count in rows}


def _view(ledger: Ledger) -> list[tuple[object, ...]]:
    return [tuple(row) for row in ledger.db.query(
        "SELECT * FROM opledger_operations ORDER BY operation_id"
    )]


def test_the_thread_brings_view_and_seal_up_to_date_with_the_service_key(
    storage: StorageConfig,
) -> None:
    ledger = make_ledger(storage)
    for n in range(5):
        ledger.submit(search(f"op-{n}"), ALICE)
    refresher = ViewRefresher(ledger)
    refresher.start()
    try:
        refresher.refresh_soon()
        _wait_for(refresher, 1)
        last = ledger.event_reader.last_position()
        assert ledger.projector.position() == last
        assert _head_position(ledger) == last
        assert _view_counts(ledger) == {"ready": 5}
    finally:
        refresher.stop()
    report = ledger.audit.verify(trusted_keys=[SEAL_KEY.public_key])
    assert report.ok, report.findings
    assert report.signed_head is not None and report.signed_head.position == last


def test_thread_and_inline_refreshes_interleaved_with_appends_keep_one_chain(
    storage: StorageConfig,
) -> None:
    """The loop refreshes the view inline (as the relay and budget counts do) while the
    thread refreshes and seals: the view equals a rebuild, and the thread alone sealed
    every event into one chain, before anything sealed at stop."""
    ledger = make_ledger(storage, seal_every=timedelta(0))
    refresher = ViewRefresher(ledger)
    refresher.start()
    try:
        for n in range(40):
            ledger.submit(search(f"op-{n}"), ALICE)
            refresher.refresh_soon()
            if n % 3 == 0:
                ledger.refresh()  # inline, while the thread may run
        done = refresher.refreshes
        refresher.refresh_soon()
        _wait_for(refresher, done + 1)
        last = ledger.event_reader.last_position()
        assert _head_position(ledger) == last  # the thread's seal, not stop's
        report = ledger.audit.verify(trusted_keys=[SEAL_KEY.public_key])
        assert report.ok, report.findings
        assert report.events_checked == last
    finally:
        refresher.stop()
    assert ledger.projector.position() == last
    # Search is rate-limited per caller: some were refused, and the view says so.
    assert sum(_view_counts(ledger).values()) == 40
    written = _view(ledger)
    ledger.projector.rebuild()  # the view again from the events alone: the same rows
    assert _view(ledger) == written


def test_a_view_moved_on_by_another_writer_mid_catch_up_is_not_sealed_over(
    storage: StorageConfig,
) -> None:
    """The thread's catch-up reads its start, the loop's catch-up moves the view on, the
    thread then takes in what follows: what it hands the sealer must start where the
    view stood under the lock, or the sealer would chain the new events straight onto
    its old head and leave the ones between out of the seal (named as inserted)."""
    ledger = make_ledger(storage, seal_every=timedelta(0))
    ledger.submit(search("op-a"), ALICE)
    refresher = ViewRefresher(ledger)  # not started: its read models are driven here
    models = refresher._models
    models.refresh()  # view and seal at P0
    for n in range(3):
        ledger.submit(search(f"op-b{n}"), ALICE)
    view = models._view
    start = view.position()
    view.projected = (start, [])  # what catch_up does first, unlocked
    ledger.projector.catch_up()  # the loop's catch-up commits the view past op-b*
    for n in range(2):
        ledger.submit(search(f"op-c{n}"), ALICE)  # (its budget check catches up too)
    moved = ledger.projector.position()
    assert moved > start
    assert ledger.event_reader.last_position() > moved  # something left for the thread
    while view._project_batch():  # the thread's batches, after the loop's commits
        pass
    assert view.projected[0] == moved  # not `start`: the loop took the events between in
    assert models._sealer is not None
    models._sealer.seal(view.projected, now=True)
    report = ledger.audit.verify(trusted_keys=[SEAL_KEY.public_key])
    assert report.ok, report.findings
    refresher.stop()


def test_only_the_thread_seals_and_it_refuses_a_seal_that_was_erased(
    storage: StorageConfig,
) -> None:
    """The ledger hands its sealer to the thread: the loop never seals again, so one
    sealer remembers what it signed. Someone with write access deletes an operation and
    the whole seal: the service's last seal at stop refuses to sign the rewritten
    history, and verify says it is unsealed."""
    ledger = make_ledger(storage, seal_every=timedelta(0))
    refresher = ViewRefresher(ledger)
    refresher.start()
    for n in range(4):
        ledger.submit(search(f"op-{n}"), ALICE)
        done = refresher.refreshes
        refresher.refresh_soon()
        _wait_for(refresher, done + 1)
    assert _head_position(ledger) == ledger.event_reader.last_position()
    signatures = len(ledger.db.query("SELECT * FROM opledger_seal_signatures"))
    ledger.refresh()  # the loop's own refresh: the view only
    ledger.submit(search("op-4"), ALICE)
    ledger.refresh()
    assert len(ledger.db.query("SELECT * FROM opledger_seal_signatures")) == signatures
    # The attack: op-2 and the seal erased.
    ledger.db.execute(f"DELETE FROM {ledger.events_table} WHERE originator_id = 'op-2'")
    ledger.db.execute("DELETE FROM opledger_operations WHERE operation_id = 'op-2'")
    ledger.db.execute("DELETE FROM opledger_seal_signatures")
    ledger.db.execute("DELETE FROM opledger_digest")
    refresher.stop()  # the service's last seal
    ledger.seal_now()
    assert ledger.db.query("SELECT COUNT(*) FROM opledger_seal_signatures")[0][0] == 0
    report = ledger.audit.verify(
        trusted_keys=[SEAL_KEY.public_key], seal_grace=timedelta(0)
    )
    assert not report.ok and report.signed_head is None


def test_a_failed_refresh_does_not_end_the_thread(
    storage: StorageConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """The view's table gone for a moment (a real failure in the database): the thread
    says so, lives on, and the next ask brings the view up to date."""
    ledger = make_ledger(storage)
    ledger.submit(search("op-1"), ALICE)
    refresher = ViewRefresher(ledger)
    refresher.start()
    try:
        ledger.db.execute("ALTER TABLE opledger_operations RENAME TO opledger_operations_away")
        refresher.refresh_soon()
        deadline = time.monotonic() + 10
        while "bringing the view up to date failed" not in caplog.text:
            assert time.monotonic() < deadline, "the failure was not logged"
            time.sleep(0.01)
        assert refresher.refreshes == 0
        ledger.db.execute("ALTER TABLE opledger_operations_away RENAME TO opledger_operations")
        refresher.refresh_soon()
        _wait_for(refresher, 1)
        assert ledger.projector.position() == ledger.event_reader.last_position()
        assert _view_counts(ledger) == {"ready": 1}
    finally:
        refresher.stop()


def test_the_sealer_goes_back_to_the_ledger_when_the_thread_stops(
    storage: StorageConfig,
) -> None:
    """A service stopped and started again in one process: the second thread seals,
    because the first gave the sealer back when it stopped (and sealed the tail)."""
    ledger = make_ledger(storage, seal_every=timedelta(0))
    first = ViewRefresher(ledger)
    first.start()
    ledger.submit(search("op-1"), ALICE)
    first.stop()  # seals the tail itself
    assert _head_position(ledger) == ledger.event_reader.last_position()
    second = ViewRefresher(ledger)
    second.start()
    try:
        ledger.submit(search("op-2"), ALICE)
        second.refresh_soon()
        _wait_for(second, 1)
        assert _head_position(ledger) == ledger.event_reader.last_position()
    finally:
        second.stop()
    ledger.submit(search("op-3"), ALICE)
    ledger.refresh()  # no thread now: the ledger seals again itself
    assert _head_position(ledger) == ledger.event_reader.last_position()


def test_a_lost_connection_is_replaced_and_failures_make_it_unhealthy(
    storage: StorageConfig,
) -> None:
    """The thread's connection closed under it: the refresh fails, the next one runs on
    a new connection. Refreshes failing in a row mark it unhealthy (the service's sweeps
    then refresh the view themselves) until one succeeds."""
    ledger = make_ledger(storage, seal_every=timedelta(0))
    refresher = ViewRefresher(ledger)
    refresher.start()
    try:
        ledger.submit(search("op-1"), ALICE)
        refresher._db.close()  # the connection is gone
        refresher.refresh_soon()
        deadline = time.monotonic() + 10
        while refresher._failures == 0:
            assert time.monotonic() < deadline, "the refresh did not fail"
            time.sleep(0.01)
        refresher.refresh_soon()
        _wait_for(refresher, 1)  # on the new connection
        assert _head_position(ledger) == ledger.event_reader.last_position()
        ledger.db.execute("ALTER TABLE opledger_operations RENAME TO opledger_operations_away")
        ledger.lease("op-1", executor="exec-1")  # an event the view cannot take in now
        for _ in range(3):
            failures = refresher._failures
            refresher.refresh_soon()
            while refresher._failures == failures:
                assert time.monotonic() < deadline + 20
                time.sleep(0.01)
        assert not refresher.healthy
        ledger.db.execute("ALTER TABLE opledger_operations_away RENAME TO opledger_operations")
        refresher.refresh_soon()
        _wait_for(refresher, 2)
        assert refresher.healthy
    finally:
        refresher.stop()
