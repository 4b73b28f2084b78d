"""The sample executors: valid catalog calls give outputs valid against the catalog, and
each tool's own rules (dry run, re-checks, idempotency, reconciliation) hold."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from executors import (
    ExecutorConfigError,
    ItemAction,
    ItemDisposition,
    ItemProcessor,
    ProcessorOptions,
    Tool,
)
from executors.samples import SAMPLE_TOOLS, sample_tool
from executors.samples._world import reset_world, world
from executors.samples.email import EMAIL_DB_SECRET, count_sends
from policy import CompiledSchema
from policy._check._structure import apply_defaults
from schemas import ErrorCategory, LeaseDecision
from tests.executors.helpers import FakeLedger, context, contract, process, reply, work_item

SAMPLES_DIR = Path(__file__).resolve().parents[1] / "contract_samples"


@pytest.fixture(autouse=True)
def fresh_world() -> Iterator[None]:
    reset_world()
    yield
    reset_world()


def _valid_samples() -> list[tuple[str, Path]]:
    return [
        (tool, path)
        for tool in sorted(SAMPLE_TOOLS)
        for path in sorted((SAMPLES_DIR / tool / "valid").glob("*.json"))
    ]


def _arguments(tool: str, raw: Any) -> dict[str, Any]:
    """Arguments as the ledger leases them: parsed, with the schema's defaults applied."""
    arguments = json.loads(raw) if isinstance(raw, str) else raw
    normalized, _ = apply_defaults(contract(tool).input_schema, arguments)
    return dict(normalized)


def _run(
    tool: Tool,
    arguments: dict[str, Any],
    *,
    operation_id: str = "op-1",
    secrets: dict[str, str] | None = None,
    decision: LeaseDecision = LeaseDecision.EXECUTE,
) -> ItemDisposition:
    processor = ItemProcessor(
        tool, contract(tool.name), ProcessorOptions("exec-test", secrets=secrets or {})
    )
    return process(
        processor,
        work_item(operation_id, tool.name),
        FakeLedger(reply(decision, operation_id, tool.name, arguments=arguments)),
    )


def _ok_data(disposition: ItemDisposition) -> dict[str, Any]:
    assert disposition.action is ItemAction.PUBLISH
    envelope = disposition.envelope
    assert envelope is not None
    assert envelope.ok, envelope.error
    assert envelope.data is not None
    return envelope.data


def _error(disposition: ItemDisposition) -> tuple[ErrorCategory, str]:
    envelope = disposition.envelope
    assert envelope is not None
    assert not envelope.ok
    assert envelope.error is not None
    return envelope.error.category, envelope.error.code


def test_every_catalog_tool_has_a_sample_pinned_to_its_version() -> None:
    from tests.executors.helpers import catalog

    assert set(SAMPLE_TOOLS) == set(catalog())
    for name in SAMPLE_TOOLS:
        implementation = sample_tool(name)
        assert implementation.name == name
        assert implementation.version == catalog()[name].version


@pytest.mark.parametrize(
    ("tool_name", "sample"), _valid_samples(), ids=lambda v: getattr(v, "stem", v)
)
def test_valid_calls_produce_schema_valid_output(
    tool_name: str, sample: Path, tmp_path: Path
) -> None:
    arguments = _arguments(tool_name, json.loads(sample.read_text())["arguments"])
    data = _ok_data(
        _run(
            sample_tool(tool_name),
            arguments,
            secrets={EMAIL_DB_SECRET: str(tmp_path / "mail.db")},
        )
    )
    assert CompiledSchema(contract(tool_name).output_schema).issues(data) == []


def test_there_are_samples_for_every_tool() -> None:
    assert {tool for tool, _ in _valid_samples()} == set(SAMPLE_TOOLS)


# ---------------------------------------------------------------- create_ticket


TICKET = {"title": "Refund requested for damaged item", "category": "refund", "priority": "high"}


def test_a_dry_run_previews_and_creates_nothing() -> None:
    data = _ok_data(_run(sample_tool("create_ticket"), {**TICKET, "dry_run": True}))
    assert data == {
        "ticket_id": None,
        "dry_run": True,
        "preview": {"title": TICKET["title"], "queue": "billing", "priority": "high"},
    }
    assert world().tickets == {}


