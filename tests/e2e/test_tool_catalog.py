"""A host asks the ledger which tools its model may be offered, on `ops.tools.<host>`:
the contracts the ledger checks calls against, as OpenAI, Anthropic or MCP tool
definitions, for a caller with the given capabilities; never a forbidden tool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from ledger.client import AgentHostClient
from ledger.nats import connect_as
from policy import ApprovalMode, ContractRegistry, export_tool
from policy.catalog import CATALOG_DIR
from schemas import Subjects
from tests.e2e.conftest import BackendStack, backend_stack

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path, "sqlite", hosts=["h1"]) as running:
        yield running


async def test_a_host_gets_the_tools_its_caller_may_call_in_its_models_format(
    stack: BackendStack,
) -> None:
    contracts = ContractRegistry.from_directory(CATALOG_DIR).pin_latest()
    everyone = sorted(
        name for name, contract in contracts.items()
        if contract.approval.mode is not ApprovalMode.FORBIDDEN
    )
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    try:
        mcp = await host.tools()
        assert sorted(tool["name"] for tool in mcp) == everyone
        searcher = await host.tools(format="openai", capabilities=frozenset({"documents:search"}))
        names = sorted(tool["function"]["name"] for tool in searcher)
        assert names == sorted(
            name for name, contract in contracts.items()
            if name in everyone and contract.required_capabilities <= {"documents:search"}
        )
        assert "search_documents" in names and "send_customer_email" not in names
        # The contract's own definition, byte for byte what `tools export` prints.
        (search,) = [t for t in searcher if t["function"]["name"] == "search_documents"]
        assert search == export_tool(contracts["search_documents"], "openai")
        # A request the wire refuses: an error envelope for this host alone.
        answer = await nc.request(
            Subjects.tools("h1"), orjson.dumps({"format": "yaml"}), timeout=5
        )
        refused = orjson.loads(answer.data)
        assert refused["ok"] is False and refused["error"]["code"] == "INVALID_MESSAGE"
        anthropic = await host.tools(
            format="anthropic", capabilities=frozenset({"documents:search"})
        )
        assert sorted(tool["name"] for tool in anthropic) == names
    finally:
        await host.close()
