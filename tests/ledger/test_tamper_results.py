"""A kept result changed by hand is never served, and verify names it. SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ledger import Ledger, StorageConfig
from ledger.adapters.results import envelope_text_hash
from ledger.domain.errors import ResultIntegrityError
from schemas import ErrorCategory
from tests.ledger.helpers import (
    ALICE,
    SEAL_KEY,
    cli,
    cli_json,
    make_ledger,
    result,
    search,
    use_storage,
)

TRUST = ("--public-key", SEAL_KEY.public_key)
KEPT = {"items": [], "truncated": False, "next_cursor": "n1"}
FOUND = {"items": [], "truncated": True, "next_cursor": "found"}


@pytest.fixture
def settled(storage: StorageConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    """op-1 succeeded with a kept result; sealed; the CLI points here."""
    ledger = make_ledger(storage)
    ledger.submit(search("op-1"), ALICE)
    grant = ledger.lease("op-1", executor="exec-1")
    ledger.record_result(result("op-1", grant.fencing_token, data=KEPT))
    ledger.refresh()
    use_storage(monkeypatch, tmp_path, storage)
    return ledger


def _kept(ledger: Ledger) -> tuple[str, str]:
    ((reference, text),) = ledger.db.query("SELECT result_ref, envelope FROM opledger_results")
    return str(reference), str(text)


def test_the_event_binds_the_exact_kept_text(settled: Ledger) -> None:
    reference, text = _kept(settled)
    succeeded = settled.history("op-1")[-1]
    assert type(succeeded).__name__ == "Succeeded"
    assert succeeded.result_ref == reference
    assert succeeded.envelope_hash == envelope_text_hash(text)
    status = settled.status("op-1")
    assert status.result is not None and status.result.data == KEPT


def test_an_altered_kept_result_is_named_by_verify_and_never_served(
    settled: Ledger, storage: StorageConfig, capsys: Any
) -> None:
    reference, text = _kept(settled)
    settled.db.execute(
        "UPDATE opledger_results SET envelope = ? WHERE result_ref = ?",
        (text.replace('"next_cursor":"n1"', '"next_cursor":"n2"'), reference),
    )

    code, out, _ = cli(capsys, "audit", "verify", *TRUST)
    assert code == 1
    assert (
        f"result_mismatch: #5 op-1 v5: {reference}: its text does not hash to the"
        " envelope_hash of its event"
    ) in out

    for ledger in (settled, make_ledger(storage)):  # cached and replayed alike
        with pytest.raises(ResultIntegrityError) as raised:
            ledger.status("op-1")
        assert raised.value.code == "RESULT_INTEGRITY"
        assert raised.value.category is ErrorCategory.INTERNAL
        assert raised.value.safe_details == {"operation_id": "op-1", "result_ref": reference}


def test_results_read_ahead_for_the_outcome_notices_are_checked_all_the_same(
    settled: Ledger,
) -> None:
    """The relay reads the kept texts of a batch's outcomes in one query
    (`StatusReader.prefetch`) instead of one per status: what it reads is still the
    store's text, checked against its event, and each is used once."""
    settled.status_reader.prefetch(["op-1", "op-unknown"])
    status = settled.status("op-1")
    assert status.result is not None and status.result.data == KEPT
    reference, text = _kept(settled)
    settled.db.execute(
        "UPDATE opledger_results SET envelope = ? WHERE result_ref = ?",
        (text.replace('"next_cursor":"n1"', '"next_cursor":"n2"'), reference),
    )
    settled.status_reader.prefetch(["op-1"])
    with pytest.raises(ResultIntegrityError):
        settled.status("op-1")
    # Read ahead before the edit, asked after it: the stale copy is not kept around.
    settled.db.execute(
        "UPDATE opledger_results SET envelope = ? WHERE result_ref = ?", (text, reference)
    )
    settled.status_reader.prefetch(["op-1"])
    assert settled.status("op-1").result is not None
    settled.db.execute(
        "UPDATE opledger_results SET envelope = ? WHERE result_ref = ?",
        (text.replace('"next_cursor":"n1"', '"next_cursor":"n2"'), reference),
    )
    with pytest.raises(ResultIntegrityError):
        settled.status("op-1")


def test_a_result_row_no_event_names_is_named(settled: Ledger, capsys: Any) -> None:
    _, text = _kept(settled)
    settled.db.execute(
        "INSERT INTO opledger_results (result_ref, operation_id, envelope)"
        " VALUES ('result:op-1:7', 'op-1', ?)",
        (text,),
    )

    report = cli_json(capsys, "audit", "verify", *TRUST, expect=1)
    assert [(f["kind"], f["detail"]) for f in report["findings"]] == [
        ("result_orphaned", "result:op-1:7 is kept, but no event of this operation names it")
    ]
    assert report["results_checked"] == 2


def test_a_result_recorded_before_envelope_hashes_is_checked_by_its_output_hash(
    settled: Ledger, capsys: Any
) -> None:
    # An old event has no envelope_hash: its data must still hash to output_hash.
    reference, text = _kept(settled)
    settled.db.execute(
        "UPDATE opledger_results SET envelope = ? WHERE result_ref = ?",
        (text.replace('"items":[]', '"items":["forged"]'), reference),
    )
    from ledger.audit.model import ResultBinding, result_problem

    succeeded = settled.history("op-1")[-1]
    legacy = ResultBinding(5, 5, "Succeeded", "", succeeded.output_hash, "succeeded", "")
    assert result_problem(text, "op-1", legacy) == ""
    forged = _kept(settled)[1]
    assert result_problem(forged, "op-1", legacy) == (
        "its data does not hash to the output_hash of its event"
    )


def test_a_reconciled_attempt_serves_its_own_result_not_the_unknown_one(
    storage: StorageConfig,
) -> None:
    ledger = make_ledger(storage)
    ledger.submit(search("op-1"), ALICE)
    grant = ledger.lease("op-1", executor="exec-1")
    unknown = result(
        "op-1",
        grant.fencing_token,
        ok=False,
        error={"code": "TIMEOUT", "category": "TRANSIENT", "message": "no answer"},
    ).model_copy(update={"outcome_unknown": True})
    ledger.record_result(unknown)
    assert ledger.get("op-1").state.value == "outcome_unknown"
    ledger.record_result(result("op-1", grant.fencing_token, data=FOUND))

    status = make_ledger(storage).status("op-1")
    assert status.state == "succeeded"
    assert status.result is not None and status.result.ok
    assert status.result.data == FOUND
    assert ledger.verify(workers=1).ok
