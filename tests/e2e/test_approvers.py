"""Approvers decide as themselves, over a real nats-server with the ledger service on
each storage backend.

Before: `opledger approvals approve --as USER --role ROLE` wrote whatever name and
role it was told into the database, deny checked no role at all, and M-of-N
stopped at two. Now an approval or denial is a request on `ops.approve.<name>`,
which only approver `<name>`'s NKey may publish to; the ledger records it as
`<name>`'s, with the roles its own configuration gives `<name>` (`--approver`).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from executors.samples.email import count_send_requests
from ledger.client import AgentHostClient, ApproverClient, RequestRefused
from ledger.nats import connect_as, flush_all
from policy.catalog import CATALOG_DIR
from schemas import ApproverRequest, RuntimeContext, Subjects, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack
from tests.previews import await_preview

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(180)]

ALICE = RuntimeContext(principal="alice", tenant="acme", capabilities=frozenset({"email:send"}))
APPROVERS = {
    "lead-1": ["support_lead"],
    "lead-2": ["support_lead"],
    "lead-3": ["support_lead"],
    "comp": ["compliance"],
    "outsider": ["data_steward"],  # an approver, but not of e-mails
    "nobody": [],  # an approver identity the ledger gives no role at all
}
EMAIL = "send_customer_email"


def _contracts(tmp_path: Path) -> Path:
    """The samples, with e-mails needing three approvers, one of them from compliance."""
    contracts = tmp_path / "contracts"
    shutil.copytree(CATALOG_DIR, contracts, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    email = contracts / f"{EMAIL}.yaml"
    text = email.read_text()
    old = "  approver_roles: [support_lead]\n"
    assert old in text
    email.write_text(text.replace(old, (
        "  approver_roles: [support_lead, compliance]\n"
        "  required_approvals: 3\n"
        "  required_from: {compliance: 1}\n"
    )))
    return contracts


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path / "stack", request.param, hosts=["h1"], tools=[EMAIL],
                       contracts=_contracts(tmp_path), approvers=APPROVERS) as running:
        yield running


@pytest.fixture
def sqlite_stack(tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path / "stack", "sqlite", hosts=["h1"], tools=[EMAIL],
                       contracts=_contracts(tmp_path), approvers=APPROVERS) as running:
        yield running


async def _propose(stack: BackendStack, host: AgentHostClient, op: str) -> tuple[str, str]:
    """Propose an e-mail needing three approvals; its proposal hash and, once the running
    executor has previewed it, its preview hash (what an approver is shown)."""
    proposal = ToolProposal(
        proposal_id=f"p-{op}", conversation_id="c-1", requested_by_user_id="alice",
        tool_name=EMAIL, operation_id=op,
        arguments={"recipient_ids": ["cus-0001"], "template": "support_received",
                   "variables": {"ticket_id": "TCK-42"}},
    )
    reply = await host.propose(proposal, ALICE)
    assert reply.state == "awaiting_approval" and reply.decision is not None
    assert reply.decision.approval is not None
    assert reply.decision.approval.required_approvals == 3
    return reply.decision.proposal_hash or "", await await_preview(stack.ledger(), f"h1/{op}")


class Approvers:
    """One connection per approver identity, each as itself."""

    def __init__(self, stack: BackendStack) -> None:
        self.stack = stack
        self.clients: dict[str, ApproverClient] = {}

    async def __aenter__(self) -> Approvers:
        for name in APPROVERS:
            nc = await connect_as(self.stack.server.url, self.stack.credentials.approver(name))
            self.clients[name] = ApproverClient(nc, name)
        return self

    async def __aexit__(self, *_: object) -> None:
        for client in self.clients.values():
            await client.close()

    def __getitem__(self, name: str) -> ApproverClient:
        return self.clients[name]


def _decisions(stack: BackendStack, operation_id: str) -> list[tuple[Any, ...]]:
    """The approval events of one operation: type, approver, roles or reason, channel."""
    rows: list[tuple[Any, ...]] = []
    for event in stack.ledger().history(operation_id):
        name = type(event).__name__
        if name == "ApprovalGranted":
            rows.append((name, event.approver, event.approver_roles, event.via))
        elif name == "ApprovalRefused":
            rows.append((name, event.approver, event.decision, event.reason, event.via))
        elif name == "ApprovalDenied":
            rows.append((name, event.approver, event.approver_roles, event.via))
    return rows


async def test_three_approvers_one_from_compliance_and_the_call_runs_once(
    stack: BackendStack,
) -> None:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    stack.start_executor(EMAIL)
    try:
        async with Approvers(stack) as approvers:
            digest, shown = await _propose(stack, host, "op-three")
            op = "h1/op-three"
            for name in ("lead-1", "lead-2", "lead-3"):
                status = await approvers[name].approve(
                    op, proposal_hash=digest, preview_hash=shown
                )
                # Three people, but none from compliance: it must not run yet.
                assert status.state == "awaiting_approval", name
            # Its executor runs and takes work (it sends the call once, below), yet given
            # time nothing of it was leased or sent before the last approval.
            await asyncio.sleep(1.0)
            assert count_send_requests(stack.email_db, op) == 0
            assert "LeaseClaimed" not in {type(e).__name__ for e in stack.ledger().history(op)}
            status = await approvers["comp"].approve(op, proposal_hash=digest, preview_hash=shown)
            assert status.state in {"ready", "executing", "succeeded"}
        outcome = await host.outcome("op-three", timeout=60)
    finally:
        await host.close()
    assert outcome.state == "succeeded", stack.log("executor-send_customer_email-0.log")
    assert count_send_requests(stack.email_db, op) == 1
    assert _decisions(stack, op) == [
        ("ApprovalGranted", "lead-1", ["support_lead"], "nats"),
        ("ApprovalGranted", "lead-2", ["support_lead"], "nats"),
        ("ApprovalGranted", "lead-3", ["support_lead"], "nats"),
        ("ApprovalGranted", "comp", ["compliance"], "nats"),
    ]


async def test_no_role_no_decision_and_every_refusal_is_recorded(stack: BackendStack) -> None:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    stack.start_executor(EMAIL)
    try:
        async with Approvers(stack) as approvers:
            digest, shown = await _propose(stack, host, "op-roles")
            op = "h1/op-roles"
            for name in ("outsider", "nobody"):
                with pytest.raises(RequestRefused) as refused:
                    await approvers[name].approve(op, proposal_hash=digest, preview_hash=shown)
                assert refused.value.code == "APPROVAL_REFUSED"
                assert "not_an_approver" in refused.value.message
                # The refusal says what to do next.
                assert "support_lead, compliance" in refused.value.message
                with pytest.raises(RequestRefused, match="denial refused: not_an_approver"):
                    await approvers[name].deny(op, reason="not my call")
            assert (await host.status("op-roles")).state == "awaiting_approval"
            denied = await approvers["lead-2"].deny(op, reason="wrong customer")
        outcome = await host.outcome("op-roles", timeout=30)
    finally:
        await host.close()
    assert (denied.state, outcome.state) == ("approval_denied", "approval_denied")
    assert outcome.outcome == {"status": "approval_denied", "by": "lead-2"}
    assert _decisions(stack, op) == [
        ("ApprovalRefused", "outsider", "approve", "not_an_approver", "nats"),
        ("ApprovalRefused", "outsider", "deny", "not_an_approver", "nats"),
        ("ApprovalRefused", "nobody", "approve", "not_an_approver", "nats"),
        ("ApprovalRefused", "nobody", "deny", "not_an_approver", "nats"),
        ("ApprovalDenied", "lead-2", ["support_lead"], "nats"),
    ]


async def test_an_approver_cannot_speak_as_another(sqlite_stack: BackendStack) -> None:
    """`outsider` holds a valid seed, and sends a well-formed approval for the call on
    `lead-1`'s subject, and one that names `lead-1` on its own, while `lead-1`
    approves at the same time (so the ledger is demonstrably listening)."""
    stack = sqlite_stack
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    violations: list[str] = []

    async def on_error(error: Exception) -> None:
        violations.append(str(error))

    forger = await connect_as(stack.server.url, stack.credentials.approver("outsider"),
                              error_cb=on_error)
    stack.start_executor(EMAIL)
    try:
        async with Approvers(stack) as approvers:
            digest, shown = await _propose(stack, host, "op-forge")
            op = "h1/op-forge"
            body = ApproverRequest(
                command="approve", operation_id=op, proposal_hash=digest, preview_hash=shown
            )
            inbox = forger.new_inbox()
            answers = await forger.subscribe(inbox)
            await flush_all(forger)
            forged = [forger.publish(Subjects.approve(name), body.model_dump_json().encode(),
                                     reply=inbox) for name in ("lead-1", "lead-2", "comp")]
            legit = approvers["lead-1"].approve(op, proposal_hash=digest, preview_hash=shown)
            *_, status = await asyncio.gather(*forged, legit)
            await flush_all(forger)
            assert status is not None and status.state == "awaiting_approval"
            # The broker dropped each forged publish: no answer came back.
            await asyncio.sleep(0.5)
            assert answers.pending_msgs == 0
            # Naming someone else in the message is not part of the wire at all.
            claimed = {**orjson.loads(body.model_dump_json()), "approver": "lead-2",
                       "approver_roles": ["compliance"]}
            answer = await forger.request(Subjects.approve("outsider"), orjson.dumps(claimed),
                                          timeout=5)
            assert orjson.loads(answer.data)["error"]["code"] == "INVALID_MESSAGE"
            assert (await host.status("op-forge")).state == "awaiting_approval"
    finally:
        await forger.close()
        await host.close()
    for name in ("lead-1", "lead-2", "comp"):
        assert any(f'publish to "{Subjects.approve(name)}"' in v for v in violations), violations
    assert _decisions(stack, op) == [("ApprovalGranted", "lead-1", ["support_lead"], "nats")]


def _cli(stack: BackendStack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ledger.entrypoints", *args,
         "--database", str(stack.home / "ledger.db"), "--home", str(stack.home)],
        capture_output=True, text=True, timeout=60, check=False,
    )


async def test_the_command_line_decides_as_the_seed_it_holds(sqlite_stack: BackendStack) -> None:
    stack = sqlite_stack
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    stack.start_executor(EMAIL)
    try:
        digest, shown = await _propose(stack, host, "op-cli")
    finally:
        await host.close()
    op, url = "h1/op-cli", stack.server.url
    seed = stack.credentials.approver
    done = _cli(stack, "approvals", "approve", op, "--approver", "lead-1", "--proposal-hash",
                digest, "--preview-hash", shown, "--seed", str(seed("lead-1").seed_path),
                "--nats-url", url)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"approve {op} as lead-1: it is now awaiting_approval\n"
    # Another approver's name with one's own seed: the broker refuses it.
    done = _cli(stack, "approvals", "approve", op, "--approver", "lead-2", "--proposal-hash",
                digest, "--seed", str(seed("outsider").seed_path), "--nats-url", url)
    assert done.returncode == 2
    assert done.stderr.startswith("error: NOT_THIS_IDENTITY: NATS refused the publish on"
                                  " ops.approve.lead-2"), done.stderr
    # Claiming a role needs the database and is recorded as break glass.
    done = _cli(stack, "approvals", "approve", op, "--approver", "lead-2", "--as", "lead-2",
                "--role", "compliance", "--proposal-hash", digest, "--nats-url", url)
    assert (done.returncode, done.stderr.split(":")[:2]) == (2, ["error", " INVALID_CONFIG"])
    done = _cli(stack, "approvals", "approve", op, "--break-glass", "--as", "root",
                "--role", "compliance", "--proposal-hash", digest, "--preview-hash", shown)
    assert done.returncode == 0, done.stderr
    assert "as root (break glass) (2 of 3 approvals)" in done.stdout
    assert _decisions(stack, op) == [
        ("ApprovalGranted", "lead-1", ["support_lead"], "nats"),
        ("ApprovalGranted", "root", ["compliance"], "break_glass"),
    ]