def test_a_real_ticket_is_created_once_per_operation() -> None:
    tool = sample_tool("create_ticket")
    first = _run(tool, {**TICKET, "dry_run": False}, operation_id="op-t1")
    again = _run(tool, {**TICKET, "dry_run": False}, operation_id="op-t1")
    other = _run(tool, {**TICKET, "dry_run": False}, operation_id="op-t2")
    assert _ok_data(first)["ticket_id"] == _ok_data(again)["ticket_id"]
    assert again.reason == "already_applied"
    assert _ok_data(other)["ticket_id"] != _ok_data(first)["ticket_id"]
    assert len(world().tickets) == 2


def test_an_unknown_contact_is_not_found() -> None:
    arguments = {
        **TICKET,
        "dry_run": False,
        "contact": {"customer_id": "cus-9999", "channel": "email"},
    }
    assert _error(_run(sample_tool("create_ticket"), arguments)) == (
        ErrorCategory.NOT_FOUND,
        "CONTACT_NOT_FOUND",
    )


# --------------------------------------------------------------- request_refund


REFUND = {
    "order_id": "order-1001",
    "amount_cents": 10_000,
    "currency": "USD",
    "reason_code": "damaged",
}


def test_a_refund_is_booked_once_and_a_later_one_sees_the_change() -> None:
    tool = sample_tool("request_refund")
    first = _ok_data(_run(tool, REFUND, operation_id="op-r1"))
    assert first["status"] == "requested"
    assert world().orders["order-1001"].refunded_cents == 12_000
    again = _run(tool, REFUND, operation_id="op-r1")
    assert _ok_data(again) == first
    assert again.reason == "already_applied"
    # Approved while 10,000 were left; by execution time nothing is: stale.
    later = _run(tool, {**REFUND, "amount_cents": 5_000}, operation_id="op-r2")
    assert _error(later) == (ErrorCategory.CONFLICT, "ORDER_CHANGED")
    assert len(world().refunds) == 1


def test_a_refunded_order_cannot_be_refunded_again() -> None:
    arguments = {**REFUND, "order_id": "order-1003", "amount_cents": 100}
    assert _error(_run(sample_tool("request_refund"), arguments)) == (
        ErrorCategory.POLICY_DENIED,
        "ORDER_NOT_REFUNDABLE",
    )


def test_large_refunds_go_to_review() -> None:
    arguments = {**REFUND, "order_id": "order-1004", "amount_cents": 60_000}
    assert _ok_data(_run(sample_tool("request_refund"), arguments))["status"] == "pending_review"


def test_refund_reconciliation_reads_the_payment_backend() -> None:
    tool = sample_tool("request_refund")
    missing = _run(tool, REFUND, operation_id="op-r9", decision=LeaseDecision.RECONCILE)
    assert _error(missing) == (ErrorCategory.TRANSIENT, "NOT_APPLIED")
    booked = _ok_data(_run(tool, REFUND, operation_id="op-r9"))
    found = _run(tool, REFUND, operation_id="op-r9", decision=LeaseDecision.RECONCILE)
    assert _ok_data(found) == booked


# ----------------------------------------------------------- read_document_span


def test_a_span_is_the_exact_text_of_the_snapshot() -> None:
    arguments = {
        "document_id": "document-a",
        "snapshot_id": "snap-a-7",
        "start_char": 9,
        "end_char": 80,
    }
    data = _ok_data(_run(sample_tool("read_document_span"), arguments))
    assert data["text"] == world().snapshots["snap-a-7"].text[9:80]
    assert data["revision"] == "7"
    assert not data["truncated"]


def test_an_outdated_expected_revision_is_stale() -> None:
    arguments = {
        "document_id": "document-a",
        "expected_revision": "7",
        "start_char": 0,
        "end_char": 10,
    }
    assert _error(_run(sample_tool("read_document_span"), arguments)) == (
        ErrorCategory.CONFLICT,
        "REVISION_CHANGED",
    )


