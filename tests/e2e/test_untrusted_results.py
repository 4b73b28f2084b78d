"""Untrusted results from the executor: the ledger checks what a result claims, over a
real nats-server with the ledger service on each storage backend.

The attacker holds the search executor's own seed (it may lease and publish results
for its tool) and reports what no honest executor would: a "success" whose data
breaks the contract's output schema, and a result labelled `trusted`. Before: both
were recorded as they said.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from nats.aio.client import Client

from ledger.client import AgentHostClient
from ledger.nats import connect_as
from schemas import (
    RESULTS_STREAM,
    LeaseDecision,
    LeaseReply,
    LeaseRequest,
    RuntimeContext,
    Subjects,
    ToolProposal,
)
from tests.e2e.conftest import BackendStack, backend_stack

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

ALICE = RuntimeContext(principal="alice", tenant="acme",
                       capabilities=frozenset({"documents:search"}))
TOOL = "search_documents"


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path, request.param, hosts=["h1"], tools=[TOOL]) as running:
        yield running  # no executor: the test is the (hostile) executor


async def _lease(executor: Client, operation_id: str) -> LeaseReply:
    request = LeaseRequest(operation_id=operation_id, executor="search-attacker")
    answer = await executor.request(
        Subjects.lease(TOOL), request.model_dump_json().encode(), timeout=10
    )
    reply = LeaseReply.model_validate_json(answer.data)
    assert reply.decision is LeaseDecision.EXECUTE, reply
    return reply


async def _publish(executor: Client, lease: LeaseReply, data: Any, trust: str, nonce: str) -> None:
    envelope = {
        "operation_id": lease.operation_id, "fencing_token": lease.fencing_token, "ok": True,
        "data": data,
        "provenance": {"tool": TOOL, "tool_version": lease.tool_version,
                       "executor": "search-attacker", "attempt": lease.attempt,
                       "latency_ms": 1.0, "completed_at": datetime.now(UTC).isoformat(),
                       "trust": trust},
    }
    await executor.jetstream().publish(
        Subjects.result(TOOL), orjson.dumps(envelope), stream=RESULTS_STREAM,
        headers={"Nats-Msg-Id": f"{lease.operation_id}:{nonce}"},
    )


async def _propose(host: AgentHostClient, operation_id: str) -> None:
    proposal = ToolProposal(
        proposal_id=f"p-{operation_id}", conversation_id="c-1", requested_by_user_id="alice",
        tool_name=TOOL, arguments={"query": "refund policy"}, operation_id=operation_id,
    )
    assert (await host.propose(proposal, ALICE)).state == "ready"


async def test_a_result_is_recorded_for_what_it_is_not_for_what_it_says(
    stack: BackendStack,
) -> None:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    executor = await connect_as(stack.server.url, stack.credentials.executor(TOOL))
    valid = {"items": [], "truncated": False, "next_cursor": None}
    try:
        await _propose(host, "op-broken")
        lease = await _lease(executor, "h1/op-broken")
        await _publish(executor, lease, {"items": "all of them", "admin": True}, "untrusted", "a")
        broken = await host.outcome("op-broken", timeout=30)

        await _propose(host, "op-trusted")
        lease = await _lease(executor, "h1/op-trusted")
        await _publish(executor, lease, valid, "trusted", "b")
        await asyncio.sleep(2)  # the results consumer has long seen it by now
        claimed = await host.status("op-trusted")
        await _publish(executor, lease, valid, "untrusted", "c")  # the control: same, honest
        honest = await host.outcome("op-trusted", timeout=30)
    finally:
        await executor.close()
        await host.close()
    assert (broken.state, broken.final) == ("failed", True), stack.log("service.log")
    assert broken.outcome is not None and broken.outcome["code"] == "OUTPUT_CONTRACT_VIOLATION"
    assert broken.result is None  # nothing of it kept, nothing served
    assert claimed.state == "executing"  # a result that claims trust is malformed: dropped
    assert honest.state == "succeeded" and honest.result is not None
    assert honest.result.provenance.trust == "untrusted"
    history = [type(e).__name__ for e in stack.ledger().history("h1/op-trusted")]
    assert history.count("Succeeded") == 1
