"""Compensation, on SQLite and PostgreSQL: undoing a call that succeeded is a call of its
own (seeds 001 and 003), proposed by a person, checked and approved afresh, and linked
both ways; never automatic, and only where a contract names how.

A refund that succeeded is undone by `cancel_refund` (its contract's compensation),
with arguments taken from the refund's call and its result; a plan that partially
succeeded proposes undoing its succeeded steps as a plan of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ledger import Ledger, StorageConfig
from ledger.domain.errors import IllegalTransition, InvalidProposal
from ledger.domain.states import OperationState as S
from policy.catalog import FILES_CATALOG_DIR
from schemas import LeaseDecision, PlanProposal, PreviewReport, RuntimeContext
from tests.ledger.helpers import (
    ALICE,
    cli,
    make_ledger,
    previewed,
    proposal,
    result,
    search,
    use_storage,
)

FINANCE = ["finance_approver"]
REFUNDED = {"refund_id": "rf-0123456789abcdef", "order_id": "order-1004",
            "amount_cents": 10_000, "currency": "USD", "status": "requested"}


@pytest.fixture
def ledger(storage: StorageConfig) -> Iterator[Ledger]:
    ledger = make_ledger(storage)
    yield ledger
    ledger.close()


def _run(ledger: Ledger, operation_id: str, tool: str, data: dict[str, Any] | None,
         ) -> dict[str, Any]:
    """Play the executor: lease, then the result (success with `data`, else a failure);
    returns the arguments the lease handed out."""
    lease = ledger.lease(operation_id, executor="exec-1", tool=tool)
    assert lease.decision is LeaseDecision.EXECUTE, lease
    error = None if data is not None else {"code": "PAYMENTS_UNAVAILABLE",
                                           "category": "TRANSIENT", "message": "down"}
    ledger.record_results([result(operation_id, lease.fencing_token, ok=data is not None,
                                  data=data, error=error, tool=tool)])
    return dict(lease.arguments or {})


def _approve(ledger: Ledger, operation_id: str, approver: str = "fin-1") -> None:
    approval = ledger.get(operation_id).approval
    assert approval is not None
    shown = None
    if ledger.get(operation_id).preview_requested:
        shown = previewed(ledger, operation_id, PreviewReport(effect={"amount": "100.00 USD"}))
    ledger.approve(operation_id, approver=approver, approver_roles=FINANCE,
                   proposal_hash=approval.effect_preview["proposal_hash"], preview_hash=shown)


def _refunded(ledger: Ledger, operation_id: str = "refund-1") -> str:
    ledger.submit(proposal("request_refund", {"order_id": "order-1004", "amount_cents": 10_000,
                                              "currency": "USD", "reason_code": "damaged"},
                           operation_id=operation_id), ALICE)
    _approve(ledger, operation_id)
    _run(ledger, operation_id, "request_refund", REFUNDED)
    assert ledger.get(operation_id).state is S.SUCCEEDED
    return operation_id


def test_a_succeeded_refund_is_undone_by_its_own_approved_operation_linked_both_ways(
    ledger: Ledger,
) -> None:
    refund = _refunded(ledger)
    submission = ledger.compensate(refund, by="operator:olga", reason="refunded by mistake")
    assert (submission.operation_id, submission.created) == ("refund-1-c", True)
    undo = ledger.get("refund-1-c")
    # Its own call: the compensating tool, arguments from the refund's call and result,
    # checked and waiting for its own approver; nothing ran on the refund's approval.
    assert undo.tool == "cancel_refund"
    assert undo.arguments == {"refund_id": REFUNDED["refund_id"], "order_id": "order-1004"}
    assert undo.state is S.AWAITING_APPROVAL
    assert (undo.compensates, undo.proposed_by) == ("refund-1", "operator:olga")
    original = ledger.get(refund)
    assert original.compensated_by == "refund-1-c"
    assert type(ledger.history(refund)[-1]).__name__ == "CompensationProposed"
    assert original.state is S.SUCCEEDED  # it happened: its outcome stands
    # Asked again: the same compensation, nothing new.
    again = ledger.compensate(refund, by="operator:olga", reason="refunded by mistake")
    assert (again.operation_id, again.created) == ("refund-1-c", False)
    _approve(ledger, "refund-1-c", approver="fin-2")
    arguments = _run(ledger, "refund-1-c", "cancel_refund",
                     {"refund_id": REFUNDED["refund_id"], "cancelled": True})
    assert arguments["refund_id"] == REFUNDED["refund_id"]
    assert ledger.get("refund-1-c").state is S.SUCCEEDED
    ledger.refresh()
    report = ledger.verify()
    assert report.ok, [finding.describe() for finding in report.findings]


def test_only_a_succeeded_call_with_a_compensation_is_undone_and_never_by_itself(
    ledger: Ledger,
) -> None:
    ledger.submit(proposal("request_refund", {"order_id": "order-1004", "amount_cents": 500,
                                              "currency": "USD", "reason_code": "damaged"},
                           operation_id="refund-failed"), ALICE)
    _approve(ledger, "refund-failed")
    _run(ledger, "refund-failed", "request_refund", None)
    assert ledger.get("refund-failed").state is S.FAILED
    with pytest.raises(IllegalTransition, match="only a call that succeeded"):
        ledger.compensate("refund-failed", by="operator:olga", reason="nothing to undo")
    ledger.submit(search("read-1"), ALICE)
    _run(ledger, "read-1", "search_documents",
         {"items": [], "truncated": False, "next_cursor": None})
    with pytest.raises(InvalidProposal, match="names no compensation"):
        ledger.compensate("read-1", by="operator:olga", reason="undo a read?")
    refund = _refunded(ledger, "refund-2")
    with pytest.raises(InvalidProposal, match="needs a reason"):
        ledger.compensate(refund, by="operator:olga", reason=" ")
    # Nothing of the refused attempts was stored, and nothing ever compensates by itself.
    assert not ledger.runner.tables.stored_ids(["refund-failed-c", "read-1-c", "refund-2-c"])


FILES = RuntimeContext(principal="alice", tenant="acme",
                       capabilities=frozenset({"files:write", "files:share", "notify:send"}))


def test_a_partially_succeeded_plan_proposes_undoing_its_succeeded_steps_as_a_plan(
    storage: StorageConfig,
) -> None:
    ledger = make_ledger(storage, contracts_dir=FILES_CATALOG_DIR, resolver=None, rules={})
    try:
        status = ledger.propose_plan(PlanProposal.model_validate({
            "plan_id": "share", "conversation_id": "c-1", "requested_by_user_id": "alice",
            "steps": [
                {"step": "file", "operation_id": "op-file", "tool_name": "write_file",
                 "arguments": {"path": "/shared/q3.md", "content": "Q3"}},
                {"step": "grant", "operation_id": "op-grant", "tool_name": "grant_access",
                 "arguments": {"file_id": {"$result": {"step": "file", "pointer": "/file_id"}},
                               "person": "bob"}, "depends_on": ["file"]},
                {"step": "tell", "operation_id": "op-tell", "tool_name": "notify_user",
                 "arguments": {"person": "bob", "message": "shared"}, "depends_on": ["grant"]},
            ],
        }), FILES, "h1")
        plan_id = ledger.plans.ledger_id("h1", "share")
        assert status.plan_hash is not None
        ledger.approve_plan(plan_id, approver="carol", approver_roles=["files_admin"],
                            plan_hash=status.plan_hash)
        _run(ledger, "h1/op-file", "write_file",
             {"path": "/shared/q3.md", "file_id": "file-0123456789ab", "bytes": 2})
        ledger.advance_plan(plan_id)
        _run(ledger, "h1/op-grant", "grant_access", {"grant_id": "grant-aaaaaaaaaaaa"})
        ledger.advance_plan(plan_id)
        _run(ledger, "h1/op-tell", "notify_user", None)
        assert ledger.advance_plan(plan_id).state == "partially_succeeded"

        undo = ledger.compensate_plan(plan_id, by="operator:olga", reason="shared too early")
        assert (undo.plan_id, undo.state) == ("h1/share-undo", "awaiting_approval")
        # Reverse order: the share is revoked before the file is deleted; the failed
        # notification has nothing to undo, and a message cannot be unsent anyway.
        assert [(row.step, row.tool, row.depends_on) for row in undo.steps] == [
            ("undo-grant", "revoke_access", ()),
            ("undo-file", "delete_file", ("undo-grant",)),
        ]
        assert undo.plan_hash is not None
        ledger.approve_plan("h1/share-undo", approver="carol",
                            approver_roles=["files_admin"], plan_hash=undo.plan_hash)
        revoked = _run(ledger, "h1/op-grant-c", "revoke_access", {"undone": True})
        assert revoked == {"grant_id": "grant-aaaaaaaaaaaa"}
        ledger.advance_plan("h1/share-undo")
        deleted = _run(ledger, "h1/op-file-c", "delete_file", {"undone": True})
        assert deleted == {"path": "/shared/q3.md"}
        assert ledger.advance_plan("h1/share-undo").state == "succeeded"
        # Linked both ways, step by step, and plan to plan.
        assert ledger.get("h1/op-grant").compensated_by == "h1/op-grant-c"
        assert ledger.get("h1/op-grant-c").compensates == "h1/op-grant"
        assert ledger.get("h1/op-file").compensated_by == "h1/op-file-c"
        assert ledger.plans.get("h1/share-undo").compensates == plan_id
        ledger.refresh()
        report = ledger.verify()
        assert report.ok, [finding.describe() for finding in report.findings]
    finally:
        ledger.close()


def _partially_succeeded(ledger: Ledger, plan_id: str) -> None:
    ledger.propose_plan(PlanProposal.model_validate({
        "plan_id": plan_id, "conversation_id": "c-1", "requested_by_user_id": "alice",
        "steps": [
            {"step": "folder", "operation_id": f"{plan_id}-folder", "tool_name": "create_folder",
             "arguments": {"path": "/q4"}},
            {"step": "tell", "operation_id": f"{plan_id}-tell", "tool_name": "notify_user",
             "arguments": {"person": "bob", "message": "q4"}, "depends_on": ["folder"]},
        ],
    }), FILES, "h1")
    _run(ledger, f"h1/{plan_id}-folder", "create_folder", {"path": "/q4", "created": True})
    ledger.advance_plan(f"h1/{plan_id}")
    _run(ledger, f"h1/{plan_id}-tell", "notify_user", None)
    assert ledger.advance_plan(f"h1/{plan_id}").state == "partially_succeeded"


def test_the_command_line_retries_and_undoes_a_plan_and_says_who_did(
    storage: StorageConfig, tmp_path: Any, monkeypatch: Any, capsys: Any
) -> None:
    ledger = make_ledger(storage, contracts_dir=FILES_CATALOG_DIR, resolver=None, rules={})
    try:
        _partially_succeeded(ledger, "q4")
    finally:
        ledger.close()
    use_storage(monkeypatch, tmp_path, storage)
    monkeypatch.setenv("OPLEDGER_CONTRACTS_DIR", str(FILES_CATALOG_DIR))
    code, out, err = cli(capsys, "plans", "show", "h1/q4")
    assert code == 0, err
    assert "partially succeeded" in out and "a retry runs it again" in out
    assert "undone by remove_folder" in out
    refused, _, err = cli(capsys, "plans", "compensate", "h1/q4", "--as", "olga",
                          "--reason", "wrong quarter")
    assert refused == 64 and "--break-glass" in err  # never without saying so
    code, out, err = cli(capsys, "plans", "compensate", "h1/q4", "--break-glass", "--as",
                         "olga", "--reason", "wrong quarter")
    assert code == 0, err
    assert "Plan h1/q4-undo: awaiting approval" in out
    assert "proposed by break-glass:olga to undo plan h1/q4" in out
    assert "remove_folder" in out
    code, out, err = cli(capsys, "plans", "retry", "h1/q4", "--break-glass", "--as", "olga",
                         "--reason", "chat is back")
    assert code == 0, err
    assert "Plan h1/q4: running" in out


def test_a_failed_undoing_step_is_retried_and_never_undoes_twice(storage: StorageConfig) -> None:
    """A retry of a compensation plan runs its failed undoing step again as a new
    operation that names what it undoes; an undoing step whose call another
    compensation undid already is skipped, never run a second time."""
    ledger = make_ledger(storage, contracts_dir=FILES_CATALOG_DIR, resolver=None, rules={})
    try:
        _partially_succeeded(ledger, "q4")
        undo = ledger.compensate_plan("h1/q4", by="operator:olga", reason="wrong quarter")
        assert undo.plan_hash is not None
        ledger.approve_plan("h1/q4-undo", approver="carol", approver_roles=["files_admin"],
                            plan_hash=undo.plan_hash)
        _run(ledger, "h1/q4-folder-c", "remove_folder", None)
        assert ledger.advance_plan("h1/q4-undo").state == "failed"
        retried = ledger.retry_plan("h1/q4-undo", by="operator:olga", reason="drive is back")
        assert [(row.operation_id, row.state) for row in retried.steps] == [
            ("h1/q4-folder-c-p1", "ready")
        ]
        again = ledger.get("h1/q4-folder-c-p1")
        assert again.compensates == "h1/q4-folder"
        # The undone call keeps naming its first compensation; nothing else is appended.
        assert ledger.get("h1/q4-folder").compensated_by == "h1/q4-folder-c"
        _run(ledger, "h1/q4-folder-c-p1", "remove_folder", {"undone": True})
        assert ledger.advance_plan("h1/q4-undo").state == "succeeded"

        # Undone as a plan awaiting approval, meanwhile one by one: once approved, the
        # plan's step is skipped, and the folder is removed once.
        _partially_succeeded(ledger, "q5")
        plan = ledger.compensate_plan("h1/q5", by="operator:olga", reason="wrong")
        assert plan.plan_hash is not None
        single = ledger.compensate("h1/q5-folder", by="operator:olga", reason="wrong")
        assert single.operation_id == "h1/q5-folder-c"
        status = ledger.approve_plan("h1/q5-undo", approver="carol",
                                     approver_roles=["files_admin"], plan_hash=plan.plan_hash)
        assert (status.state, status.steps[0].state) == ("failed", "skipped")
        assert status.steps[0].skipped_because is not None
        assert "was taken" in status.steps[0].skipped_because
        assert ledger.get("h1/q5-folder-c").plan is None  # the operator's, not adopted
        assert ledger.get("h1/q5-folder").compensated_by == "h1/q5-folder-c"
        ledger.refresh()
        report = ledger.verify()
        assert report.ok, [finding.describe() for finding in report.findings]
    finally:
        ledger.close()
