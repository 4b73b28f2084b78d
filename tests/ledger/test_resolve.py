"""A person can always settle an unknown outcome: `opledger ops resolve`, on both backends.

Before: `Ledger.reconcile` was reachable only from Python; an operation whose
outcome was unknown stayed so until someone wrote code.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ledger import Ledger, StorageConfig
from tests.ledger.helpers import ALICE, cli, cli_json, make_ledger, search, use_storage

GLASS = ("--break-glass", "--as", "ops-lead")
"""Written to the database directly, recorded as `break-glass:ops-lead`."""

REASON = "the provider's dashboard shows the call"


@pytest.fixture
def unknown(storage: StorageConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    """op-a and op-b: leased, then their leases ran out (outcome unknown); op-ready: ready."""
    now = [datetime.now(UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    for operation_id in ("op-a", "op-b", "op-ready"):
        ledger.submit(search(operation_id), ALICE)
    for operation_id in ("op-a", "op-b"):
        ledger.lease(operation_id, executor="exec-1")
    now[0] += timedelta(hours=1)
    assert sorted(ledger.expire_leases()) == ["op-a", "op-b"]
    ledger.refresh()
    use_storage(monkeypatch, tmp_path, storage)
    return ledger


def _reconciled(ledger: Ledger, operation_id: str) -> Any:
    last = ledger.history(operation_id)[-1]
    assert type(last).__name__ == "Reconciled"
    return last


def test_a_person_settles_an_unknown_outcome_with_who_and_why(
    unknown: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    applied = cli_json(capsys, "ops", "resolve", "op-a", "--applied", *GLASS,
                       "--reason", REASON)
    assert applied["state"] == "succeeded"
    assert applied["outcome"] == {"status": "succeeded", "output_hash": "", "result_ref": "",
                                  "attempt": 1, "reconciled": True}
    event = _reconciled(unknown, "op-a")
    assert (event.outcome, event.by, event.reason) == ("succeeded", "break-glass:ops-lead", REASON)

    not_applied = cli_json(capsys, "ops", "resolve", "op-b", "--not-applied", *GLASS,
                           "--reason", "no record of it at the provider")
    assert not_applied["state"] == "failed"
    assert not_applied["outcome"]["code"] == "NOT_APPLIED"
    assert not_applied["outcome"]["retryable"] is False  # final: the ledger does not retry it
    status = unknown.status("op-b")
    assert status.final and status.state == "failed"
    unknown.refresh()  # the service seals (the CLI never does)
    assert unknown.verify(workers=1).ok


def test_only_an_unknown_outcome_can_be_resolved_and_only_with_a_reason(
    unknown: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    before = len(unknown.history("op-ready"))
    code, out, err = cli(capsys, "ops", "resolve", "op-ready", "--applied", *GLASS,
                         "--reason", REASON)
    assert (code, out) == (2, "")
    assert "ILLEGAL_TRANSITION" in err and "Traceback" not in err
    assert len(unknown.history("op-ready")) == before  # nothing appended
    cli_json(capsys, "ops", "resolve", "op-a", "--applied", *GLASS, "--reason", REASON)
    code, _, err = cli(capsys, "ops", "resolve", "op-a", "--not-applied", "--break-glass",
                       "--as", "someone-else", "--reason", "changed my mind")
    assert code == 2 and "ILLEGAL_TRANSITION" in err  # settled is settled
    code, _, err = cli(capsys, "ops", "resolve", "op-b", "--applied", *GLASS,
                       "--reason", "  ")
    assert code == 2 and "reason" in err
    code, _, err = cli(capsys, "ops", "resolve", "op-b", *GLASS, "--reason", REASON)
    assert code == 64  # neither --applied nor --not-applied: a usage error
    assert unknown.get("op-b").state.value == "outcome_unknown"


def test_resolve_prints_the_operation_for_people(
    unknown: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(capsys, "ops", "resolve", "op-a", "--applied", *GLASS,
                         "--reason", REASON)
    assert code == 0, err
    assert "succeeded" in out and f"reconciled by break-glass:ops-lead: succeeded ({REASON})" in out
