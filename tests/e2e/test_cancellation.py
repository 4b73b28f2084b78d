"""Cancellation end to end: a host cancels its own operation over NATS, before the
lease, mid-run and after the outcome, and always hears the final outcome. On a real
nats-server, the ledger service on each storage backend, and executor processes.

Before: cancellation was a Python method only. No SDK call, subject or CLI; a running
executor was never told, and nothing confirmed a cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from ledger.client import AgentHostClient, RequestRefused
from ledger.nats import connect_as
from schemas import WORK_STREAM, RuntimeContext, ToolProposal, work_consumer
from tests.e2e.conftest import BackendStack, backend_stack

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

READER = RuntimeContext(principal="alice", tenant="acme",
                        capabilities=frozenset({"orders:read"}))
TOOL = "query_orders"
PROGRESS_S = 0.3
"""The executors' progress interval: how often a running call checks in."""


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path, request.param, hosts=["h1", "h2"], tools=[TOOL]) as running:
        yield running


@pytest.fixture
async def host(stack: BackendStack) -> AsyncIterator[AgentHostClient]:
    client = AgentHostClient(await connect_as(stack.server.url, stack.credentials.host("h1")),
                             "h1")
    yield client
    await client.close()


async def _propose(host: AgentHostClient, operation_id: str) -> None:
    proposal = ToolProposal(
        proposal_id=f"p-{operation_id}", conversation_id="c-1", requested_by_user_id="alice",
        tool_name=TOOL, arguments={"limit": 10}, operation_id=operation_id,
    )
    assert (await host.propose(proposal, READER)).state == "ready"


async def _until_running(host: AgentHostClient, operation_id: str) -> None:
    for _ in range(200):
        if (await host.status(operation_id)).state == "executing":
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{operation_id} never ran: {(await host.status(operation_id)).state}")


def _kinds(stack: BackendStack, operation_id: str) -> list[str]:
    return [type(e).__name__ for e in stack.ledger().history(operation_id)]


async def test_a_cancel_before_the_lease_is_final_and_nothing_runs(
    stack: BackendStack, host: AgentHostClient
) -> None:
    await _propose(host, "op-early")  # no executor yet: the item waits
    status = await host.cancel("op-early", reason="the user changed their mind")
    assert (status.state, status.final, status.outcome) == (
        "cancelled", True, {"status": "cancelled", "by": "host:h1"}
    )
    assert (await host.outcome("op-early", timeout=10)).state == "cancelled"
    # The executor that comes later gets the item, and the lease says done.
    stack.start_executor(TOOL, "--progress-every", str(PROGRESS_S))
    # Wait until the executor took the item and settled it (nothing pending or in
    # flight), so that "never leased" is not just "not yet looked at".
    ledger_nc = await connect_as(stack.server.url, stack.credentials.ledger)
    try:
        for _ in range(200):
            info = await ledger_nc.jetstream().consumer_info(WORK_STREAM, work_consumer(TOOL))
            if info.delivered.consumer_seq >= 1 and not info.num_pending \
                    and not info.num_ack_pending:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the executor never settled the item: {info}")
    finally:
        await ledger_nc.close()
    assert "LeaseClaimed" not in _kinds(stack, "h1/op-early")
    again = await host.cancel("op-early")  # asking again converges
    assert again.state == "cancelled" and _kinds(stack, "h1/op-early").count("Cancelled") == 1


async def test_a_cancel_mid_run_stops_a_tool_that_can_stop(
    stack: BackendStack, host: AgentHostClient
) -> None:
    stack.start_executor(TOOL, "--progress-every", str(PROGRESS_S),
                         spec="tests.e2e.cancellable_tool:cancellable_query_orders")
    await _propose(host, "op-stop")
    await _until_running(host, "op-stop")
    asked = await host.cancel("op-stop")
    assert (asked.state, asked.final, asked.cancel) == ("cancel_requested", False, "requested")
    status = await host.outcome("op-stop", timeout=30)
    assert (status.state, status.final) == ("cancelled", True), stack.log(
        "executor-query_orders-0.log")
    history = stack.ledger().history("h1/op-stop")
    requested = next(e for e in history if type(e).__name__ == "CancelRequested")
    cancelled = history[-1]
    assert (type(cancelled).__name__, cancelled.by) == ("Cancelled", "executor-query_orders-0")
    # Learnt at the next check-in, not at the end of the 20 s call.
    assert (cancelled.timestamp - requested.timestamp).total_seconds() < 5 * PROGRESS_S + 2
    assert "Succeeded" not in _kinds(stack, "h1/op-stop")


async def test_a_cancel_mid_run_of_a_tool_that_cannot_stop_is_too_late(
    stack: BackendStack, host: AgentHostClient
) -> None:
    stack.start_executor(TOOL, "--progress-every", str(PROGRESS_S),
                         spec="tests.e2e.slow_tool:slow_query_orders")
    await _propose(host, "op-late")
    await _until_running(host, "op-late")
    assert (await host.cancel("op-late")).cancel == "requested"
    status = await host.outcome("op-late", timeout=30)
    # The call ran to its end; the host sees what happened, and that the cancel was late.
    assert (status.state, status.final, status.cancel) == ("succeeded", True, "too_late")
    kinds = _kinds(stack, "h1/op-late")
    assert kinds[-2:] == ["CancelTooLate", "Succeeded"], kinds


async def test_a_cancel_after_the_outcome_is_too_late(
    stack: BackendStack, host: AgentHostClient
) -> None:
    stack.start_executor(TOOL, "--progress-every", str(PROGRESS_S))
    await _propose(host, "op-done")
    assert (await host.outcome("op-done", timeout=30)).state == "succeeded"
    status = await host.cancel("op-done")
    assert (status.state, status.final, status.cancel) == ("succeeded", True, "too_late")
    assert _kinds(stack, "h1/op-done")[-1] == "CancelTooLate"


async def test_a_host_cannot_cancel_another_hosts_operation(
    stack: BackendStack, host: AgentHostClient
) -> None:
    await _propose(host, "op-mine")
    before = _kinds(stack, "h1/op-mine")
    other = AgentHostClient(await connect_as(stack.server.url, stack.credentials.host("h2")),
                            "h2")
    try:
        with pytest.raises(RequestRefused) as refused:
            await other.cancel("op-mine")  # in h2's namespace: no such operation
    finally:
        await other.close()
    assert refused.value.code == "OPERATION_NOT_FOUND"
    assert _kinds(stack, "h1/op-mine") == before
    assert (await host.status("op-mine")).state == "ready"
