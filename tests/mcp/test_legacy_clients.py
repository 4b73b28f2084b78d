"""Clients of the handshake-era MCP revisions (`initialize`, no MRTR): the SDK's own
client in `legacy` mode, through an `McpGateway` over the real ledger and executors.
Such a client cannot be handed a `requestState`; a call that is not settled within a
round is `OUTCOME_PENDING`, and for a write the same call again is the same operation."""

from __future__ import annotations

import json
from typing import Any

import pytest
from mcp_types import CallToolResult, TextContent

from tests.mcp.conftest import McpStack

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

BOTH = ("notes:read", "notes:write")


def _error(result: CallToolResult) -> dict[str, Any]:
    assert result.is_error, result
    block = result.content[0]
    assert isinstance(block, TextContent)
    body: dict[str, Any] = json.loads(block.text)["error"]
    return body


async def test_a_write_awaiting_approval_is_pending_then_the_same_call_has_its_outcome(
    ledger_stack: McpStack,
) -> None:
    arguments = {"key": "legacy-note", "text": "from an old client"}
    async with ledger_stack.gateway(
        principal="frank", capabilities=BOTH, legacy_wait_s=1.0,
        client_options={"mode": "legacy"},
    ) as old:
        pending = await old.call_tool("write_note", arguments)
        error = _error(pending)
        assert (error["code"], error["retryable"]) == ("OUTCOME_PENDING", True)
        first_operation = (pending.meta or {})["io.opledger/operationId"]
        assert [e for e in ledger_stack.effects() if e["tool"] == "write_note"] == []

        operation = await ledger_stack.approve_when_asked("write_note")
        assert operation.endswith(first_operation)
        for _ in range(30):  # each call waits one round (1 s here) for the outcome
            again = await old.call_tool("write_note", arguments)
            if not again.is_error:
                break
            assert _error(again)["code"] == "OUTCOME_PENDING"
    assert again.structured_content == arguments
    assert (again.meta or {})["io.opledger/operationId"] == first_operation
    written = [e for e in ledger_stack.effects() if e["tool"] == "write_note"]
    assert [e["key"] for e in written] == [operation]  # one note, under the operation's key


async def test_a_read_that_is_not_settled_in_time_is_pending_and_not_retryable(
    ledger_stack: McpStack,
) -> None:
    """A read is a fresh operation on each call: calling again would not find it, so its
    `OUTCOME_PENDING` says so, and is not retryable."""
    async with ledger_stack.gateway(
        principal="grace", capabilities=BOTH, legacy_wait_s=0.0,
        client_options={"mode": "legacy"},
    ) as old:
        # No wait at all: the read cannot have run yet when the round ends.
        slow = await old.call_tool("lookup_note", {"key": "nothing-here"})
    error = _error(slow)
    assert (error["code"], error["retryable"]) == ("OUTCOME_PENDING", False)
    assert "a call made again is a new operation" in error["message"]