def test_a_span_past_the_end_is_out_of_range() -> None:
    arguments = {"document_id": "document-b", "start_char": 12_000, "end_char": 12_600}
    assert _error(_run(sample_tool("read_document_span"), arguments)) == (
        ErrorCategory.INVALID_INPUT,
        "SPAN_OUT_OF_RANGE",
    )


def test_a_snapshot_of_another_document_is_not_found() -> None:
    arguments = {
        "document_id": "document-a",
        "snapshot_id": "snap-b-8",
        "start_char": 0,
        "end_char": 5,
    }
    assert _error(_run(sample_tool("read_document_span"), arguments)) == (
        ErrorCategory.NOT_FOUND,
        "DOCUMENT_NOT_FOUND",
    )


# --------------------------------------------------- compare_document_snapshots


SEED_004 = {
    "source_id": "document-a",
    "before_snapshot_id": "snap-a-7",
    "after_snapshot_id": "snap-a-8",
}


def test_the_seed_004_comparison_reports_the_changed_sections() -> None:
    data = _ok_data(_run(sample_tool("compare_document_snapshots"), SEED_004))
    changed = {change["section"]: change for change in data["changes"]}
    assert set(changed) == {"refund-window", "exceptions", "partial-refunds"}
    assert "14 days" in changed["refund-window"]["before_text"]
    assert "30 days" in changed["refund-window"]["after_text"]
    assert changed["partial-refunds"]["before_text"] is None
    assert changed["partial-refunds"]["before_location"] is None
    assert data["status"] == "complete"
    assert data["missing_sections"] == []


def test_unknown_sections_make_a_partial_comparison() -> None:
    arguments = {**SEED_004, "sections": ["retention", "no-such-section"]}
    data = _ok_data(_run(sample_tool("compare_document_snapshots"), arguments))
    assert data["status"] == "partial"
    assert data["compared_sections"] == ["retention"]
    assert data["missing_sections"] == ["no-such-section"]
    assert data["changes"] == []


def test_snapshots_of_another_source_are_refused() -> None:
    arguments = {**SEED_004, "after_snapshot_id": "snap-b-8"}
    assert _error(_run(sample_tool("compare_document_snapshots"), arguments)) == (
        ErrorCategory.INVALID_INPUT,
        "SOURCE_MISMATCH",
    )


# ------------------------------------------------------------- search_documents


def test_search_ranks_filters_and_truncates() -> None:
    arguments = {"query": "refund window days", "source_types": ["policy", "faq"], "top_k": 2}
    data = _ok_data(_run(sample_tool("search_documents"), arguments))
    scores = [item["score"] for item in data["items"]]
    assert len(scores) == 2
    assert scores == sorted(scores, reverse=True)
    assert {item["source_id"] for item in data["items"]} <= {"document-a", "document-d"}
    assert data["truncated"] is True
    assert data["next_cursor"] is not None


def test_search_only_sees_requested_types_and_dates() -> None:
    tool = sample_tool("search_documents")
    incident = {"query": "payment outage", "source_types": ["incident"], "top_k": 5}
    assert {i["source_id"] for i in _ok_data(_run(tool, incident))["items"]} == {"document-c"}
    late = {**incident, "date_from": "2026-05-01"}
    assert _ok_data(_run(tool, late))["items"] == []


# ----------------------------------------------------------------- query_orders


def test_orders_are_filtered_sorted_and_limited() -> None:
    tool = sample_tool("query_orders")
    data = _ok_data(_run(tool, {"customer_id": "cus-0001", "sort": "amount_desc", "limit": 3}))
    amounts = [order["amount_cents"] for order in data["orders"]]
    assert len(amounts) == 3
    assert amounts == sorted(amounts, reverse=True)
    assert all(order["customer_id"] == "cus-0001" for order in data["orders"])
    assert data["truncated"] is True
    dated = _ok_data(
        _run(tool, {"placed_after": "2026-02-01", "placed_before": "2026-03-01", "limit": 100})
    )
    assert dated["orders"]
    assert all("2026-02" in order["placed_at"] for order in dated["orders"])
    assert dated["truncated"] is False


