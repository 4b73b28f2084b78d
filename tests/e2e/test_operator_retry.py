"""An operator runs a failed call again, as their own identity over NATS: `ops retry`.

A call failed for a reason no retry policy retries (the provider's key was
revoked); the operator fixes the cause and retries it. The failed operation
keeps the final outcome the host was told; the retry runs as a new operation
(`op-key-r1`) for the same caller, checked afresh, linked both ways, recorded
with who and why, and its outcome is announced to the host. Someone holding
another identity's seed cannot retry in the operator's name, and a second
retry of the same failure is refused.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.client import AgentHostClient
from ledger.nats import Role, connect_as
from schemas import RuntimeContext, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

READER = RuntimeContext(
    principal="alice", tenant="acme", capabilities=frozenset({"orders:read"})
)


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path, request.param, hosts=["h1"], tools=["query_orders"]) as running:
        running.start_executor(
            "query_orders",
            spec="tests.e2e.flaky_tool:revoked_key_query_orders",
            OPLEDGER_TEST_KEY_ROTATED=str(tmp_path / "key-rotated"),
        )
        yield running


def _cli(stack: BackendStack, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ledger.entrypoints", "--home", str(stack.home), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _as(stack: BackendStack, seed: Path) -> list[str]:
    return ["--operator", "ops-lead", "--seed", str(seed), "--nats-url", stack.server.url]


async def test_an_operator_retries_a_failed_call_as_themselves(stack: BackendStack) -> None:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    try:
        proposal = ToolProposal(
            proposal_id="p-key", conversation_id="c-1", requested_by_user_id="alice",
            tool_name="query_orders", arguments={"limit": 10}, operation_id="op-key",
        )
        assert (await host.propose(proposal, READER)).state == "ready"
        failed = await host.outcome("op-key", timeout=60)
        assert (failed.state, failed.final) == ("failed", True)
        assert failed.outcome is not None and failed.outcome["code"] == "PROVIDER_KEY_REVOKED"

        # Another identity's seed, claiming the operator's name: the broker refuses the
        # publish on ops.operate.ops-lead, and nothing is recorded.
        auditor_seed = stack.credentials.get(Role.AUDITOR, "auditor").seed_path
        forged = _cli(stack, "ops", "retry", "h1/op-key", *_as(stack, auditor_seed),
                      "--reason", "not mine to retry")
        assert forged.returncode == 2, forged.stdout
        assert "NOT_THIS_IDENTITY" in forged.stderr and "Traceback" not in forged.stderr

        # The operator rotates the key, then retries as their own identity.
        (stack.home / "key-rotated").touch()
        seed = stack.credentials.operator("ops-lead").seed_path
        done = _cli(stack, "ops", "retry", "h1/op-key", *_as(stack, seed),
                    "--reason", "key rotated")
        assert done.returncode == 0, done.stderr
        assert "retry h1/op-key as operator:ops-lead: runs again as h1/op-key-r1" in done.stdout
        again = await host.outcome("op-key-r1", timeout=60)
        assert (again.state, again.final) == ("succeeded", True), stack.log(
            "exec-query_orders-0.log"
        )
        # What the host was told stays true.
        assert (await host.status("op-key")).state == "failed"

        # The same failure twice: refused in one line, naming the retry.
        twice = _cli(stack, "ops", "retry", "h1/op-key", *_as(stack, seed),
                     "--reason", "once more")
        assert twice.returncode == 2 and "ILLEGAL_TRANSITION" in twice.stderr
        assert "h1/op-key-r1" in twice.stderr and "Traceback" not in twice.stderr
        # A reason longer than the wire allows: one line, not a traceback.
        long = _cli(stack, "ops", "retry", "h1/op-key-r1", *_as(stack, seed),
                    "--reason", "x" * 600)
        assert long.returncode == 2 and "Traceback" not in long.stderr, long.stderr
    finally:
        await host.close()
    ledger = stack.ledger()
    original = [type(e).__name__ for e in ledger.history("h1/op-key")]
    assert original[-1] == "RetryProposed" and original.count("LeaseClaimed") == 1
    noted = ledger.history("h1/op-key")[-1]
    assert (noted.retry_id, noted.by, noted.reason, noted.via) == (
        "h1/op-key-r1", "operator:ops-lead", "key rotated", "nats"
    )
    retried = ledger.history("h1/op-key-r1")
    first = retried[0]
    assert (first.retries, first.proposed_by, first.actor) == (
        "h1/op-key", "operator:ops-lead", "alice"
    )
    assert [type(e).__name__ for e in retried][-1] == "Succeeded"
