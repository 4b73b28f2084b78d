"""The `opledger` command line, end to end over a SQLite ledger in a temporary home."""

from __future__ import annotations

import io
import json
import re
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger import StorageConfig, build_ledger
from ledger.audit.seal import SealKey
from ledger.entrypoints.cli import main
from ledger.nats import generate_credentials
from policy import InMemoryTargetResolver
from policy.catalog import SAMPLE_RULES, sample_targets
from schemas import PreviewReport, RuntimeContext, ToolProposal
from tests.ledger.helpers import ALICE as HELPER_ALICE
from tests.ledger.helpers import NEXT_STEP, NO_HITS, email, make_ledger, result, search

ALICE = RuntimeContext(
    principal="alice",
    tenant="acme",
    capabilities=frozenset({"documents:search", "email:send"}),
)
EMAIL_ARGUMENTS = {
    "recipient_ids": ["cus-0001"],
    "template": "support_received",
    "variables": {"ticket_id": "TCK-42"},
    "body": "Thanks for writing to us.",
}
SETTINGS_VARIABLES = (
    "OPLEDGER_HOME", "OPLEDGER_DATABASE", "OPLEDGER_POSTGRES_SCHEMA",
    "OPLEDGER_CONTRACTS_DIR", "OPLEDGER_NATS_URL", "OPLEDGER_CREDS_DIR",
)


def _proposal(tool: str, arguments: dict[str, Any], operation_id: str) -> ToolProposal:
    return ToolProposal(
        proposal_id=f"p-{operation_id}",
        conversation_id="c-1",
        requested_by_user_id="alice",
        tool_name=tool,
        arguments=arguments,
        operation_id=operation_id,
    )


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty state directory as `OPLEDGER_HOME`, with no other settings leaking in."""
    for name in SETTINGS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPLEDGER_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def ledger_ids(home: Path) -> Iterator[dict[str, str]]:
    """A ready search (3 events) and an email awaiting approval (3 events), both sealed
    by the ledger identity of `<home>/creds` (whose public key verification trusts)."""
    credentials = generate_credentials(home / "creds", hosts=["h1"], tools=["search_documents"])
    ledger = build_ledger(
        StorageConfig.sqlite(home / "ledger.db"),
        resolver=InMemoryTargetResolver(sample_targets()),
        rules=SAMPLE_RULES,
        seal_key=SealKey.from_seed_file(credentials.ledger.seed_path),
    )
    try:
        search = ledger.submit(
            _proposal("search_documents", {"query": "refund policy"}, "op-search"), ALICE
        )
        email = ledger.submit(
            _proposal("send_customer_email", EMAIL_ARGUMENTS, "op-email"), ALICE
        )
        assert (search.state.value, email.state.value) == ("ready", "awaiting_approval")
        # The e-mail's executor previewed it (its contract asks for that first).
        ledger.leasing.record_preview(
            "op-email", tool=None, executor="send_customer_email-1", report=EMAIL_PREVIEW
        )
        ledger.refresh()
        operation = ledger.get("op-email")
        assert operation.approval is not None and operation.proposal_hash is not None
        assert operation.preview_hash is not None
        yield {
            "proposal_hash": operation.proposal_hash,
            "preview_hash": operation.preview_hash,
            "approval_id": operation.approval.approval_id,
            "events_table": ledger.events_table,
        }
    finally:
        ledger.close()


EMAIL_PREVIEW = PreviewReport(
    effect={
        "summary": "send 1 e-mail(s): We received your request TCK-42",
        "body": "Hello customer,\n\nThanks for writing to us.\n\nWe received your request TCK-42",
        "recipients": [{"customer_id": "cus-0001", "address": "customer-0001@acme.example.test"}],
    }
)
"""What the e-mail's executor previews for `op-email` (its contract asks for a preview)."""


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _json(capsys: pytest.CaptureFixture[str], *argv: str, expect: int = 0) -> Any:
    code, out, err = _run(capsys, *argv, "--json")
    assert code == expect, err
    return json.loads(out)


def _table_line(out: str, operation_id: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(operation_id))


# ---------------------------------------------------------------------------- ops list