def test_orders_of_an_unknown_customer_are_not_found() -> None:
    assert _error(_run(sample_tool("query_orders"), {"customer_id": "cus-99999", "limit": 5})) == (
        ErrorCategory.NOT_FOUND,
        "CUSTOMER_NOT_FOUND",
    )


# -------------------------------------------------------------- delete_document


DELETE = {
    "document_id": "document-b",
    "expected_revision": "8",
    "reason": "Superseded by the 2026 manual",
}


def test_delete_rechecks_the_revision_and_is_idempotent() -> None:
    tool = sample_tool("delete_document")
    world().set_revision("document-b", "9")
    assert _error(_run(tool, DELETE, operation_id="op-d1")) == (
        ErrorCategory.CONFLICT,
        "REVISION_CHANGED",
    )
    assert "document-b" in world().documents
    world().set_revision("document-b", "8")
    first = _ok_data(_run(tool, DELETE, operation_id="op-d1"))
    assert first == {
        "document_id": "document-b",
        "deleted_revision": "8",
        "deleted_snapshot_count": 1,
    }
    assert "document-b" not in world().documents
    again = _run(tool, DELETE, operation_id="op-d1")
    assert _ok_data(again) == first
    assert again.reason == "already_applied"
    found = _run(tool, DELETE, operation_id="op-d1", decision=LeaseDecision.RECONCILE)
    assert _ok_data(found) == first


# ---------------------------------------------------------- send_customer_email


def test_opted_out_recipients_are_rejected_not_sent(tmp_path: Path) -> None:
    db = tmp_path / "mail.db"
    arguments = {
        "recipient_ids": ["cus-0001", "cus-0007"],
        "template": "order_shipped",
        "variables": {"order_id": "order-1001"},
    }
    data = _ok_data(
        _run(sample_tool("send_customer_email"), arguments, secrets={EMAIL_DB_SECRET: str(db)})
    )
    assert data["accepted_count"] == 1
    assert data["rejected_recipient_ids"] == ["cus-0007"]
    assert count_sends(db, "op-1") == 1


def test_an_unknown_recipient_stops_the_send_before_anything_is_sent(tmp_path: Path) -> None:
    db = tmp_path / "mail.db"
    arguments = {
        "recipient_ids": ["cus-0001", "cus-0999"],
        "template": "support_received",
        "variables": {"ticket_id": "TCK-1"},
    }
    assert _error(
        _run(sample_tool("send_customer_email"), arguments, secrets={EMAIL_DB_SECRET: str(db)})
    ) == (ErrorCategory.NOT_FOUND, "RECIPIENT_NOT_FOUND")
    assert count_sends(db) == 0


def test_a_template_without_its_variables_does_not_render(tmp_path: Path) -> None:
    arguments = {"recipient_ids": ["cus-0001"], "template": "order_shipped", "variables": {}}
    result = _run(
        sample_tool("send_customer_email"),
        arguments,
        secrets={EMAIL_DB_SECRET: str(tmp_path / "mail.db")},
    )
    assert _error(result) == (ErrorCategory.INVALID_INPUT, "TEMPLATE_RENDER_FAILED")
    assert count_sends(tmp_path / "mail.db") == 0


def test_the_email_executor_refuses_to_start_without_its_provider_secret() -> None:
    with pytest.raises(ExecutorConfigError, match="email_provider_db"):
        ItemProcessor(
            sample_tool("send_customer_email"), contract("send_customer_email"),
            ProcessorOptions("e"),
        )


def test_the_refund_preview_states_the_payout_against_the_order_and_books_nothing() -> None:
    tool = sample_tool("request_refund")
    assert tool.preview is not None
    arguments = {"order_id": "order-1001", "amount_cents": 5_000, "currency": "USD",
                 "reason_code": "damaged"}
    before = dict(world().refunds)
    effect = tool.preview(arguments, context("op-preview"))
    assert effect == {
        "summary": "refund 50.00 USD of order-1001 to customer cus-0001",
        "amount": "50.00 USD",
        "order_total": "120.00 USD",
        "refundable_before": "100.00 USD",
        "refundable_after": "50.00 USD",
        "order_status": "delivered",
        "reversible": False,
    }
    assert dict(world().refunds) == before  # a dry run: nothing booked
