"""The lease checks the call again when it runs, over a real nats-server with the
ledger service on each storage backend.

Before: an e-mail approved, then leased after its approval had lapsed, was sent.
Now the lease refuses it (`ExecutionRefused`, `approval_expired`), the executor
acknowledges the item without calling the provider, and the host gets the final
outcome.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from executors.samples.email import count_send_requests
from ledger.client import AgentHostClient
from ledger.nats import connect_as
from policy.catalog import CATALOG_DIR
from schemas import PreviewReport, RuntimeContext, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

APPROVAL_S = 1
ALICE = RuntimeContext(principal="alice", tenant="acme", capabilities=frozenset({"email:send"}))


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    contracts = tmp_path / "contracts"
    shutil.copytree(CATALOG_DIR, contracts, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    email = contracts / "send_customer_email.yaml"
    short = email.read_text().replace("expires_after_s: 900", f"expires_after_s: {APPROVAL_S}")
    email.write_text(short)
    with backend_stack(tmp_path / "stack", request.param, hosts=["h1"],
                       tools=["send_customer_email"], contracts=contracts) as running:
        yield running


async def test_an_approval_that_lapsed_before_the_work_ran_is_not_sent(
    stack: BackendStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = tmp_path / "email.db"
    monkeypatch.setenv("OPLEDGER_SECRET_EMAIL_PROVIDER_DB", str(provider))
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    ledger = stack.ledger()
    try:
        proposal = ToolProposal(
            proposal_id="p-mail", conversation_id="c-1", requested_by_user_id="alice",
            tool_name="send_customer_email", operation_id="op-late",
            arguments={"recipient_ids": ["cus-0001"], "template": "support_received",
                       "variables": {"ticket_id": "TCK-42"}},
        )
        reply = await host.propose(proposal, ALICE)
        assert reply.state == "awaiting_approval" and reply.decision is not None
        # No executor runs to preview it: the preview is recorded as one would send it.
        ledger.leasing.record_preview(
            "h1/op-late", tool=None, executor="send_customer_email-x",
            report=PreviewReport(effect={"summary": "send 1 e-mail(s)"}),
        )
        ledger.approve("h1/op-late", approver="lead", approver_roles=["support_lead"],
                       proposal_hash=reply.decision.proposal_hash or "",
                       preview_hash=ledger.get("h1/op-late").preview_hash)
        # No executor yet (down, or busy for longer than the approval's window).
        await asyncio.sleep(APPROVAL_S + 0.5)
        stack.start_executor("send_customer_email")
        status = await host.outcome("op-late", timeout=60)
    finally:
        await host.close()
    log = stack.log("executor-send_customer_email-0.log")
    assert (status.state, status.final) == ("approval_expired", True), log
    assert status.outcome == {"status": "approval_expired", "code": "approval_expired"}
    history = [type(e).__name__ for e in ledger.history("h1/op-late")]
    assert history[-2:] == ["Readied", "ExecutionRefused"], history
    assert "LeaseClaimed" not in history
    assert not provider.exists() or count_send_requests(provider, "h1/op-late") == 0
