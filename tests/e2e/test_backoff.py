"""A retry waits for its backoff end to end: on a real nats-server, the ledger service
on each storage backend, and an executor whose provider answers "retry after 1.5 s".

Before: the ledger recorded `RetryScheduled.not_before` and leased attempt 2 at once.
Now the lease answers `busy` with `not_before`, and the executor puts the work item
back (a delayed nak) until then: one redelivery, not a spin.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ledger.client import AgentHostClient
from ledger.nats import connect_as
from schemas import WORK_STREAM, RuntimeContext, ToolProposal, work_consumer
from tests.e2e.conftest import BackendStack, backend_stack
from tests.e2e.flaky_tool import RETRY_AFTER_MS

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

READER = RuntimeContext(principal="alice", tenant="acme",
                        capabilities=frozenset({"orders:read"}))


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path, request.param, hosts=["h1"], tools=["query_orders"]) as running:
        running.start_executor("query_orders", spec="tests.e2e.flaky_tool:flaky_query_orders")
        yield running


async def test_a_retry_is_run_after_the_tools_retry_after_and_not_spun(
    stack: BackendStack,
) -> None:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    try:
        proposal = ToolProposal(
            proposal_id="p-retry", conversation_id="c-1", requested_by_user_id="alice",
            tool_name="query_orders", arguments={"limit": 10}, operation_id="op-retry",
        )
        assert (await host.propose(proposal, READER)).state == "ready"
        status = await host.outcome("op-retry", timeout=60)
    finally:
        await host.close()
    log = stack.log("executor-query_orders-0.log")
    assert (status.state, status.attempts) == ("succeeded", 2), log
    history = stack.ledger().history("h1/op-retry")
    scheduled = next(e for e in history if type(e).__name__ == "RetryScheduled")
    second = next(
        e for e in history if type(e).__name__ == "LeaseClaimed" and e.attempt == 2
    )
    # The provider's Retry-After (1.5 s) beat the contract's backoff (500 ms) ...
    assert scheduled.not_before - scheduled.timestamp >= timedelta(milliseconds=RETRY_AFTER_MS)
    # ... and attempt 2 was leased no sooner, yet without stalling behind it.
    assert second.timestamp >= scheduled.not_before
    assert second.timestamp - scheduled.not_before < timedelta(seconds=3), log
    ledger_nc = await connect_as(stack.server.url, stack.credentials.ledger)
    try:
        info = await ledger_nc.jetstream().consumer_info(WORK_STREAM, work_consumer("query_orders"))
    finally:
        await ledger_nc.close()
    # Attempt 1's item, attempt 2's item, and that one put back once or twice.
    assert 3 <= info.delivered.consumer_seq <= 4, info.delivered
