"""An executor process's stop, as `docs/operations.md` states it: the first SIGTERM lets
the item in progress finish and be recorded, a second abandons it (nothing published,
nothing acknowledged), the item is redelivered and the ledger decides. On a real
nats-server, the ledger service and executor processes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from ledger.client import AgentHostClient
from ledger.nats import connect_as
from tests.e2e.conftest import BackendStack, backend_stack
from tests.e2e.test_cancellation import TOOL, _kinds, _propose, _until_running

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

SLOW = "tests.e2e.slow_tool:slow_query_orders"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[BackendStack]:
    # Signals are the executor's business, not the storage's: one backend.
    with backend_stack(tmp_path, "sqlite", hosts=["h1"], tools=[TOOL]) as running:
        yield running


@pytest.fixture
async def host(stack: BackendStack) -> AsyncIterator[AgentHostClient]:
    client = AgentHostClient(await connect_as(stack.server.url, stack.credentials.host("h1")),
                             "h1")
    yield client
    await client.close()


async def _running(host: AgentHostClient, operation_id: str) -> None:
    await _propose(host, operation_id)
    await _until_running(host, operation_id)


async def _exit_code(process: subprocess.Popen[bytes], within_s: float) -> int:
    return await asyncio.to_thread(process.wait, within_s)


async def test_the_first_sigterm_lets_the_item_finish_and_be_recorded(
    stack: BackendStack, host: AgentHostClient
) -> None:
    executor = stack.start_executor(TOOL, spec=SLOW)  # each call takes 3.5 s
    await _running(host, "op-finish")
    executor.send_signal(signal.SIGTERM)
    assert await _exit_code(executor, 30) == 0, stack.log("executor-query_orders-0.log")
    status = await host.outcome("op-finish", timeout=10)
    assert (status.state, status.attempts) == ("succeeded", 1)
    assert _kinds(stack, "h1/op-finish").count("LeaseClaimed") == 1


async def test_a_second_sigterm_abandons_the_item_which_is_redelivered(
    stack: BackendStack, host: AgentHostClient
) -> None:
    # A call of 30 s: longer than the contract's 15 s timeout, so an executor that let
    # it run on would stop only after recording a timeout, a quarter of a minute later.
    executor = stack.start_executor(TOOL, spec=SLOW, OPLEDGER_TEST_SLOW_S="30")
    await _running(host, "op-abandon")
    executor.send_signal(signal.SIGTERM)
    await asyncio.sleep(1.0)
    assert executor.poll() is None  # the first signal waits for the item
    second = time.monotonic()
    executor.send_signal(signal.SIGTERM)
    assert await _exit_code(executor, 30) == 0
    stopped_after = time.monotonic() - second
    log = stack.log("executor-query_orders-0.log")
    assert stopped_after < 8, f"{stopped_after:.1f} s after the second signal: {log}"
    assert "abandoning 1 item(s) in progress" in log, log
    # Nothing of that attempt was recorded: no result was published.
    kinds = _kinds(stack, "h1/op-abandon")
    assert kinds[-1] == "LeaseClaimed", kinds
    # The item goes back to the consumer; another executor gets it, and the ledger
    # decides: busy while the abandoned attempt's lease holds, then a new attempt.
    stack.start_executor(TOOL)
    status = await host.outcome("op-abandon", timeout=60)
    assert (status.state, status.attempts) == ("succeeded", 2), _kinds(stack, "h1/op-abandon")
