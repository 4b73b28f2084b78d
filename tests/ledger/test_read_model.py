"""The operations view is a fold of the events: verify checks every row, `ops rebuild`
repairs it, and `ops list` is current without writing. SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from ledger import Ledger, StorageConfig
from ledger.projections.operations_view import ROW_COLUMNS
from tests.ledger.helpers import (
    ALICE,
    SEAL_KEY,
    cli,
    cli_json,
    email,
    make_ledger,
    search,
    use_storage,
)

TRUST = ("--public-key", SEAL_KEY.public_key)


@pytest.fixture
def denied(storage: StorageConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    """op-mail was denied by an approver; op-read is ready. Projected and sealed."""
    ledger = make_ledger(storage)
    ledger.submit(email("op-mail"), ALICE)
    ledger.submit(search("op-read"), ALICE)
    ledger.deny(
        "op-mail", approver="bob", approver_roles=["support_lead"], reason="wrong customer"
    )
    ledger.refresh()
    use_storage(monkeypatch, tmp_path, storage)
    return ledger


def _view(ledger: Ledger) -> list[tuple[Any, ...]]:
    return ledger.db.query(
        f"SELECT {', '.join(ROW_COLUMNS)} FROM opledger_operations ORDER BY operation_id"
    )


def _state_of(rows: list[dict[str, Any]], operation_id: str) -> str:
    return cast(str, next(row["state"] for row in rows if row["operation_id"] == operation_id))


def test_a_view_only_edit_is_named_by_verify_and_repaired_by_rebuild(
    denied: Ledger, capsys: Any
) -> None:
    denied.db.execute(
        "UPDATE opledger_operations SET state = 'succeeded', attempts = 1"
        " WHERE operation_id = 'op-mail'"
    )
    assert _state_of(cli_json(capsys, "ops", "list"), "op-mail") == "succeeded"

    code, out, _ = cli(capsys, "audit", "verify", *TRUST)
    assert code == 1
    assert (
        "view_mismatch: op-mail v5: state is 'succeeded', the events say 'approval_denied';"
        " attempts is 1, the events say 0"
    ) in out

    code, out, err = cli(capsys, "ops", "rebuild")
    assert (code, err) == (0, "")
    assert out == "rebuilt the operations view from 8 events\n"
    assert _state_of(cli_json(capsys, "ops", "list"), "op-mail") == "approval_denied"
    assert cli_json(capsys, "audit", "verify", *TRUST)["ok"] is True


def test_missing_and_extra_view_rows_are_named(denied: Ledger, capsys: Any) -> None:
    denied.db.execute("DELETE FROM opledger_operations WHERE operation_id = 'op-read'")
    denied.db.execute(
        "INSERT INTO opledger_operations (operation_id, state, tool, actor, tenant, created_at,"
        " updated_at, last_version) VALUES ('op-ghost', 'succeeded', 'x', 'a', 't', '', '', 1)"
    )

    report = cli_json(capsys, "audit", "verify", *TRUST, expect=1)
    assert [(f["kind"], f["operation_id"]) for f in report["findings"]] == [
        ("view_extra", "op-ghost"),
        ("view_missing", "op-read"),
    ]


def test_rebuild_leaves_the_seal_alone(denied: Ledger, capsys: Any) -> None:
    seal = denied.db.query("SELECT * FROM opledger_digest ORDER BY notification_id")
    signatures = denied.db.query("SELECT * FROM opledger_seal_signatures ORDER BY position")

    assert cli(capsys, "ops", "rebuild")[0] == 0

    assert denied.db.query("SELECT * FROM opledger_digest ORDER BY notification_id") == seal
    assert denied.db.query("SELECT * FROM opledger_seal_signatures ORDER BY position") == signatures


def test_ops_list_is_current_without_writing(denied: Ledger, capsys: Any) -> None:
    denied.submit(email("op-later"), ALICE)  # projected by the budget check, not sealed
    # Written by a command-line approver while no service projects the view.
    code, _, _ = cli(capsys, "approvals", "deny", "op-later", "--break-glass", "--as", "bob",
                     "--role", "support_lead")
    assert code == 0
    view_before = _view(denied)
    positions_before = denied.db.query("SELECT * FROM opledger_positions ORDER BY name")

    rows = cli_json(capsys, "ops", "list")
    pending = cli_json(capsys, "approvals", "list")

    assert _state_of(rows, "op-later") == "approval_denied"
    assert _state_of(rows, "op-read") == "ready"
    assert pending == []
    assert cli_json(capsys, "ops", "list", "--state", "approval_denied", "--limit", "1") == [
        next(r for r in rows if r["operation_id"] == "op-later")
    ]
    assert _view(denied) == view_before  # nothing written
    assert denied.db.query("SELECT * FROM opledger_positions ORDER BY name") == positions_before
    denied.refresh()
    assert cli_json(capsys, "ops", "list") == rows  # what the view says once it catches up


def test_the_fold_has_its_own_module_and_its_names_stay_importable_from_the_view() -> None:
    from ledger.projections import operation_row, operations_view

    for name in ("ROW_COLUMNS", "VIEW_COLUMNS", "OperationRow", "Row", "fold_event",
                 "fold_stored", "view_text"):
        assert getattr(operations_view, name) is getattr(operation_row, name), name
