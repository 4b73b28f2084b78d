"""The view and the seal, refreshed on a thread of their own (`ViewRefresher`), on both
backends: the view and the seal it writes are exactly what an inline refresh writes,
and the thread interleaved with inline refreshes (the service's sweeps) and with
appends neither skips nor repeats an event, nor breaks the signed chain."""

from __future__ import annotations

import time

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
    """Both sealers sign with the same key and take turns through the seal's row: the
    chain and the view are whole, whichever wrote which batch."""
    ledger = make_ledger(storage)
    refresher = ViewRefresher(ledger)
    refresher.start()
    try:
        for n in range(40):
            ledger.submit(search(f"op-{n}"), ALICE)
            refresher.refresh_soon()
            if n % 3 == 0:
                ledger.refresh()  # inline, as the sweeps do, while the thread may run
        refresher.refresh_soon()
        _wait_for(refresher, 2)
    finally:
        refresher.stop()
    ledger.seal_now()
    assert refresher.refreshes >= 2
    last = ledger.event_reader.last_position()
    assert ledger.projector.position() == last
    assert _head_position(ledger) == last
    # Search is rate-limited per caller: some were refused, and the view says so.
    assert sum(_view_counts(ledger).values()) == 40
    written = _view(ledger)
    ledger.projector.rebuild()  # the view again from the events alone: the same rows
    assert _view(ledger) == written
    report = ledger.audit.verify(trusted_keys=[SEAL_KEY.public_key])
    assert report.ok, report.findings
    assert report.events_checked == last


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
