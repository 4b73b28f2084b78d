"""The executor learns who a call runs for from the ledger's lease, and the sample
search stays within that tenant: on a real nats-server, the ledger service on each
storage backend, and the sample executor process.

Before: the lease carried no principal or tenant, and the search searched every
tenant's documents.
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

TOOL = "search_documents"


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path, request.param, hosts=["h1"], tools=[TOOL]) as running:
        running.start_executor(TOOL)
        yield running


async def test_each_tenant_searches_only_its_own_documents(stack: BackendStack) -> None:
    host = AgentHostClient(await connect_as(stack.server.url, stack.credentials.host("h1")),
                           "h1")
    found: dict[str, set[str]] = {}
    try:
        for tenant in ("acme", "globex"):
            context = RuntimeContext(principal=f"user-{tenant}", tenant=tenant,
                                     capabilities=frozenset({"documents:search"}))
            proposal = ToolProposal(
                proposal_id=f"p-{tenant}", conversation_id="c-1",
                requested_by_user_id=f"user-{tenant}", tool_name=TOOL,
                # The model cannot widen the scope: a tenant in the arguments is refused
                # by the schema, and the query names the other tenant to no effect.
                arguments={"query": "globex refund policy", "source_types": ["policy"]},
                operation_id=f"op-{tenant}",
            )
            assert (await host.propose(proposal, context)).state == "ready"
            status = await host.outcome(f"op-{tenant}", timeout=30)
            assert status.state == "succeeded", stack.log("executor-search_documents-0.log")
            assert status.result is not None and status.result.data is not None
            found[tenant] = {item["source_id"] for item in status.result.data["items"]}
    finally:
        await host.close()
    assert found["globex"] == {"globex-refunds"}
    assert found["acme"] and "globex-refunds" not in found["acme"]
