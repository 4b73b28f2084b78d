"""Plans in the ledger, on SQLite and PostgreSQL: checked whole, approved whole, run in order.

Seed 001's examples with the file-sharing sample tools (`policy/catalog/files`):
a folder then a file in it; a file, a share and a notification whose
notification fails (partially succeeded, retried without re-running what
succeeded); and each way a plan must be refused, with a finding that names
its step. Executors are played by the test through the ledger's own lease and
result API, as in the other ledger tests; `tests/e2e/test_plans.py` runs the
same over NATS with real executor processes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from ledger import Ledger, StorageConfig
from ledger.domain.errors import ApprovalRefused, OperationConflict
from ledger.domain.plan import PlanState
from ledger.domain.states import OperationState
from policy.catalog import FILES_CATALOG_DIR
from schemas import LeaseDecision, PlanProposal, PlanStatus, RuntimeContext, ledger_operation_id
from tests.ledger.helpers import make_ledger, proposal, result

HOST = "h1"
ALICE = RuntimeContext(
    principal="alice",
    tenant="acme",
    capabilities=frozenset({"files:write", "files:share", "notify:send"}),
)
ADMINS = frozenset({"files_admin"})


@pytest.fixture
def ledger(storage: StorageConfig) -> Iterator[Ledger]:
    ledger = make_ledger(storage, contracts_dir=FILES_CATALOG_DIR, resolver=None, rules={})
    yield ledger
    ledger.close()


def plan(plan_id: str, *steps: dict[str, Any]) -> PlanProposal:
    return PlanProposal.model_validate(
        {"plan_id": plan_id, "conversation_id": "c-1", "requested_by_user_id": "alice",
         "steps": list(steps)}
    )


def step(name: str, tool: str, arguments: dict[str, Any], *depends_on: str,
         operation_id: str | None = None) -> dict[str, Any]:
    return {"step": name, "operation_id": operation_id or f"op-{name}", "tool_name": tool,
            "arguments": arguments, "depends_on": list(depends_on)}


def ref(step_name: str, pointer: str) -> dict[str, Any]:
    return {"$result": {"step": step_name, "pointer": pointer}}


FOLDER_THEN_FILE = (
    step("create-folder", "create_folder", {"path": "/reports/2026"}),
    step("write-summary", "write_file",
         {"path": "/reports/2026/summary.md", "content": "# Summary"}, "create-folder"),
)


def share_plan(plan_id: str = "share-1") -> PlanProposal:
    return plan(
        plan_id,
        step("create-file", "write_file", {"path": "/shared/q3.md", "content": "Q3"}),
        step("grant", "grant_access", {"file_id": ref("create-file", "/file_id"),
                                       "person": "bob"}, "create-file"),
        step("notify", "notify_user", {"person": "bob", "message": "Q3 is shared"}, "grant"),
    )


OUTPUTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "create_folder": lambda args: {"path": args["path"], "created": True},
    "write_file": lambda args: {"path": args["path"], "file_id": "file-0123456789ab",
                                "bytes": len(args["content"])},
    "grant_access": lambda args: {"grant_id": "grant-aaaaaaaaaaaa"},
    "notify_user": lambda args: {"notified": True},
}


def run(ledger: Ledger, operation_id: str, *, ok: bool = True) -> dict[str, Any]:
    """Play the executor for one released step: lease, then its result; returns the
    arguments the executor was given (what the ledger put in)."""
    operation = ledger.get(operation_id)
    lease = ledger.lease(operation_id, executor="exec-1", tool=operation.tool)
    assert lease.decision is LeaseDecision.EXECUTE, lease
    arguments = dict(lease.arguments or {})
    data = OUTPUTS[operation.tool](arguments) if ok else None
    error = None if ok else {"code": "CHAT_UNAVAILABLE", "category": "TRANSIENT",
                             "message": "chat is down", "retryable": False}
    ledger.record_results([result(operation_id, lease.fencing_token, ok=ok, data=data,
                                  error=error, tool=operation.tool)])
    return arguments


def step_ids(status: PlanStatus) -> dict[str, str]:
    return {row.step: ledger_operation_id(HOST, row.operation_id) for row in status.steps}


def states(status: PlanStatus) -> dict[str, str]:
    return {row.step: row.state for row in status.steps}


def advance(ledger: Ledger, plan_id: str) -> PlanStatus:
    ledger.advance_plan(ledger.plans.ledger_id(HOST, plan_id))
    return ledger.plan_status(plan_id, host=HOST)


def test_the_order_holds_a_file_is_written_only_after_its_folder(ledger: Ledger) -> None:
    status = ledger.propose_plan(plan("reports", *FOLDER_THEN_FILE), ALICE, HOST)
    assert (status.state, status.final) == ("running", False)
    # Only the folder is released: the write waits for it.
    assert states(status) == {"create-folder": "ready", "write-summary": "waiting"}
    ids = step_ids(status)
    with pytest.raises(Exception, match="no such operation"):
        ledger.get(ids["write-summary"])
    run(ledger, ids["create-folder"])
    status = advance(ledger, "reports")
    assert states(status) == {"create-folder": "succeeded", "write-summary": "ready"}
    run(ledger, ids["write-summary"])
    status = advance(ledger, "reports")
    assert (status.state, status.final) == ("succeeded", True)
    assert ledger.get(ids["write-summary"]).plan == ledger.plans.ledger_id(HOST, "reports")


def test_a_partial_success_is_recorded_step_by_step_and_a_retry_runs_only_what_failed(
    ledger: Ledger,
) -> None:
    status = ledger.propose_plan(share_plan(), ALICE, HOST)
    # grant_access needs approval: the whole plan waits for one, and nothing runs.
    assert status.state == "awaiting_approval"
    assert states(status) == {"create-file": "waiting", "grant": "waiting", "notify": "waiting"}
    assert status.plan_hash is not None
    plan_id = ledger.plans.ledger_id(HOST, "share-1")
    status = ledger.approve_plan(plan_id, approver="carol", approver_roles=ADMINS,
                                 plan_hash=status.plan_hash)
    assert status.state == "running"
    ids = step_ids(ledger.plan_status("share-1", host=HOST))
    run(ledger, ids["create-file"])
    advance(ledger, "share-1")
    # The reference was put in from the write's result; the plan's approval covers the
    # grant, so it is ready at once without an approval of its own.
    granted = run(ledger, ids["grant"])
    assert granted["file_id"] == "file-0123456789ab"
    assert ledger.get(ids["grant"]).approval is None
    advance(ledger, "share-1")
    run(ledger, ids["notify"], ok=False)
    status = advance(ledger, "share-1")
    assert (status.state, status.final) == ("partially_succeeded", True)
    table = {row.step: (row.state, row.retry_needed, row.compensation) for row in status.steps}
    assert table == {
        "create-file": ("succeeded", False, "delete_file"),
        "grant": ("succeeded", False, "revoke_access"),
        "notify": ("failed", True, None),
    }

    status = ledger.retry_plan(plan_id, by="operator:olga", reason="chat is back")
    assert status.state == "running"
    rows = {row.step: row for row in ledger.plan_status("share-1", host=HOST).steps}
    # Only the failed step runs again, as a new operation; the others keep theirs.
    assert rows["notify"].operation_id == "op-notify-p1"
    assert rows["notify"].state == "ready"
    assert rows["create-file"].operation_id == "op-create-file"
    run(ledger, ledger_operation_id(HOST, "op-notify-p1"))
    status = advance(ledger, "share-1")
    assert status.state == "succeeded"
    for name in ("create-file", "grant"):
        # Each succeeded step ran exactly once: one lease, one result.
        kinds = [type(e).__name__ for e in ledger.history(ids[name])]
        assert kinds.count("LeaseClaimed") == 1 and kinds.count("Succeeded") == 1


def test_a_failed_step_skips_its_dependents_and_independent_branches_go_on(
    ledger: Ledger,
) -> None:
    status = ledger.propose_plan(plan(
        "branches",
        step("folder-a", "create_folder", {"path": "/a"}),
        step("file-a", "write_file", {"path": "/a/x.md", "content": "x"}, "folder-a"),
        step("note-a", "notify_user", {"person": "bob", "message": "a"}, "file-a"),
        step("folder-b", "create_folder", {"path": "/b"}),
        step("file-b", "write_file", {"path": "/b/y.md", "content": "y"}, "folder-b"),
    ), ALICE, HOST)
    ids = step_ids(status)
    run(ledger, ids["folder-a"], ok=False)
    run(ledger, ids["folder-b"])
    status = advance(ledger, "branches")
    assert states(status) == {"folder-a": "failed", "file-a": "skipped", "note-a": "skipped",
                              "folder-b": "succeeded", "file-b": "ready"}
    rows = {row.step: row for row in status.steps}
    assert rows["file-a"].skipped_because == "folder-a ended failed"
    assert rows["note-a"].skipped_because == "file-a was skipped"
    run(ledger, ids["file-b"])
    status = advance(ledger, "branches")
    assert status.state == "partially_succeeded"


def finding_codes(status: PlanStatus) -> list[tuple[str, str, str]]:
    return [(i["code"], i["details"]["step"], i["path"]) for i in status.issues]


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        pytest.param(
            [step("a", "create_folder", {"path": "/a"}, "b"),
             step("b", "create_folder", {"path": "/b"}, "a")],
            [("plan_cycle", "a", "/steps/0/depends_on")],
            id="cycle",
        ),
        pytest.param(
            [step("a", "create_folder", {"path": "/a"}, "missing")],
            [("plan_unknown_dependency", "a", "/steps/0/depends_on/0")],
            id="dangling-dependency",
        ),
        pytest.param(
            [step("one", "write_file", {"path": "/r/s.md", "content": "1"}),
             step("two", "write_file", {"path": "/r/s.md", "content": "2"})],
            [("plan_parallel_writes", "two", "/steps/1")],
            id="parallel-writes-to-one-target",
        ),
        pytest.param(
            [step("w", "write_file", {"path": "/r/s.md", "content": "1"}),
             step("n", "notify_user", {"person": "bob", "message": ref("w", "/bytes")}, "w")],
            [("plan_result_field_not_allowed", "n", "/steps/1/arguments/message")],
            id="result-field-not-allowed-to-flow",
        ),
        pytest.param(
            [step("w", "write_file", {"path": "/r/s.md", "content": "1"}),
             step("g", "grant_access", {"file_id": ref("w", "/file_id"), "person": "bob"})],
            [("plan_reference_not_a_dependency", "g", "/steps/1/arguments/file_id")],
            id="reference-without-dependency",
        ),
        pytest.param(
            [step("f", "create_folder", {"path": "Not A Path"})],
            [("format", "f", "/steps/0/arguments/path")],
            id="a-step-fails-its-own-check",
        ),
    ],
)
def test_a_faulty_plan_is_refused_whole_with_findings_that_name_the_step(
    ledger: Ledger, steps: list[dict[str, Any]], expected: list[tuple[str, str, str]]
) -> None:
    status = ledger.propose_plan(plan("bad", *steps), ALICE, HOST)
    assert (status.state, status.final) == ("rejected", True)
    assert finding_codes(status) == expected
    # Nothing of it runs: no step became an operation.
    for one in steps:
        assert not ledger.runner.tables.stored_ids([ledger_operation_id(HOST, one["operation_id"])])


def test_parallel_writes_are_fine_once_ordered(ledger: Ledger) -> None:
    status = ledger.propose_plan(plan(
        "ordered",
        step("one", "write_file", {"path": "/r/s.md", "content": "1"}),
        step("two", "write_file", {"path": "/r/s.md", "content": "2"}, "one"),
    ), ALICE, HOST)
    assert status.state == "running"


def test_an_approval_of_one_plan_never_approves_another(ledger: Ledger) -> None:
    approved = ledger.propose_plan(share_plan("plan-a"), ALICE, HOST)
    assert approved.plan_hash is not None
    changed = share_plan("plan-b").model_dump(mode="json")
    changed["steps"][1]["arguments"]["person"] = "mallory"
    reordered = share_plan("plan-c").model_dump(mode="json")
    reordered["steps"] = [reordered["steps"][1], reordered["steps"][0], reordered["steps"][2]]
    added = share_plan("plan-d").model_dump(mode="json")
    added["steps"].append(step("extra", "notify_user", {"person": "eve", "message": "hi"}))
    for plan_id, body in (("plan-b", changed), ("plan-c", reordered), ("plan-d", added)):
        body["steps"] = [
            {**one, "operation_id": f"{plan_id}-{one['step']}"} for one in body["steps"]
        ]
        other = ledger.propose_plan(PlanProposal.model_validate(body), ALICE, HOST)
        assert other.state == "awaiting_approval"
        assert other.plan_hash != approved.plan_hash
        with pytest.raises(ApprovalRefused, match="proposal_hash_mismatch"):
            ledger.approve_plan(ledger.plans.ledger_id(HOST, plan_id), approver="carol",
                                approver_roles=ADMINS, plan_hash=approved.plan_hash)
        assert ledger.plan_status(plan_id, host=HOST).state == "awaiting_approval"


def test_the_requester_cannot_approve_their_own_plan_and_a_denial_runs_nothing(
    ledger: Ledger,
) -> None:
    status = ledger.propose_plan(share_plan(), ALICE, HOST)
    assert status.plan_hash is not None
    plan_id = ledger.plans.ledger_id(HOST, "share-1")
    with pytest.raises(ApprovalRefused, match="requester_cannot_approve"):
        ledger.approve_plan(plan_id, approver="Alice", approver_roles=ADMINS,
                            plan_hash=status.plan_hash)
    with pytest.raises(ApprovalRefused, match="not_an_approver"):
        ledger.approve_plan(plan_id, approver="dave", approver_roles=frozenset({"intern"}),
                            plan_hash=status.plan_hash)
    status = ledger.deny_plan(plan_id, approver="carol", approver_roles=ADMINS, reason="no")
    assert (status.state, status.final) == ("approval_denied", True)
    assert all(row.state == "waiting" for row in status.steps)


def test_the_same_plan_again_converges_and_another_plan_under_its_id_conflicts(
    ledger: Ledger,
) -> None:
    first = ledger.propose_plan(plan("same", *FOLDER_THEN_FILE), ALICE, HOST)
    again = ledger.propose_plan(plan("same", *FOLDER_THEN_FILE), ALICE, HOST)
    assert again == first
    with pytest.raises(OperationConflict):
        ledger.propose_plan(plan("same", FOLDER_THEN_FILE[0]), ALICE, HOST)


def test_a_step_id_the_host_used_already_is_refused(ledger: Ledger) -> None:
    ledger.propose_plan(plan("first", FOLDER_THEN_FILE[0]), ALICE, HOST)
    status = ledger.propose_plan(plan("second", FOLDER_THEN_FILE[0]), ALICE, HOST)
    assert finding_codes(status) == [
        ("plan_operation_id_taken", "create-folder", "/steps/0/operation_id")
    ]


def test_cancelling_a_plan_skips_what_has_not_started_and_stops_what_runs(
    ledger: Ledger,
) -> None:
    status = ledger.propose_plan(plan("stop", *FOLDER_THEN_FILE), ALICE, HOST)
    ids = step_ids(status)
    ledger.lease(ids["create-folder"], executor="exec-1", tool="create_folder")
    status = ledger.cancel_plan(ledger.plans.ledger_id(HOST, "stop"), by="operator:olga")
    assert status.cancel_requested
    assert states(status) == {"create-folder": "cancel_requested", "write-summary": "skipped"}


def test_a_plan_approval_is_recorded_in_the_events_and_verify_passes(ledger: Ledger) -> None:
    status = ledger.propose_plan(share_plan(), ALICE, HOST)
    assert status.plan_hash is not None
    plan_id = ledger.plans.ledger_id(HOST, "share-1")
    ledger.approve_plan(plan_id, approver="carol", approver_roles=ADMINS,
                        plan_hash=status.plan_hash)
    kinds = [type(e).__name__ for e in ledger.history(plan_id)]
    assert kinds[:5] == ["PlanProposed", "PlanValidated", "PlanApprovalRequested",
                         "PlanApprovalGranted", "PlanStarted"]
    ledger.refresh()
    report = ledger.verify()
    assert report.ok, [f.describe() for f in report.findings]
    plan_state = ledger.plans.get(plan_id).state
    assert plan_state is PlanState.RUNNING
    step_op = ledger.get(ledger_operation_id(HOST, "op-create-file"))
    assert step_op.state is OperationState.READY


def test_an_unapproved_plan_expires_and_none_of_it_runs(storage: StorageConfig) -> None:
    now = [datetime.now(UTC)]
    ledger = make_ledger(storage, contracts_dir=FILES_CATALOG_DIR, resolver=None, rules={},
                         clock=lambda: now[0])
    try:
        status = ledger.propose_plan(share_plan("late"), ALICE, HOST)
        assert status.state == "awaiting_approval" and status.plan_hash is not None
        plan_id = ledger.plans.ledger_id(HOST, "late")
        now[0] += timedelta(hours=2)  # grant_access's approval expires after an hour
        assert ledger.advance_plan(plan_id).state == "approval_expired"
        with pytest.raises(ApprovalRefused, match="approval_consumed"):
            ledger.approve_plan(plan_id, approver="carol", approver_roles=ADMINS,
                                plan_hash=status.plan_hash)
        assert all(row.state == "waiting" for row in ledger.plan_status("late", host=HOST).steps)
    finally:
        ledger.close()


def test_a_step_released_after_the_plan_approval_lapsed_asks_for_its_own(
    storage: StorageConfig,
) -> None:
    """The plan's approval holds as long as a single call's would: a step released
    after it lapsed (its dependency ran late) waits for an approval of its own."""
    now = [datetime.now(UTC)]
    ledger = make_ledger(storage, contracts_dir=FILES_CATALOG_DIR, resolver=None, rules={},
                         clock=lambda: now[0])
    try:
        status = ledger.propose_plan(share_plan("slow"), ALICE, HOST)
        assert status.plan_hash is not None
        plan_id = ledger.plans.ledger_id(HOST, "slow")
        ledger.approve_plan(plan_id, approver="carol", approver_roles=ADMINS,
                            plan_hash=status.plan_hash)
        ids = step_ids(ledger.plan_status("slow", host=HOST))
        now[0] += timedelta(hours=2)  # grant_access's approval holds for an hour
        run(ledger, ids["create-file"])
        assert states(advance(ledger, "slow"))["grant"] == "awaiting_approval"
        grant = ledger.get(ids["grant"])
        assert grant.approval is not None
        lease = ledger.lease(ids["grant"], executor="exec-1", tool="grant_access")
        assert lease.decision is not LeaseDecision.EXECUTE
    finally:
        ledger.close()


def test_a_step_whose_operation_id_was_taken_meanwhile_is_skipped_not_adopted(
    ledger: Ledger,
) -> None:
    """While the plan waits for its approval, the host uses a step's operation ID for a
    call of its own: the approval still counts, the step is skipped (its operation is
    not the plan's), and the host's call is left as it is."""
    status = ledger.propose_plan(share_plan("taken"), ALICE, HOST)
    assert status.plan_hash is not None
    mine = proposal("write_file", {"path": "/shared/other.md", "content": "mine"},
                    operation_id="op-create-file")
    assert ledger.submit(mine, ALICE, HOST).created
    status = ledger.approve_plan(ledger.plans.ledger_id(HOST, "taken"), approver="carol",
                                 approver_roles=ADMINS, plan_hash=status.plan_hash)
    assert (status.state, states(status)) == (
        "failed", {"create-file": "skipped", "grant": "skipped", "notify": "skipped"}
    )
    rows = {row.step: row for row in status.steps}
    assert "op-create-file was taken" in (rows["create-file"].skipped_because or "")
    theirs = ledger.get(ledger_operation_id(HOST, "op-create-file"))
    assert (theirs.plan, theirs.arguments) == (None, {"path": "/shared/other.md",
                                                      "content": "mine"})


def test_a_step_checked_against_another_contract_version_asks_for_its_own_approval(
    storage: StorageConfig, tmp_path: Path
) -> None:
    """The catalog changed between the plan's approval and a step's release: the step
    is checked against the new contract, which the plan's approvers never saw."""
    catalog = tmp_path / "catalog"
    shutil.copytree(FILES_CATALOG_DIR, catalog)
    ledger = make_ledger(storage, contracts_dir=catalog, resolver=None, rules={})
    try:
        status = ledger.propose_plan(share_plan("versions"), ALICE, HOST)
        assert status.plan_hash is not None
        plan_id = ledger.plans.ledger_id(HOST, "versions")
        ledger.approve_plan(plan_id, approver="carol", approver_roles=ADMINS,
                            plan_hash=status.plan_hash)
        ids = step_ids(ledger.plan_status("versions", host=HOST))
        run(ledger, ids["create-file"])
    finally:
        ledger.close()
    contract = catalog / "grant_access.yaml"
    contract.write_text(contract.read_text().replace("version: 1.0.0", "version: 2.0.0", 1))
    ledger = make_ledger(storage, contracts_dir=catalog, resolver=None, rules={})
    try:
        assert states(advance(ledger, "versions"))["grant"] == "awaiting_approval"
        assert ledger.get(ids["grant"]).tool_version == "2.0.0"
    finally:
        ledger.close()


def test_a_refused_plan_keeps_only_what_is_small(ledger: Ledger) -> None:
    """A host cannot fill the ledger with plans that never run: of a refused plan only
    its shape is kept once it is large (as a refused call keeps at most 16 KiB)."""
    big = "x" * 60_000
    steps = [step(f"w{i}", "write_file", {"path": f"/r/f{i}.md", "content": big},
                  f"w{(i + 1) % 4}") for i in range(4)]  # a cycle: refused
    status = ledger.propose_plan(plan("huge", *steps), ALICE, HOST)
    assert status.state == "rejected"
    assert [i["code"] for i in status.issues] == ["plan_cycle"]
    (proposed,) = [e for e in ledger.history(ledger.plans.ledger_id(HOST, "huge"))
                   if type(e).__name__ == "PlanProposed"]
    stored = proposed.plan
    assert all(one["arguments"] is None for one in stored["steps"])
    assert {one["arguments_omitted"]["reason"] for one in stored["steps"]} == {"too_large"}
    assert len(str(stored)) < 16 * 1024
    # The same refused plan again is recognised (its fingerprint is of all of it).
    assert ledger.propose_plan(plan("huge", *steps), ALICE, HOST).state == "rejected"
    # A small refused plan is kept whole, for whoever repairs it.
    small = ledger.propose_plan(plan("small", step("a", "create_folder", {"path": "/a"}, "a")),
                                ALICE, HOST)
    assert small.state == "rejected"
    (kept,) = [e for e in ledger.history(ledger.plans.ledger_id(HOST, "small"))
               if type(e).__name__ == "PlanProposed"]
    assert kept.plan["steps"][0]["arguments"] == {"path": "/a"}


def test_an_edited_plan_event_is_caught_by_verify(ledger: Ledger) -> None:
    """A plan's events are sealed and chained like an operation's: rewriting the
    approved plan in the store (another person to share with) is found."""
    status = ledger.propose_plan(share_plan("sealed"), ALICE, HOST)
    assert status.plan_hash is not None
    plan_id = ledger.plans.ledger_id(HOST, "sealed")
    ledger.refresh()
    assert ledger.verify().ok
    rows = ledger.db.query(
        f"SELECT state FROM {ledger.events_table}"
        " WHERE originator_id = ? AND originator_version = 2", (plan_id,),
    )
    state = orjson.loads(bytes(rows[0][0]))
    assert "steps" in state  # PlanValidated: the steps as approved
    state["steps"][1]["arguments"]["person"] = "mallory"
    ledger.db.execute(
        f"UPDATE {ledger.events_table} SET state = ?"
        " WHERE originator_id = ? AND originator_version = 2",
        (orjson.dumps(state), plan_id),
    )
    findings = {(f.kind.value, f.operation_id, f.version) for f in ledger.verify().findings}
    assert ("modified", plan_id, 2) in findings, findings


def test_steps_released_together_count_against_each_others_budget(
    storage: StorageConfig,
) -> None:
    """Two parallel writes released by one approval, after a direct write took a place
    of the budget meanwhile: the second released step sees the first, so no more
    writes run than the budget allows (both used to be let through)."""
    from policy import ContractRegistry

    registry = ContractRegistry()
    for contract in ContractRegistry.from_directory(FILES_CATALOG_DIR).pin_latest().values():
        if contract.name == "write_file":
            contract = contract.model_copy(update={
                "limits": contract.limits.model_copy(update={"max_per_hour": 2})
            })
        registry.register(contract)
    ledger = make_ledger(storage, registry=registry, resolver=None, rules={})
    assert ledger.budget is not None
    ledger.budget.view_kept_current()  # as in the service
    proposed = ledger.propose_plan(plan(
        "writes",
        step("a", "write_file", {"path": "/r/a.md", "content": "a"}),
        step("b", "write_file", {"path": "/r/b.md", "content": "b"}),
        step("g", "grant_access", {"file_id": "file-0123456789ab", "person": "bob"}),
    ), ALICE, HOST)
    assert proposed.state == "awaiting_approval" and proposed.plan_hash is not None
    direct = ledger.submit(
        proposal("write_file", {"path": "/r/c.md", "content": "c"}, operation_id="d1"),
        ALICE, HOST,
    )
    assert direct.state is OperationState.READY
    ledger.approve_plan(ledger.plans.ledger_id(HOST, "writes"), approver="carol",
                        approver_roles=ADMINS, plan_hash=proposed.plan_hash)
    ledger.refresh()
    writes = [row for row in ledger.projector.rows(tool="write_file")
              if row.state not in ("rejected", "needs_clarification")]
    assert len(writes) <= 2, [(row.operation_id, row.state) for row in writes]
    ledger.close()
