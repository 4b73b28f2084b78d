"""`opledger ops cancel`, on both backends: before the lease, mid-run, and too late.

Before: cancellation was a Python method only (`Ledger.cancel`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ledger import Ledger, StorageConfig
from tests.ledger.helpers import (
    ALICE,
    NO_HITS,
    cli,
    cli_json,
    event_types,
    make_ledger,
    result,
    search,
    use_storage,
)

GLASS = ("--break-glass", "--as", "ops-lead")
"""Written to the database directly, recorded as `break-glass:ops-lead`."""


@pytest.fixture
def ledger(storage: StorageConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    """op-ready: ready; op-running: leased; op-done: succeeded."""
    ledger = make_ledger(storage)
    for operation_id in ("op-ready", "op-running", "op-done"):
        ledger.submit(search(operation_id), ALICE)
    ledger.lease("op-running", executor="exec-1")
    done = ledger.lease("op-done", executor="exec-1")
    ledger.record_result(result("op-done", done.fencing_token, data=NO_HITS))
    ledger.refresh()
    use_storage(monkeypatch, tmp_path, storage)
    return ledger


def test_cancel_before_the_lease_mid_run_and_too_late(
    ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    ready = cli_json(capsys, "ops", "cancel", "op-ready", *GLASS,
                     "--reason", "the customer withdrew the request")
    assert ready["state"] == "cancelled"
    assert ready["outcome"] == {"status": "cancelled", "by": "break-glass:ops-lead"}
    status = ledger.status("op-ready")
    assert status.final and status.state == "cancelled"

    running = cli_json(capsys, "ops", "cancel", "op-running", *GLASS)
    assert running["state"] == "cancel_requested"  # its executor holds the lease
    assert ledger.status("op-running").final is False

    done = cli_json(capsys, "ops", "cancel", "op-done", *GLASS)
    assert done["state"] == "succeeded"  # the effect happened: too late, and recorded so
    assert event_types(ledger, "op-done")[-1] == "CancelTooLate"

    again = cli_json(capsys, "ops", "cancel", "op-ready", "--break-glass", "--as", "someone-else")
    assert again["state"] == "cancelled"
    assert event_types(ledger, "op-ready").count("Cancelled") == 1  # converges


def test_cancel_of_an_unknown_operation_is_one_line(
    ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(capsys, "ops", "cancel", "op-nope", *GLASS)
    assert (code, out) == (2, "")
    assert "OPERATION_NOT_FOUND" in err and "Traceback" not in err
    code, _, err = cli(capsys, "ops", "cancel", "op-ready")  # neither an identity nor glass
    assert code == 2 and "--operator NAME" in err
    assert ledger.get("op-ready").state.value == "ready"
