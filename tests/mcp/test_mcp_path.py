"""The SDK's MCP client → `opledger mcp serve` → ledger → `opledger executor mcp` → the
sample MCP server, over stdio and over Streamable HTTP (real processes, real NATS)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from mcp import MCPError
from mcp_types import CallToolResult, TextContent

from tests.mcp.conftest import McpStack

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]


def _body(result: CallToolResult) -> dict[str, Any]:
    block = result.content[0]
    assert isinstance(block, TextContent)
    body = json.loads(block.text)
    assert isinstance(body, dict)
    return body


def _effects_of(stack: McpStack, tool: str) -> list[dict[str, Any]]:
    return [effect for effect in stack.effects() if effect["tool"] == tool]


async def test_a_read_call_returns_its_result_marked_untrusted(mcp_stack: McpStack) -> None:
    async with mcp_stack.client("h1") as client:
        result = await client.call_tool("lookup_note", {"key": "nothing-here"})
    assert not result.is_error, result
    assert result.structured_content == {"key": "nothing-here", "text": ""}
    meta = result.meta or {}
    assert meta["io.opledger/trust"] == "untrusted"
    assert meta["io.opledger/provenance"]["tool"] == "lookup_note"
    assert meta["io.opledger/operationId"].startswith("op-")  # a read: a fresh operation


async def test_a_write_needs_approval_is_approved_and_the_client_gets_the_outcome(
    mcp_stack: McpStack,
) -> None:
    """`write_note` claims `readOnlyHint: true` at its server; its contract says it writes
    and needs approval, and that is what holds, in tools/list and in the call."""
    key = f"approved-{mcp_stack.transport}"
    async with mcp_stack.client("h1") as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}
        hints = listed["write_note"].annotations
        # The contract's hint, not the server's.
        assert hints is not None and hints.read_only_hint is False
        call = asyncio.create_task(client.call_tool("write_note", {"key": key, "text": "hello"}))
        operation = await mcp_stack.approve_when_asked("write_note")
        assert not _effects_of(mcp_stack, "write_note") or all(
            e["arguments"]["key"] != key for e in _effects_of(mcp_stack, "write_note")
        )
        result = await asyncio.wait_for(call, timeout=60)
    assert not result.is_error, result
    assert result.structured_content == {"key": key, "text": "hello"}
    written = [e for e in _effects_of(mcp_stack, "write_note") if e["arguments"]["key"] == key]
    assert len(written) == 1
    # The operation ID reached the server as its idempotency key.
    assert written[0]["key"] == operation
    assert (result.meta or {})["io.opledger/operationId"] == operation.split("/", 1)[1]


async def test_an_invalid_call_gets_repair_feedback_and_nothing_runs(mcp_stack: McpStack) -> None:
    before = len(mcp_stack.effects())
    async with mcp_stack.client("h1") as client:
        result = await client.call_tool(
            "append_log", {"line": "too slow", "delay_ms": 999_999, "tenant": "other"}
        )
    assert result.is_error
    feedback = _body(result)
    assert feedback["decision"] == "rejected"
    assert feedback["repairable"] is True
    found = {(issue["path"], issue.get("keyword")) for issue in feedback["issues"]}
    assert ("/delay_ms", "maximum") in found
    assert any(issue["path"] in ("", "/tenant") for issue in feedback["issues"])
    assert len(mcp_stack.effects()) == before


async def test_a_lost_response_reissued_with_a_new_id_has_one_side_effect(
    mcp_stack: McpStack,
) -> None:
    """The first request's answer never arrives (the client gives up while the server is
    still working: its stream closes); the client re-issues the same call, as MCP requires,
    under a new JSON-RPC ID. The server performs the append once."""
    line = f"once-{mcp_stack.transport}"
    arguments = {"line": line, "delay_ms": 1500}
    async with mcp_stack.client("h1") as client:
        with pytest.raises((MCPError, TimeoutError)):
            await client.call_tool("append_log", arguments, read_timeout_seconds=0.5)
    async with mcp_stack.client("h1") as client:
        again = await client.call_tool("append_log", arguments)
    assert not again.is_error, again
    appended = [e for e in _effects_of(mcp_stack, "append_log") if e["arguments"]["line"] == line]
    assert len(appended) == 1
    assert again.structured_content is not None and again.structured_content["line"] == line
    # And once more, later within the window: still the same operation, no second append.
    async with mcp_stack.client("h1") as client:
        third = await client.call_tool("append_log", arguments)
    assert (third.meta or {})["io.opledger/operationId"] == (again.meta or {})[
        "io.opledger/operationId"
    ]
    appended = [e for e in _effects_of(mcp_stack, "append_log") if e["arguments"]["line"] == line]
    assert len(appended) == 1


async def test_tools_list_follows_the_host_identity_and_unlisted_tools_are_refused(
    mcp_stack: McpStack,
) -> None:
    async with mcp_stack.client("h1") as writer:
        h1 = {tool.name for tool in (await writer.list_tools()).tools}
    async with mcp_stack.client("h2") as reader:
        h2 = {tool.name for tool in (await reader.list_tools()).tools}
        before = len(mcp_stack.effects())
        # h2 does not see append_log; it calls it anyway.
        refused = await reader.call_tool("append_log", {"line": "sneaky", "delay_ms": 0})
    assert h1 == {"append_log", "lookup_note", "noop", "write_note"}
    assert h2 == {"lookup_note", "noop"}
    assert refused.is_error
    feedback = _body(refused)
    assert feedback["category"] == "UNAUTHORIZED"
    assert feedback["repairable"] is False
    assert len(mcp_stack.effects()) == before
