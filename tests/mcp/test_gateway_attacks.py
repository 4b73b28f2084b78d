"""The gateway against callers it must keep apart and a ledger that fails it: gateways run
in this process (`McpStack.gateway`) over a real nats-server, ledger and MCP executors."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, MCPError
from mcp_types import INVALID_PARAMS, CallToolResult, InputRequiredResult, TextContent

from ledger.client import AgentHostClient
from ledger.mcp import GatewaySettings, McpGateway
from ledger.nats import NatsServer
from schemas import RuntimeContext
from tests.mcp.conftest import STATE_KEY, McpStack

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

BOTH = ("notes:read", "notes:write")


def _body(result: CallToolResult) -> dict[str, Any]:
    block = result.content[0]
    assert isinstance(block, TextContent)
    body = json.loads(block.text)
    assert isinstance(body, dict)
    return body


def _operation(result: CallToolResult | InputRequiredResult) -> str:
    return str((result.meta or {})["io.opledger/operationId"])


def _appended(stack: McpStack, line: str) -> list[dict[str, Any]]:
    return [e for e in stack.effects()
            if e["tool"] == "append_log" and e["arguments"]["line"] == line]


async def test_two_callers_sharing_a_host_identity_are_two_operations(
    ledger_stack: McpStack,
) -> None:
    """Two gateways started with one host seed, for alice and for bob: the same write from
    each is two operations (the ledger would refuse bob's as another call's ID, or hand
    him alice's outcome), and each still converges with itself."""
    arguments = {"line": "same-words", "delay_ms": 0}
    async with ledger_stack.gateway(principal="alice", capabilities=BOTH) as alice, \
            ledger_stack.gateway(principal="bob", capabilities=BOTH) as bob:
        first = await alice.call_tool("append_log", arguments)
        second = await bob.call_tool("append_log", arguments)
        again = await bob.call_tool("append_log", arguments)
    assert not first.is_error, first
    assert not second.is_error, second
    assert _operation(first) != _operation(second)
    assert _operation(again) == _operation(second)
    assert len(_appended(ledger_stack, "same-words")) == 2


async def test_a_call_in_one_environment_is_not_answered_from_another(
    ledger_stack: McpStack,
) -> None:
    """One host seed, one principal and tenant, two environments: the ledger's own
    idempotency does not tell them apart, so derived IDs must, or the production call
    would be handed the staging call's outcome and never run."""
    arguments = {"line": "per-environment", "delay_ms": 0}
    async with ledger_stack.gateway(principal="carol", capabilities=BOTH,
                                    environment="staging") as staging, \
            ledger_stack.gateway(principal="carol", capabilities=BOTH,
                                 environment="production") as production:
        first = await staging.call_tool("append_log", arguments)
        second = await production.call_tool("append_log", arguments)
    assert not first.is_error and not second.is_error, (first, second)
    assert _operation(first) != _operation(second)
    assert len(_appended(ledger_stack, "per-environment")) == 2


async def test_an_idempotency_key_names_an_operation_of_its_caller_only(
    ledger_stack: McpStack,
) -> None:
    """The same `_meta` key from two callers on one host identity is two operations."""
    arguments = {"line": "keyed", "delay_ms": 0}
    meta: Any = {"io.opledger/idempotencyKey": "key-1"}
    async with ledger_stack.gateway(principal="dave", capabilities=BOTH) as dave, \
            ledger_stack.gateway(principal="erin", capabilities=BOTH) as erin:
        first = await dave.call_tool("append_log", arguments, meta=meta)
        repeated = await dave.call_tool("append_log", arguments, meta=meta)
        other = await erin.call_tool("append_log", arguments, meta=meta)
    assert not first.is_error and not other.is_error, (first, other)
    assert _operation(repeated) == _operation(first) != _operation(other)
    assert len(_appended(ledger_stack, "keyed")) == 2


async def test_a_request_state_is_honoured_only_for_the_caller_it_was_sealed_for(
    ledger_stack: McpStack,
) -> None:
    """Bob replays alice's `requestState` (one host identity, one shared key, the same
    call): refused, never followed to alice's operation. Alice's own round goes on."""
    arguments = {"key": "sealed-note", "text": "alice's"}
    async with ledger_stack.gateway(principal="alice", capabilities=BOTH) as alice, \
            ledger_stack.gateway(principal="bob", capabilities=BOTH) as bob:
        pending = await alice.session.call_tool(
            "write_note", arguments, allow_input_required=True
        )
        assert isinstance(pending, InputRequiredResult), pending
        state = pending.request_state
        assert state is not None
        with pytest.raises(MCPError) as refused:
            await bob.session.call_tool(
                "write_note", arguments, request_state=state, allow_input_required=True
            )
        assert refused.value.error.code == INVALID_PARAMS
        assert "another caller" in refused.value.error.message
        again = await alice.session.call_tool(
            "write_note", arguments, request_state=state, allow_input_required=True
        )
        assert isinstance(again, InputRequiredResult)
        assert _operation(again) == _operation(pending)
    await ledger_stack.approve_when_asked("write_note", deny=True)


async def test_a_client_without_mrtr_gets_pending_then_the_outcome_of_one_operation(
    ledger_stack: McpStack,
) -> None:
    """A handshake-era client: told `OUTCOME_PENDING` (retryable) while the write awaits
    approval; the same call again, once approved, is the same operation and its outcome."""
    arguments = {"line": "legacy-client", "delay_ms": 0}
    async with ledger_stack.gateway(
        principal="frank", capabilities=BOTH, legacy_wait_s=0.5,
        client_options={"mode": "legacy"},
    ) as legacy:
        # append_log needs no approval: its outcome comes within the wait.
        done = await legacy.call_tool("append_log", arguments)
        assert not done.is_error, done
        pending = await legacy.call_tool("write_note", {"key": "legacy", "text": "t"})
        assert pending.is_error
        error = _body(pending)["error"]
        assert error["code"] == "OUTCOME_PENDING" and error["retryable"] is True
        operation = await ledger_stack.approve_when_asked("write_note")
        deadline = time.monotonic() + 30
        while True:
            final = await legacy.call_tool("write_note", {"key": "legacy", "text": "t"})
            if not final.is_error or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    assert not final.is_error, final
    assert _operation(final) == _operation(pending) == operation.split("/", 1)[1]


async def test_past_max_waiting_a_round_answers_at_once(ledger_stack: McpStack) -> None:
    """Held-open calls are bounded: with none allowed, a call awaiting approval is answered
    `input_required` at once instead of holding its request for the round."""
    async with ledger_stack.gateway(
        principal="gina", capabilities=BOTH, approval_round_s=20.0, max_waiting=0
    ) as client:
        started = time.monotonic()
        pending = await client.session.call_tool(
            "write_note", {"key": "unheld", "text": "t"}, allow_input_required=True
        )
        took = time.monotonic() - started
    assert isinstance(pending, InputRequiredResult), pending
    assert took < 10, took
    await ledger_stack.approve_when_asked("write_note", deny=True)


async def test_a_ledger_that_does_not_answer_is_a_retryable_error_result(tmp_path: Path) -> None:
    """No ledger service on the NATS server: a write is an `isError` result saying
    `LEDGER_UNAVAILABLE` (retryable), not a JSON-RPC error quoting an exception."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        import nats

        nc = await nats.connect(server.url)
        host = AgentHostClient(nc, "h1", timeout=0.3)
        settings = GatewaySettings(
            host="h1", state_key=STATE_KEY,
            context=RuntimeContext(principal="alice", tenant="acme", capabilities=frozenset(BOTH)),
        )
        try:
            async with Client(McpGateway(host, settings).server(), cache=None) as client:
                result = await client.call_tool("append_log", {"line": "x", "delay_ms": 0})
        finally:
            await host.close()
    finally:
        server.stop()
    assert result.is_error
    error = _body(result)["error"]
    assert error["code"] == "LEDGER_UNAVAILABLE"
    assert error["retryable"] is True


async def test_a_call_larger_than_a_message_is_a_clear_error_result_and_others_go_on(
    ledger_stack: McpStack,
) -> None:
    """Arguments over the NATS server's message size (1 MiB by default): nothing can be
    sent, and the caller is told so in an `isError` result; a call beside it and calls
    after it run. Before: the SDK's `MaxPayloadError` escaped, and the client got "Internal
    server error" with a traceback in the gateway's log."""
    async with ledger_stack.gateway(principal="hugo", capabilities=BOTH) as client:
        huge, beside = await asyncio.gather(
            client.call_tool("append_log", {"line": "x" * 1_200_000, "delay_ms": 0}),
            client.call_tool("append_log", {"line": "beside-huge", "delay_ms": 0}),
        )
        after = await client.call_tool("append_log", {"line": "after-huge", "delay_ms": 0})
    assert huge.is_error, huge
    body = _body(huge)
    assert body["error"]["code"] == "REQUEST_TOO_LARGE", body
    assert not beside.is_error and not after.is_error, (beside, after)
    assert len(_appended(ledger_stack, "beside-huge")) == 1
    assert len(_appended(ledger_stack, "after-huge")) == 1