def test_ops_list_prints_an_aligned_table_newest_first(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "ops", "list")

    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == [
        "OPERATION", "STATE", "TOOL", "ACTOR", "TENANT", "RISK", "ATTEMPTS", "UPDATED", "(UTC)"
    ]
    assert [line.split()[0] for line in lines[1:]] == ["op-email", "op-search"]
    email, search = lines[1], lines[2]
    assert email.split()[1:7] == [
        "awaiting_approval", "send_customer_email@1.0.0", "alice", "acme", "high", "0"
    ]
    assert search.split()[1:7] == ["ready", "search_documents@2.1.0", "alice", "acme", "low", "0"]
    for column, value in (("STATE", "ready"), ("RISK", "low"), ("ATTEMPTS", "0")):
        assert lines[0].index(column) == search.index(f" {value} ") + 1


def test_ops_list_json_is_an_array_of_rows_and_filters_apply(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = _json(capsys, "ops", "list")
    assert [row["operation_id"] for row in rows] == ["op-email", "op-search"]
    assert rows[1] | {"created_at": None, "updated_at": None} == {
        "operation_id": "op-search", "state": "ready", "tool": "search_documents",
        "tool_version": "2.1.0", "actor": "alice", "tenant": "acme", "risk": "low",
        "attempts": 0, "created_at": None, "updated_at": None, "last_version": 3,
        "approval_id": None, "approval_expires_at": None, "approvals_required": 0,
        "approvals_granted": 0, "proposal_hash": rows[1]["proposal_hash"], "host": "",
    }

    assert [r["operation_id"] for r in _json(capsys, "ops", "list", "--state", "ready")] == [
        "op-search"
    ]
    assert [r["operation_id"] for r in _json(capsys, "ops", "list", "--tool",
                                             "send_customer_email")] == ["op-email"]
    assert _json(capsys, "ops", "list", "--tenant", "globex") == []
    assert len(_json(capsys, "ops", "list", "--limit", "1")) == 1


def test_global_options_work_before_the_subcommand_too(
    ledger_ids: dict[str, str],
    home: Path,
    capsys: pytest.CaptureFixture[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    code, out, _ = _run(capsys, "--json", "ops", "list", "--state", "ready")
    assert code == 0
    assert [row["operation_id"] for row in json.loads(out)] == ["op-search"]

    other_home = tmp_path_factory.mktemp("other-home")
    code, out, err = _run(capsys, "--home", str(other_home), "ops", "list")
    assert (code, out) == (2, "")
    where = f"sqlite:{other_home / 'ledger.db'}"
    assert err == f"error: NO_LEDGER: no ledger at {where}: no such file{NEXT_STEP}\n"
    assert not (other_home / "ledger.db").exists()

    code, out, _ = _run(capsys, "ops", "list", "--database", str(home / "ledger.db"), "--json")
    assert len(json.loads(out)) == 2


def test_a_usage_error_exits_64_without_running(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "ops", "list", "--limit", "0")

    assert (code, out) == (64, "")
    assert "--limit: must be at least 1, not 0" in err


# ---------------------------------------------------------------------------- ops show


def test_ops_show_prints_key_fields_and_the_timeline(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "ops", "show", "op-email")

    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "Operation op-email (version 5)"
    fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
              for line in lines[1:lines.index("")]}
    assert fields["state"] == "awaiting_approval"
    assert fields["tool"] == "send_customer_email@1.0.0"
    assert fields["actor"] == "alice (tenant acme, development)"
    assert fields["risk"] == "high"
    assert fields["proposal hash"] == ledger_ids["proposal_hash"]
    assert json.loads(fields["arguments"]) == EMAIL_ARGUMENTS
    assert fields["approval"].startswith(f"{ledger_ids['approval_id']}: 0 of 1 from support_lead")
    assert fields["effect"] == "irreversible_write (not reversible)"
    assert fields["outcome"] == "-"
    timeline = lines[lines.index("Timeline") + 1:]
    assert timeline[0].split() == ["VERSION", "TYPE", "TIME", "(UTC)", "SUMMARY"]
    assert [row.split()[:2] for row in timeline[1:]] == [
        ["1", "Proposed"], ["2", "Validated"], ["3", "ApprovalRequested"],
        ["4", "PreviewRequested"], ["5", "PreviewRecorded"],
    ]
    assert timeline[1].endswith("alice proposed send_customer_email (acme, development)")
    assert f"proposal {ledger_ids['proposal_hash'][:12]}" in timeline[2]
    assert f"approval {ledger_ids['approval_id']} requested: 1 from support_lead" in timeline[3]
    assert timeline[5].endswith(
        f"previewed by send_customer_email-1, preview {ledger_ids['preview_hash'][:12]}"
    )


def test_ops_show_prints_the_lease_and_the_result_in_the_timeline(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = make_ledger(StorageConfig.sqlite(home / "ledger.db"))
    try:
        ledger.submit(search("op-done"), HELPER_ALICE)
        grant = ledger.lease("op-done", executor="search-exec-1")
        ledger.record_result(result("op-done", grant.fencing_token, data=NO_HITS,
                                    executor="search-exec-1"))
        ledger.refresh()
        outcome = ledger.get("op-done").outcome
        assert outcome is not None and outcome.output_hash
    finally:
        ledger.close()

    code, out, err = _run(capsys, "ops", "show", "op-done")

    assert (code, err) == (0, "")
    lines = out.splitlines()
    fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
              for line in lines[1:lines.index("")]}
    assert fields["state"] == "succeeded"
    timeline = lines[lines.index("Timeline") + 1:]
    assert [row.split()[:2] for row in timeline[1:]] == [
        ["1", "Proposed"], ["2", "Validated"], ["3", "Readied"],
        ["4", "LeaseClaimed"], ["5", "Succeeded"],
    ]
    assert timeline[4].split("  ")[-1].startswith(
        f"leased to search-exec-1: attempt 1, token {grant.fencing_token}, until "
    )
    assert timeline[5].endswith(f"succeeded on attempt 1, output {outcome.output_hash[:12]}")


def test_ops_show_as_of_replays_to_that_version(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = _json(capsys, "ops", "show", "op-email", "--as-of", "2")

    assert (data["operation_id"], data["version"], data["as_of"]) == ("op-email", 2, 2)
    assert data["state"] == "validated"
    assert data["approval"] is None
    assert data["arguments"] == EMAIL_ARGUMENTS
    assert data["proposal_hash"] == ledger_ids["proposal_hash"]
    assert [event["type"] for event in data["timeline"]] == ["Proposed", "Validated"]
    assert [event["version"] for event in data["timeline"]] == [1, 2]

    current = _json(capsys, "ops", "show", "op-email")
    assert current["state"] == "awaiting_approval"
    assert current["approval"]["effect_preview"]["effect"] == "irreversible_write"
    assert current["approval"]["approver_roles"] == ["support_lead"]
    assert len(current["timeline"]) == 5


def test_ops_show_as_of_a_version_that_does_not_exist_is_an_error(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "ops", "show", "op-email", "--as-of", "9")

    assert (code, out) == (2, "")
    assert err == (
        "error: OPERATION_NOT_FOUND: the operation has no version 9; its latest is 5"
        " (operation_id=op-email)\n"
    )


def test_unknown_operation_exits_2_with_one_line_and_no_traceback(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "ops", "show", "op-nope")

    assert (code, out) == (2, "")
    assert err == "error: OPERATION_NOT_FOUND: no such operation (operation_id=op-nope)\n"

    code, out, err = _run(capsys, "ops", "show", "op-nope", "--json")
    assert (code, out) == (2, "")
    envelope = json.loads(err)
    assert envelope["ok"] is False
    assert envelope["error"]["code"] == "OPERATION_NOT_FOUND"
    assert envelope["error"]["category"] == "NOT_FOUND"
    assert envelope["error"]["safe_details"] == {"operation_id": "op-nope"}
    assert "Traceback" not in err


# ------------------------------------------------------------------------------- audit


def test_audit_verify_reports_counts_and_exits_0(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "audit", "verify")

    assert (code, err) == (0, "")
    fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
              for line in out.splitlines() if line.startswith("  ")}
    assert fields["events checked"] == "8"
    assert fields["operations checked"] == "2"
    assert fields["sealed events"] == "8"
    assert fields["unsealed events"] == "0"
    assert fields["past signed head"] == "0"
    assert fields["signed head"].startswith("#")
    assert len(fields["head digest"]) == 64
    assert out.splitlines()[-1] == (
        "OK: every event matches its chain and the signed seal;"
        " the view and kept results match the events"
    )

    report = _json(capsys, "audit", "verify")
    assert report["ok"] is True
    assert report["findings"] == []
    assert report["head_digest"] == fields["head digest"]
    code, _, _ = _run(capsys, "audit", "verify", "--expect-head", report["head_digest"])
    assert code == 0


def test_audit_verify_with_a_wrong_expected_head_exits_1(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _run(capsys, "audit", "verify", "--expect-head", "0" * 64)

    assert code == 1
    assert "FAILED: 1 finding(s)" in out
    assert "head_mismatch: the sealed head digest is not the one expected" in out


def test_audit_verify_finds_a_tampered_event(
    ledger_ids: dict[str, str],
    home: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with sqlite3.connect(home / "ledger.db") as conn:
        table = ledger_ids["events_table"]
        (state,) = conn.execute(
            f"SELECT state FROM {table} WHERE originator_id = ? AND originator_version = 2",
            ("op-search",),
        ).fetchone()
        event = json.loads(state)
        assert event["risk"] == "low"
        event["risk"] = "critical"
        conn.execute(
            f"UPDATE {table} SET state = ? WHERE originator_id = ? AND originator_version = 2",
            (json.dumps(event).encode(), "op-search"),
        )

    code, out, err = _run(capsys, "audit", "verify")

    assert (code, err) == (1, "")
    assert out.splitlines()[-4] == "FAILED: 3 finding(s)"
    findings = out.splitlines()[-3:]
    assert findings[0].strip().startswith("modified: #")
    assert "op-search v2: event hash differs from the sealed hash" in findings[0]
    assert "op-search v3: prev_hash is not the hash of the event before it" in findings[1]
    # The view took the event in before it was changed: it no longer folds to the same row.
    assert findings[2].strip() == (
        "view_mismatch: op-search v3: risk is 'low', the events say 'critical'"
    )

    report = _json(capsys, "audit", "verify", expect=1)
    assert report["ok"] is False
    assert [(f["kind"], f["operation_id"], f["version"]) for f in report["findings"]] == [
        ("modified", "op-search", 2), ("chain_broken", "op-search", 3),
        ("view_mismatch", "op-search", 3),
    ]


def test_audit_export_writes_one_json_line_per_event(
    ledger_ids: dict[str, str],
    home: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = home / "export.jsonl"

    code, out, err = _run(capsys, "audit", "export", "--output", str(target))

    assert (code, out) == (0, "")
    assert err == f"exported 8 events to {target}\n"
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(records) == 8
    assert [(r["operation_id"], r["version"], r["type"]) for r in records] == [
        ("op-search", 1, "Proposed"), ("op-search", 2, "Validated"), ("op-search", 3, "Readied"),
        ("op-email", 1, "Proposed"), ("op-email", 2, "Validated"),
        ("op-email", 3, "ApprovalRequested"), ("op-email", 4, "PreviewRequested"),
        ("op-email", 5, "PreviewRecorded"),
    ]
    assert all(len(record["event_hash"]) == 64 for record in records)
    # send_customer_email marks /body sensitive: the export carries its hash only.
    assert set(records[4]["event"]["arguments"]["body"]) == {"sha256"}
    # and the tool's preview, which renders the body into its text, is hashed whole.
    assert set(records[7]["event"]["report"]) == {"sha256"}
    assert "Thanks for writing" not in target.read_text()
    # nor the addresses the executor resolved, which the ledger never had otherwise.
    assert "customer-0001@acme.example.test" not in target.read_text()


def test_audit_export_defaults_to_stdout(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "audit", "export")

    assert code == 0
    assert err == "exported 8 events to stdout\n"
    assert [json.loads(line)["type"] for line in out.splitlines()] == [
        "Proposed", "Validated", "Readied", "Proposed", "Validated", "ApprovalRequested",
        "PreviewRequested", "PreviewRecorded",
    ]


def test_audit_export_to_an_unwritable_path_is_one_line(
    ledger_ids: dict[str, str],
    home: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "audit", "export", "--output", str(home / "no" / "x.jsonl"))

    assert (code, out) == (2, "")
    assert err.startswith("error: INVALID_ARGUMENT: cannot write ")
    assert err.count("\n") == 1


# --------------------------------------------------------------------------- approvals


def test_approvals_list_shows_the_pending_request(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "approvals", "list")

    assert (code, err) == (0, "")
    header, *rows = out.splitlines()
    assert header.split()[:7] == [
        "OPERATION", "APPROVAL", "TOOL", "ACTOR", "TENANT", "RISK", "APPROVALS"
    ]
    assert len(rows) == 1
    assert rows[0].split()[:7] == [
        "op-email", ledger_ids["approval_id"], "send_customer_email@1.0.0", "alice", "acme",
        "high", "0/1",
    ]

    (pending,) = _json(capsys, "approvals", "list")
    assert pending["operation_id"] == "op-email"
    assert (pending["approvals_granted"], pending["approvals_required"]) == (0, 1)
    assert pending["approval_expires_at"].endswith("Z")


def test_approvals_show_explains_the_effect_for_people(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "approvals", "show", "op-email")

    assert (code, err) == (0, "")
    assert out.startswith(
        f"Approval request {ledger_ids['approval_id']} for send_customer_email (version 1.0.0)\n"
        "Operation op-email: awaiting approval (0 of 1 approvals)\n"
    )
    fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
              for line in out.splitlines() if line.startswith("  ") and ":" in line}
    assert fields["Effect"] == "changes data; this CANNOT be undone"
    assert fields["Risk"] == "HIGH"
    assert fields["Why this risk"] == "the tool's usual risk"
    assert fields["Requested by"] == "alice (tenant acme, development)"
    assert fields["Who approves"] == (
        "1 approval(s) from role support_lead; the requester may not approve"
    )
    assert fields["recipient_ids"] == "cus-0001"
    assert fields["template"] == "support_received"
    assert fields["body"] == "Thanks for writing to us."
    assert fields["Expires"].endswith(" UTC")
    assert f"Proposal hash: {ledger_ids['proposal_hash']}" in out
    assert (
        f"approve op-email --approver YOUR_NAME --proposal-hash {ledger_ids['proposal_hash']}"
        f" --preview-hash {ledger_ids['preview_hash']}"
        in out
    )
    # What would be sent, as the tool itself renders it (its preview), before the arguments.
    assert (
        "What it would do (the tool's own preview, nothing done yet):\n"
        "  summary: send 1 e-mail(s): We received your request TCK-42\n"
        "  body:\n"
        "    | Hello customer,\n"
        "    | \n"
        "    | Thanks for writing to us.\n"
    ) in out
    assert "  recipients: cus-0001 · customer-0001@acme.example.test\n" in out
    assert f"Preview hash:  {ledger_ids['preview_hash']}" in out
    # Whom it reaches, as the host's systems name them, not only `cus-0001`.
    assert "It acts on:\n  customer cus-0001: Alice\n" in out

    data = _json(capsys, "approvals", "show", "op-email")
    assert data["targets"] == [
        {"argument": "/recipient_ids/0", "kind": "customer", "id": "cus-0001", "label": "Alice"}
    ]
    assert data["effect"] == "irreversible_write"
    assert data["reversible"] is False
    assert data["arguments"] == EMAIL_ARGUMENTS
    assert data["approver_roles"] == ["support_lead"]
    assert data["proposal_hash"] == ledger_ids["proposal_hash"]
    assert data["preview"] == EMAIL_PREVIEW.model_dump(mode="json", exclude_none=True)
    assert data["preview_hash"] == ledger_ids["preview_hash"] == EMAIL_PREVIEW.digest()


def test_approvals_show_of_an_operation_without_approval_is_an_error(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "approvals", "show", "op-search")

    assert (code, out) == (2, "")
    assert err == (
        "error: NO_APPROVAL_REQUEST: the operation never asked for approval (it is ready)"
        " (operation_id=op-search)\n"
    )


def test_approve_with_the_wrong_hash_is_refused(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(
        capsys, "approvals", "approve", "op-email", "--break-glass", "--as", "bob",
        "--role", "support_lead",
        "--proposal-hash", "f" * 64,
    )

    assert (code, out) == (2, "")
    assert err.startswith("error: APPROVAL_REFUSED: approval refused: proposal_hash_mismatch")
    assert "Traceback" not in err
    data = _json(capsys, "ops", "show", "op-email")
    assert data["state"] == "awaiting_approval"
    assert data["timeline"][-1]["type"] == "ApprovalRefused"
    assert data["timeline"][-1]["summary"] == (
        "approval by bob (break glass) refused: proposal_hash_mismatch"
    )


def test_approve_without_the_preview_shown_is_refused_with_what_to_do(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(
        capsys, "approvals", "approve", "op-email", "--break-glass", "--as", "bob",
        "--role", "support_lead", "--proposal-hash", ledger_ids["proposal_hash"],
    )

    assert (code, out) == (2, "")
    assert err.startswith(
        "error: APPROVAL_REFUSED: approval refused: preview_hash_mismatch (the preview is not"
        " the one of this call: show the approval again and approve the preview it shows now)"
    )
    assert _json(capsys, "ops", "show", "op-email")["state"] == "awaiting_approval"


def test_the_requester_cannot_approve_their_own_call(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = _run(
        capsys, "approvals", "approve", "op-email", "--break-glass", "--as", "alice",
        "--role", "support_lead",
        "--proposal-hash", ledger_ids["proposal_hash"],
        "--preview-hash", ledger_ids["preview_hash"],
    )

    assert code == 2
    assert "APPROVAL_REFUSED: approval refused: requester_cannot_approve" in err


def test_approve_with_the_right_hash_by_another_user_makes_it_ready(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(
        capsys, "approvals", "approve", "op-email", "--break-glass", "--as", "bob",
        "--role", "support_lead",
        "--role", "auditor", "--proposal-hash", ledger_ids["proposal_hash"],
        "--preview-hash", ledger_ids["preview_hash"],
    )

    assert (code, err) == (0, "")
    assert out == (
        "approved op-email as bob (break glass) (1 of 1 approvals): it is ready to run"
        " (state ready)\n"
    )
    data = _json(capsys, "ops", "show", "op-email")
    assert data["state"] == "ready"
    assert data["approvers"] == ["bob"]
    assert [e["type"] for e in data["timeline"]][-2:] == ["ApprovalGranted", "Readied"]
    assert _json(capsys, "approvals", "list") == []


def test_approve_json_reports_the_new_state(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = _json(
        capsys, "approvals", "approve", "op-email", "--break-glass", "--as", "bob",
        "--role", "support_lead",
        "--proposal-hash", ledger_ids["proposal_hash"],
        "--preview-hash", ledger_ids["preview_hash"],
    )

    assert data == {
        "operation_id": "op-email", "decision": "approved", "by": "bob", "via": "break_glass",
        "state": "ready",
        "approval_id": ledger_ids["approval_id"], "approved_by": ["bob"], "required_approvals": 1,
    }


def test_deny_stops_the_operation(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(
        capsys, "approvals", "deny", "op-email", "--break-glass", "--as", "bob", "--role",
        "support_lead", "--reason", "wrong customer",
    )

    assert (code, err) == (0, "")
    assert out == "denied op-email as bob (break glass): it will not run (state approval_denied)\n"
    data = _json(capsys, "ops", "show", "op-email")
    assert data["state"] == "approval_denied"
    assert data["outcome"] == {"status": "approval_denied", "by": "bob"}
    assert data["timeline"][-1]["summary"] == "denied by bob (break glass): wrong customer"

    code, _, err = _run(
        capsys, "approvals", "approve", "op-email", "--break-glass", "--as", "carol",
        "--role", "support_lead",
        "--proposal-hash", ledger_ids["proposal_hash"],
    )
    assert code == 2
    assert err.startswith("error: ILLEGAL_TRANSITION: cannot grant approval to an operation"
                          " that is approval_denied")


def test_approve_of_an_unknown_operation_exits_2(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(
        capsys, "approvals", "approve", "op-nope", "--break-glass", "--as", "bob",
        "--role", "support_lead",
        "--proposal-hash", ledger_ids["proposal_hash"],
    )

    assert (code, out) == (2, "")
    assert err == "error: OPERATION_NOT_FOUND: no such operation (operation_id=op-nope)\n"


# ---------------------------------------------------------------------------- settings


def test_a_database_of_unknown_scheme_is_one_line_without_the_password(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPLEDGER_DATABASE", "mysql://ledger:s3cret@db.internal/ledger")

    code, out, err = _run(capsys, "ops", "list")

    assert (code, out) == (2, "")
    assert err == (
        "error: INVALID_CONFIG: database has the unknown scheme 'mysql://'; give a SQLite file"
        " path or a postgresql:// DSN (setting=database)\n"
    )
    assert "s3cret" not in err


def test_a_missing_contracts_dir_is_one_line(
    home: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("OPLEDGER_CONTRACTS_DIR", str(home / "missing"))

    code, out, err = _run(capsys, "--json", "audit", "verify")

    assert (code, out) == (2, "")
    envelope = json.loads(err)
    assert envelope["error"]["code"] == "INVALID_CONFIG"
    assert envelope["error"]["message"] == (
        f"contracts_dir {home / 'missing'} does not exist or is not a directory"
    )


def test_settings_come_from_the_toml_file_in_home(
    home: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (home / "opledger.toml").write_text(f'database = "{home / "from-toml.db"}"\n')
    build_ledger(StorageConfig.sqlite(home / "from-toml.db")).close()

    code, out, _ = _run(capsys, "ops", "list")

    assert (code, out) == (0, "no operations match\n")
    assert not (home / "ledger.db").exists()


def test_an_unknown_key_in_the_toml_file_is_one_line(
    home: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (home / "opledger.toml").write_text('databse = "x.db"\n')

    code, _, err = _run(capsys, "ops", "list")

    assert code == 2
    assert err == (
        "error: INVALID_CONFIG: unknown setting 'databse' (check opledger.toml)"
        " (setting=databse)\n"
    )


# ------------------------------------------------------------------- finding the home


def test_a_command_finds_the_home_from_any_folder_under_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As git finds its repository. Before: from another folder `approvals list` said
    there was nothing to approve (and an older version created an empty ledger)."""
    for name in SETTINGS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    ledger = make_ledger(StorageConfig.sqlite(tmp_path / ".opledger" / "ledger.db"))
    ledger.submit(email("op-email"), ALICE)
    ledger.close()
    deep = tmp_path / "projects" / "agent" / "src"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    pending = _json(capsys, "approvals", "list")
    assert [p["operation_id"] for p in pending] == ["op-email"]
    assert not (deep / ".opledger").exists()


def test_no_home_anywhere_above_is_one_line_naming_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in SETTINGS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, "approvals", "list")
    assert (code, out) == (2, "")
    assert err.startswith(
        f"error: NO_LEDGER: no ledger at sqlite:{tmp_path / '.opledger' / 'ledger.db'}: no such"
        " file (name another with --home or --database, or start one with `opledger up`)"
    ), err
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_no_running_stack_is_one_clear_error_not_an_attribute_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README tour's first line, run with no stack up. Before: `AttributeError:
    'NoneType' object has no attribute 'nats_url'`."""
    from ledger.embedded import StackNotRunning, require_running_stack

    monkeypatch.delenv("OPLEDGER_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StackNotRunning) as caught:
        require_running_stack()
    assert str(tmp_path / ".opledger") in caught.value.message
    assert "opledger up" in caught.value.message


def test_ops_show_shows_the_kept_result_and_how_far_to_trust_it(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: only the result's hash. Now the data hosts get (redacted by the executor)."""
    from tests.ledger.helpers import NO_HITS, result, search

    ledger = make_ledger(StorageConfig.sqlite(home / "ledger.db"))
    ledger.submit(search("op-found"), HELPER_ALICE)
    grant = ledger.lease("op-found", executor="exec-1")
    hits = {**NO_HITS, "next_cursor": "page-2-of-refunds"}
    ledger.record_result(result("op-found", grant.fencing_token, data=hits))
    ledger.close()
    data = _json(capsys, "ops", "show", "op-found")
    assert data["result"]["data"] == hits
    assert data["result"]["provenance"]["trust"] == "untrusted"
    code, out, _ = _run(capsys, "ops", "show", "op-found")
    assert code == 0
    assert "page-2-of-refunds" in out and "untrusted (from exec-1)" in out


# -------------------------------------------------------------- the operator's console


def test_status_says_what_needs_a_person_and_how_far_the_relay_is(
    ledger_ids: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    data = _json(capsys, "status")
    assert data["needs_a_person"] == {
        "awaiting_approval": 1, "outcome_unknown": 0, "needs_resolution": 0
    }
    assert data["operations"] == {"awaiting_approval": 1, "ready": 1}
    assert data["events"] > 0 and data["relay"]["position"] is None  # no service ran yet
    assert data["stack"] is None and data["consumers"] is None
    code, out, _ = _run(capsys, "status")
    assert code == 0
    assert "needs a person: 1 awaiting_approval" in out
    assert "opledger approvals list" in out
    assert "stack     none runs from this home" in out


def test_ops_watch_prints_each_event_once_in_order(
    ledger_ids: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "ops", "watch", "--from-start", "--count", "6")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert len(lines) == 6
    assert [tuple(line.split()[2:5]) for line in lines] == [
        ("op-search", "v1", "Proposed:"), ("op-search", "v2", "Validated:"),
        ("op-search", "v3", "Readied:"), ("op-email", "v1", "Proposed:"),
        ("op-email", "v2", "Validated:"), ("op-email", "v3", "ApprovalRequested:"),
    ]
    assert any("Proposed: alice proposed send_customer_email" in line for line in lines)
    # --json: one JSON object a line; nothing new comes, so --seconds ends it.
    code, out, _ = _run(capsys, "--json", "ops", "watch", "--seconds", "0.5")
    assert (code, out) == (0, "")


def test_tools_export_offers_only_what_the_caller_may_call(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A host in another language learns the tools and their argument schemas from
    here, not from policy/catalog/*.yaml."""
    code, out, _ = _run(capsys, "tools", "export", "--format", "anthropic",
                        "--capability", "documents:search", "--capability", "email:send")
    assert code == 0
    tools = {tool["name"]: tool for tool in json.loads(out)}
    assert {"search_documents", "send_customer_email"} <= set(tools)
    assert "delete_document" not in tools  # forbidden to agents: never offered
    assert "query_orders" not in tools  # needs orders:read, not held
    assert "query" in tools["search_documents"]["input_schema"]["required"]
    code, out, _ = _run(capsys, "tools", "export", "--format", "mcp")
    names = [tool["name"] for tool in json.loads(out)]
    assert "query_orders" in names and "delete_document" not in names
    assert all("inputSchema" in tool for tool in json.loads(out))


def test_status_counts_an_operation_the_view_has_not_caught_up_with_once(
    ledger_ids: dict[str, str], home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The view holds op-search as ready (projected); its newer events, not projected
    yet (no service runs), make it executing: it counts once, as executing. Before:
    once as ready and once as executing (found by a fresh-clone CI run)."""
    ledger = make_ledger(StorageConfig.sqlite(home / "ledger.db"))
    ledger.lease("op-search", executor="exec-1")  # appended, the view not refreshed
    ledger.close()
    assert _json(capsys, "status")["operations"] == {
        "awaiting_approval": 1, "executing": 1
    }


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal (where a progress line is drawn)."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    "argv",
    [("audit", "verify"), ("audit", "export"), ("ops", "rebuild")],
)
def test_long_commands_draw_progress_on_a_terminal_only(
    ledger_ids: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: tuple[str, ...],
) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 0 and "\r" not in err and "\r" not in out  # a pipe: no progress line
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    drawn = terminal.getvalue()
    assert drawn.startswith("\r") and len(drawn.strip()) > 0, drawn
    # Cleared before anything else is printed: what the command prints starts clean.
    assert re.search(r"\r +\r", drawn) and "\r" not in drawn.split("\r")[-1]
    assert "\r" not in out  # stdout (an export's payload) never carries it


def test_a_progress_line_counts_to_its_total() -> None:
    from ledger.entrypoints.progress import Progress

    stream = io.StringIO()
    line = Progress("verifying", "chunks", stream=stream, force=True)
    line.update(2, 4)
    line.update(4, 4)
    assert "[##########          ]  50%  2 of 4 chunks" in stream.getvalue()
    assert "100%  4 of 4 chunks" in stream.getvalue()
    line.finish()
    assert stream.getvalue().endswith("\r")
    quiet = io.StringIO()
    Progress("verifying", "chunks", stream=quiet).update(1, 2)  # not a terminal
    assert quiet.getvalue() == ""
