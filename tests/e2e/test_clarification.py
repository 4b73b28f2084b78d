"""A host proposing a call with an ambiguous reference gets a question for its user,
final, over a real nats-server with the ledger service on each storage backend.

Before: the only answers were ready, needs approval and rejected; an ambiguous
reference could only be a rejection, which invites the model to retry it blindly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.client import AgentHostClient
from ledger.nats import connect_as
from schemas import RuntimeContext, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

READER = RuntimeContext(principal="alice", tenant="acme",
                        capabilities=frozenset({"orders:read"}))


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path, request.param, hosts=["h1"], tools=["query_orders"]) as running:
        running.start_executor("query_orders")
        yield running


async def test_the_host_gets_the_question_and_nothing_runs(stack: BackendStack) -> None:
    host = AgentHostClient(await connect_as(stack.server.url, stack.credentials.host("h1")),
                           "h1")
    try:
        proposal = ToolProposal(
            proposal_id="p-which", conversation_id="c-1", requested_by_user_id="alice",
            tool_name="query_orders", arguments={"customer_id": "cus-0700"},
            operation_id="op-which",
        )
        reply = await host.propose(proposal, READER)
        assert reply.state == "needs_clarification"
        assert reply.decision is not None and reply.decision.question
        assert not reply.decision.repairable
        status = await host.outcome("op-which", timeout=10)
    finally:
        await host.close()
    assert (status.state, status.final) == ("needs_clarification", True)
    assert status.outcome == {"status": "needs_clarification",
                              "question": reply.decision.question}
    kinds = [type(e).__name__ for e in stack.ledger().history("h1/op-which")]
    assert kinds == ["Proposed", "ClarificationNeeded"]
