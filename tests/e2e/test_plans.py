"""Plans on a real stack (nats-server, the ledger service, one executor process per tool),
on SQLite and PostgreSQL: seed 001's examples with the file-sharing sample tools.

- a folder, then a file in it: the order holds (the same write alone, with no
  folder, fails: run in parallel it would have);
- a file, a share and a notification whose notification fails: one approval for
  the whole plan, `partially_succeeded` with a step table that says what to retry
  and what can be undone, and a retry that runs only the failed step;
- an executor killed right after its effect: the step converges on one effect;
- an approval of one plan presented for another: refused;
- another host can neither see nor cancel a plan;
- a write undone by its compensation: an operation of its own, proposed by an
  operator, approved by an approver, linked both ways, and the file is gone.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from executors.samples.files import CRASH_AFTER_ENV, FakeDrive, count_requests, set_chat_down
from ledger.client import AgentHostClient, ApproverClient, OperatorClient, RequestRefused
from ledger.nats import connect_as
from policy.catalog import FILES_CATALOG_DIR
from schemas import PlanProposal, PlanStatus, RuntimeContext, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

TOOLS = ("create_folder", "write_file", "grant_access", "notify_user", "delete_file")
ALICE = RuntimeContext(
    principal="alice",
    tenant="acme",
    capabilities=frozenset({"files:write", "files:share", "notify:send"}),
)


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path / "stack", request.param, hosts=["h1", "h2"], tools=TOOLS,
                       contracts=FILES_CATALOG_DIR,
                       approvers={"carol": ["files_admin"]}) as running:
        for tool in TOOLS:
            start(running, tool)
        yield running


def start(stack: BackendStack, tool: str, **env: str) -> None:
    stack.start_executor(tool, spec=f"executors.samples.files:{tool}",
                         OPLEDGER_SECRET_FILES_DB=str(drive_path(stack)), **env)


def drive_path(stack: BackendStack) -> Path:
    return stack.home / "drive.db"


@pytest.fixture
def sqlite_stack(tmp_path: Path) -> Iterator[BackendStack]:
    """One backend is enough for the command line: it reads what the service stored."""
    with backend_stack(tmp_path / "stack", "sqlite", hosts=["h1"], tools=TOOLS,
                       contracts=FILES_CATALOG_DIR,
                       approvers={"carol": ["files_admin"]}) as running:
        for tool in TOOLS:
            start(running, tool)
        yield running


@pytest.fixture
async def host(stack: BackendStack) -> AsyncIterator[AgentHostClient]:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    yield AgentHostClient(nc, "h1", poll_interval=0.2)
    await nc.close()


@pytest.fixture
async def carol(stack: BackendStack) -> AsyncIterator[ApproverClient]:
    nc = await connect_as(stack.server.url, stack.credentials.approver("carol"))
    yield ApproverClient(nc, "carol")
    await nc.close()


def plan(plan_id: str, *steps: dict[str, Any]) -> PlanProposal:
    return PlanProposal.model_validate(
        {"plan_id": plan_id, "conversation_id": "c-1", "requested_by_user_id": "alice",
         "steps": list(steps)}
    )


def step(name: str, tool: str, arguments: dict[str, Any], *depends_on: str,
         prefix: str = "") -> dict[str, Any]:
    return {"step": name, "operation_id": f"{prefix}op-{name}", "tool_name": tool,
            "arguments": arguments, "depends_on": list(depends_on)}


def share_plan(plan_id: str) -> PlanProposal:
    return plan(
        plan_id,
        step("create-file", "write_file", {"path": "/shared/q3.md", "content": "Q3 numbers"},
             prefix=plan_id),
        step("grant", "grant_access",
             {"file_id": {"$result": {"step": "create-file", "pointer": "/file_id"}},
              "person": "bob"}, "create-file", prefix=plan_id),
        step("notify", "notify_user", {"person": "bob", "message": "Q3 is shared with you"},
             "grant", prefix=plan_id),
    )


def table(status: PlanStatus) -> dict[str, tuple[str, bool, str | None]]:
    return {row.step: (row.state, row.retry_needed, row.compensation) for row in status.steps}


async def test_a_file_is_written_into_its_folder_because_the_plan_keeps_the_order(
    stack: BackendStack, host: AgentHostClient
) -> None:
    # The control: the write alone, with no folder, fails at the drive. Run in
    # parallel with the folder's creation, the write could come first and fail so.
    alone = await host.propose_plan(plan(
        "alone", step("write", "write_file", {"path": "/solo/a.md", "content": "x"})
    ), ALICE)
    assert alone.state == "running"
    alone = await host.plan_outcome("alone", timeout=30)
    assert (alone.state, table(alone)["write"][0]) == ("failed", "failed")

    status = await host.propose_plan(plan(
        "reports",
        step("create-folder", "create_folder", {"path": "/reports/2026"}),
        step("write-summary", "write_file",
             {"path": "/reports/2026/summary.md", "content": "# Summary"}, "create-folder"),
    ), ALICE)
    assert status.state == "running"
    final = await host.plan_outcome("reports", timeout=30)
    assert final.state == "succeeded", final
    drive = FakeDrive(drive_path(stack))
    assert "/reports/2026" in drive.folders()
    assert drive.files()["/reports/2026/summary.md"] == "# Summary"
    # Each step is an operation of the host, asked about like any other.
    step_status = await host.status("op-write-summary")
    assert step_status.state == "succeeded"
    assert step_status.result is not None and step_status.result.data is not None
    assert step_status.result.data["path"] == "/reports/2026/summary.md"


async def test_a_partially_succeeded_plan_is_retried_without_running_what_succeeded(
    stack: BackendStack, host: AgentHostClient, carol: ApproverClient
) -> None:
    set_chat_down(drive_path(stack), True)
    status = await host.propose_plan(share_plan("share"), ALICE)
    assert status.state == "awaiting_approval"
    assert status.plan_hash is not None
    await asyncio.sleep(0.5)
    assert count_requests(drive_path(stack)) == 0  # nothing runs before the approval
    approved = await carol.approve_plan("h1/share", plan_hash=status.plan_hash)
    assert approved.state == "running"
    final = await host.plan_outcome("share", timeout=30)
    assert final.state == "partially_succeeded", final
    assert table(final) == {
        "create-file": ("succeeded", False, "delete_file"),
        "grant": ("succeeded", False, "revoke_access"),
        "notify": ("failed", True, None),
    }
    drive = FakeDrive(drive_path(stack))
    (file_id, person), = drive.grants()
    assert person == "bob" and file_id.startswith("file-")

    set_chat_down(drive_path(stack), False)
    ledger = stack.ledger()
    try:
        ledger.retry_plan(ledger.plans.ledger_id("h1", "share"), by="operator:olga",
                          reason="chat is back")
    finally:
        ledger.close()
    final = await host.plan_outcome("share", timeout=30)
    assert final.state == "succeeded", final
    # The retry ran only the notification: one write, one share, two notify attempts.
    assert count_requests(drive_path(stack), "write_file") == 1
    assert count_requests(drive_path(stack), "grant_access") == 1
    assert count_requests(drive_path(stack), "notify_user") == 2
    assert len(drive.files()) == 1 and len(drive.grants()) == 1
    assert drive.notices() == [("bob", "Q3 is shared with you")]


async def test_an_executor_killed_after_its_effect_converges_on_one_effect(
    stack: BackendStack, host: AgentHostClient
) -> None:
    # One more write_file executor that dies right after the drive applied the write.
    for process in stack.executors:
        if "write_file" in str(process.args):
            process.terminate()
            process.wait(timeout=10)
    start(stack, "write_file", **{CRASH_AFTER_ENV: "write_file"})
    status = await host.propose_plan(plan(
        "crash",
        step("folder", "create_folder", {"path": "/crash"}),
        step("write", "write_file", {"path": "/crash/a.md", "content": "once"}, "folder"),
        step("tell", "notify_user", {"person": "bob", "message": "written"}, "write"),
    ), ALICE)
    assert status.state == "running"
    deadline = asyncio.get_running_loop().time() + 20
    while count_requests(drive_path(stack), "write_file") < 1:
        assert asyncio.get_running_loop().time() < deadline, "the write never ran"
        await asyncio.sleep(0.1)
    start(stack, "write_file")  # a healthy executor for whatever comes next
    final = await host.plan_outcome("crash", timeout=60)
    assert final.state == "succeeded", final
    # As for a single call: the lease ran out with the outcome unknown, the tool's
    # lookup found the write the dead executor made, and nothing wrote it again.
    ledger = stack.ledger()
    try:
        kinds = [type(event).__name__ for event in ledger.history("h1/op-write")]
    finally:
        ledger.close()
    assert "LeaseExpired" in kinds and kinds[-1] == "Reconciled", kinds
    assert count_requests(drive_path(stack), "write_file") == 1
    assert list(FakeDrive(drive_path(stack)).files()) == ["/crash/a.md"]
    # The step after it ran on the reconciled outcome.
    assert FakeDrive(drive_path(stack)).notices() == [("bob", "written")]


async def test_an_approval_of_one_plan_is_refused_for_another_and_runs_nothing(
    stack: BackendStack, host: AgentHostClient, carol: ApproverClient
) -> None:
    first = await host.propose_plan(share_plan("plan-a"), ALICE)
    changed = share_plan("plan-b").model_dump(mode="json")
    changed["steps"][1]["arguments"]["person"] = "mallory"
    second = await host.propose_plan(PlanProposal.model_validate(changed), ALICE)
    assert first.plan_hash and second.plan_hash and first.plan_hash != second.plan_hash
    with pytest.raises(RequestRefused, match="proposal_hash_mismatch"):
        await carol.approve_plan("h1/plan-b", plan_hash=first.plan_hash)
    # The control on the same stack: plan A's own approval runs plan A.
    await carol.approve_plan("h1/plan-a", plan_hash=first.plan_hash)
    assert (await host.plan_outcome("plan-a", timeout=30)).state == "succeeded"
    assert (await host.plan_status("plan-b")).state == "awaiting_approval"
    assert [person for _, person in FakeDrive(drive_path(stack)).grants()] == ["bob"]


async def test_another_host_can_neither_see_nor_cancel_a_plan(
    stack: BackendStack, host: AgentHostClient
) -> None:
    await host.propose_plan(share_plan("mine"), ALICE)
    nc = await connect_as(stack.server.url, stack.credentials.host("h2"))
    other = AgentHostClient(nc, "h2")
    try:
        for attempt in (other.plan_status("mine"), other.cancel_plan("mine")):
            with pytest.raises(RequestRefused) as refused:
                await attempt
            assert refused.value.info.code == "PLAN_NOT_FOUND"
    finally:
        await nc.close()
    assert (await host.plan_status("mine")).state == "awaiting_approval"
    cancelled = await host.cancel_plan("mine", reason="not needed")
    assert (cancelled.state, cancelled.cancel_requested) == ("awaiting_approval", True)


async def test_a_compensation_is_its_own_approved_operation_and_undoes_the_effect(
    stack: BackendStack, host: AgentHostClient, carol: ApproverClient
) -> None:
    reply = await host.propose(ToolProposal(
        proposal_id="p-save", conversation_id="c-1", requested_by_user_id="alice",
        tool_name="write_file", operation_id="op-save",
        arguments={"path": "/shared/draft.md", "content": "draft"},
    ), ALICE)
    assert reply.state == "ready"
    assert (await host.outcome("op-save", timeout=30)).state == "succeeded"
    drive = FakeDrive(drive_path(stack))
    assert "/shared/draft.md" in drive.files()
    nc = await connect_as(stack.server.url, stack.credentials.operator("ops-lead"))
    operator = OperatorClient(nc, "ops-lead")
    try:
        undo = await operator.compensate("h1/op-save", reason="saved in the wrong place")
        assert (undo.operation_id, undo.state, undo.tool) == (
            "h1/op-save-c", "awaiting_approval", "delete_file"
        )
        # Nothing is undone on the operator's word alone: its own approval first.
        await asyncio.sleep(0.5)
        assert "/shared/draft.md" in drive.files()
        assert count_requests(drive_path(stack), "delete_file") == 0
        again = await operator.compensate("h1/op-save", reason="saved in the wrong place")
        assert again.operation_id == "h1/op-save-c"  # the same compensation, not a second
    finally:
        await nc.close()
    ledger = stack.ledger()
    try:
        approval = ledger.get("h1/op-save-c").approval
        assert approval is not None
        shown = approval.effect_preview["proposal_hash"]
    finally:
        ledger.close()
    await carol.approve("h1/op-save-c", proposal_hash=shown)
    assert (await host.outcome("op-save-c", timeout=30)).state == "succeeded"
    assert "/shared/draft.md" not in drive.files()
    assert count_requests(drive_path(stack), "delete_file") == 1
    ledger = stack.ledger()
    try:
        assert ledger.get("h1/op-save").compensated_by == "h1/op-save-c"
        assert ledger.get("h1/op-save-c").compensates == "h1/op-save"
        assert ledger.get("h1/op-save-c").proposed_by == "operator:ops-lead"
    finally:
        ledger.close()


def _cli(stack: BackendStack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ledger.entrypoints", *args,
         "--database", str(stack.home / "ledger.db"), "--home", str(stack.home)],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "OPLEDGER_CONTRACTS_DIR": str(FILES_CATALOG_DIR),
             "OPLEDGER_NATS_URL": stack.server.url,
             "OPLEDGER_CREDS_DIR": str(stack.home / "creds")},
    )


async def test_an_approver_sees_every_step_and_approves_the_plan_from_the_command_line(
    sqlite_stack: BackendStack,
) -> None:
    stack = sqlite_stack
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1", poll_interval=0.2)
    try:
        status = await host.propose_plan(share_plan("cli"), ALICE)
        assert status.plan_hash is not None
        shown = _cli(stack, "plans", "show", "h1/cli")
        assert shown.returncode == 0, shown.stderr
        # Every step's exact effect, where a value comes from, and the hash to approve.
        for text in ("1. create-file: write_file", "2. grant: grant_access",
                     "file_id: </file_id of create-file's result>", "person: bob",
                     "3. notify: notify_user", f"Plan hash: {status.plan_hash}"):
            assert text in shown.stdout, (text, shown.stdout)
        wrong = _cli(stack, "plans", "approve", "h1/cli", "--approver", "carol",
                     "--plan-hash", "0" * 64)
        assert wrong.returncode == 2 and "proposal_hash_mismatch" in wrong.stderr
        done = _cli(stack, "plans", "approve", "h1/cli", "--approver", "carol",
                    "--plan-hash", status.plan_hash)
        assert done.returncode == 0, done.stderr
        assert "it is now running" in done.stdout
        assert (await host.plan_outcome("cli", timeout=30)).state == "succeeded"
    finally:
        await nc.close()
