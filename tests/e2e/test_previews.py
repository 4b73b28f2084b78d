"""Previews on a real stack: approvers approve the effect the tool itself previewed, and
nothing runs whose effect changed since.

Before: the approval screen showed a template name and customer IDs, and an approval
counted for the arguments alone: what the tool then rendered, and to whom it sent it
(a customer who unsubscribed after the approval was dropped, the others still got
the message), was never what anyone approved. Now the e-mail's executor renders the
message and resolves
the recipients first (a dry run, `PreviewRecorded`), the approval names that preview's
digest, and the executor previews again right before sending: an effect that is no
longer the approved one is not sent (`PREVIEW_CHANGED`).

Each attack runs beside a control that succeeds on the same stack, so that "nothing
was sent" cannot pass because nothing runs at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from executors.samples.email import FakeEmailProvider, count_send_requests, count_sends
from ledger import ApprovalRefused
from ledger.client import AgentHostClient
from ledger.nats import connect_as
from schemas import LeaseRequest, PreviewReport, RuntimeContext, Subjects, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack
from tests.previews import await_preview

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

EMAIL = "send_customer_email"
SEARCH = "search_documents"
SUPPORT = RuntimeContext(
    principal="sam", tenant="acme", capabilities=frozenset({"email:send"})
)
LEAD: dict[str, Any] = {"approver": "lead", "approver_roles": ["support_lead"]}


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path / "stack", request.param, hosts=["h1"],
                       tools=[EMAIL, SEARCH]) as running:
        running.start_executor(EMAIL)
        yield running


async def _propose(host: AgentHostClient, op: str, recipients: list[str]) -> str:
    reply = await host.propose(
        ToolProposal(
            proposal_id=f"p-{op}", conversation_id="c-1", requested_by_user_id="sam",
            tool_name=EMAIL, operation_id=op,
            arguments={"recipient_ids": recipients, "template": "support_received",
                       "variables": {"ticket_id": "TCK-7", "display_name": "Alice"}},
        ),
        SUPPORT,
    )
    assert reply.state == "awaiting_approval" and reply.decision is not None
    return reply.decision.proposal_hash or ""


async def test_the_approval_is_bound_to_the_previewed_effect_and_a_changed_one_never_runs(
    stack: BackendStack,
) -> None:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    ledger = stack.ledger()
    try:
        changed = await _propose(host, "op-changed", ["cus-0001", "cus-0002"])
        control = await _propose(host, "op-control", ["cus-0003"])
        shown = await await_preview(ledger, "h1/op-changed")
        # What the approver sees is the tool's own rendering, not the arguments.
        effect = (ledger.get("h1/op-changed").preview or {})["effect"]
        assert effect["subject"] == "We received your request TCK-7"
        assert effect["body"].startswith("Hello Alice,")
        assert effect["recipients"] == [
            {"customer_id": "cus-0001", "address": "customer-0001@acme.example.test"},
            {"customer_id": "cus-0002", "address": "customer-0002@acme.example.test"},
        ]
        # An approval that names no preview, or another one, counts for nothing.
        other = PreviewReport(effect={**effect, "recipients": effect["recipients"][:1]})
        for wrong in (None, other.digest()):
            with pytest.raises(ApprovalRefused, match="preview_hash_mismatch"):
                ledger.approve("h1/op-changed", proposal_hash=changed, preview_hash=wrong,
                               **LEAD)
        # Between the preview and the send, one recipient unsubscribes at the provider.
        FakeEmailProvider(stack.email_db).suppress("cus-0002")
        ledger.approve("h1/op-changed", proposal_hash=changed, preview_hash=shown, **LEAD)
        ledger.approve("h1/op-control", proposal_hash=control,
                       preview_hash=await await_preview(ledger, "h1/op-control"), **LEAD)
        failed = await host.outcome("op-changed", timeout=60)
        succeeded = await host.outcome("op-control", timeout=60)
    finally:
        await host.close()
    log = stack.log("executor-send_customer_email-0.log")
    assert succeeded.state == "succeeded", log
    assert count_sends(stack.email_db, "h1/op-control") == 1
    # The approved effect (two recipients) is not what would happen now (one): not sent.
    assert failed.state == "failed", log
    assert failed.outcome is not None and failed.outcome["code"] == "PREVIEW_CHANGED"
    assert count_send_requests(stack.email_db, "h1/op-changed") == 0


async def test_another_tools_executor_cannot_preview_a_call_and_learns_nothing(
    stack: BackendStack,
) -> None:
    """The search executor's own identity sends a preview for an e-mail on the only lease
    subject it may use: answered exactly as an unknown ID, and nothing is recorded. The
    e-mail's own executor previews the same call at the same time (the control)."""
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    search = await connect_as(stack.server.url, stack.credentials.executor(SEARCH))
    ledger = stack.ledger()
    try:
        await _propose(host, "op-forged", ["cus-0001"])
        forged = LeaseRequest(
            operation_id="h1/op-forged", executor="search-1",
            preview=PreviewReport(effect={"summary": "send nothing at all"}),
        )
        unknown = LeaseRequest(
            operation_id="h1/op-nobody", executor="search-1",
            preview=PreviewReport(effect={"summary": "send nothing at all"}),
        )
        answers = [
            orjson.loads(
                (await search.request(Subjects.lease(SEARCH), r.model_dump_json().encode(),
                                      timeout=10)).data
            )
            for r in (forged, unknown)
        ]
        shown = await await_preview(ledger, "h1/op-forged")
    finally:
        await search.close()
        await host.close()
    assert [a["error"]["code"] for a in answers] == ["OPERATION_NOT_FOUND"] * 2
    assert answers[0]["error"]["message"] == answers[1]["error"]["message"]
    recorded = [e for e in ledger.history("h1/op-forged") if type(e).__name__ == "PreviewRecorded"]
    assert [e.executor for e in recorded] == ["executor-send_customer_email-0"]
    assert recorded[0].preview_hash == shown
    assert "send nothing" not in orjson.dumps(recorded[0].report).decode()
