"""A person settles an unknown outcome, or cancels, and the host hears of it, over a real
nats-server with the ledger service on each storage backend.

Before: an operation whose executor vanished mid-call stayed `outcome_unknown`
(`final=False`) for good, and the host's `outcome()` only timed out.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.client import AgentHostClient, OperatorClient, RequestRefused
from ledger.nats import connect_as
from schemas import LeaseDecision, LeaseReply, LeaseRequest, RuntimeContext, Subjects, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

ALICE = RuntimeContext(principal="alice", tenant="acme",
                       capabilities=frozenset({"documents:search"}))
TOOL = "search_documents"


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path, request.param, hosts=["h1"], tools=[TOOL],
                       service_options=["--lease-grace", "0.5"]) as running:
        yield running  # no executor: the one that leased the work vanishes


def _as_operator(stack: BackendStack) -> list[str]:
    seed = stack.credentials.operator("ops-lead").seed_path
    return ["--operator", "ops-lead", "--seed", str(seed), "--nats-url", stack.server.url]


def _database(stack: BackendStack) -> list[str]:
    storage = stack.storage
    if storage.sqlite_path is not None:
        return ["--database", str(storage.sqlite_path)]
    return ["--database", storage.postgres_dsn or "", "--postgres-schema", storage.postgres_schema]


async def test_the_host_gets_the_outcome_a_person_settled(stack: BackendStack) -> None:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    executor = await connect_as(stack.server.url, stack.credentials.executor(TOOL))
    try:
        proposal = ToolProposal(
            proposal_id="p-gone", conversation_id="c-1", requested_by_user_id="alice",
            tool_name=TOOL, arguments={"query": "refund policy"}, operation_id="op-gone",
        )
        assert (await host.propose(proposal, ALICE)).state == "ready"
        request = LeaseRequest(operation_id="h1/op-gone", executor="vanishing-executor")
        answer = await executor.request(
            Subjects.lease(TOOL), request.model_dump_json().encode(), timeout=10
        )
        assert LeaseReply.model_validate_json(answer.data).decision is LeaseDecision.EXECUTE
        for _ in range(100):  # the lease runs out (2 s timeout + 0.5 s grace), swept
            if (await host.status("op-gone")).state == "outcome_unknown":
                break
            await asyncio.sleep(0.2)
        assert (await host.status("op-gone")).final is False
        done = subprocess.run(
            [sys.executable, "-m", "ledger.entrypoints", *_database(stack), "ops", "resolve",
             "h1/op-gone", "--not-applied", *_as_operator(stack),
             "--reason", "the provider has no record of it"],
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert done.returncode == 0, done.stderr
        status = await host.outcome("op-gone", timeout=30)
    finally:
        await executor.close()
        await host.close()
    assert (status.state, status.final) == ("failed", True), stack.log("service.log")
    assert status.outcome is not None and status.outcome["code"] == "NOT_APPLIED"
    settled = stack.ledger().history("h1/op-gone")[-1]
    assert (type(settled).__name__, settled.by) == ("Reconciled", "operator:ops-lead")


async def test_the_host_gets_the_outcome_of_a_cancel_before_the_lease(
    stack: BackendStack,
) -> None:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    try:
        proposal = ToolProposal(
            proposal_id="p-cancel", conversation_id="c-1", requested_by_user_id="alice",
            tool_name=TOOL, arguments={"query": "refund policy"}, operation_id="op-cancel",
        )
        assert (await host.propose(proposal, ALICE)).state == "ready"
        done = subprocess.run(
            [sys.executable, "-m", "ledger.entrypoints", *_database(stack), "ops", "cancel",
             "h1/op-cancel", *_as_operator(stack), "--reason", "no longer needed"],
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert done.returncode == 0, done.stderr
        status = await host.outcome("op-cancel", timeout=30)
    finally:
        await host.close()
    assert (status.state, status.final) == ("cancelled", True), stack.log("service.log")
    assert status.outcome == {"status": "cancelled", "by": "operator:ops-lead"}


async def test_an_operator_settles_it_over_nats_with_its_own_identity(
    stack: BackendStack,
) -> None:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    executor = await connect_as(stack.server.url, stack.credentials.executor(TOOL))
    operator = OperatorClient(
        await connect_as(stack.server.url, stack.credentials.operator("ops-lead")), "ops-lead"
    )
    try:
        proposal = ToolProposal(
            proposal_id="p-op", conversation_id="c-1", requested_by_user_id="alice",
            tool_name=TOOL, arguments={"query": "refund policy"}, operation_id="op-op",
        )
        assert (await host.propose(proposal, ALICE)).state == "ready"
        # Not unknown yet: refused, with the error envelope, nothing appended.
        before = len(stack.ledger().history("h1/op-op"))
        with pytest.raises(RequestRefused) as refused:
            await operator.resolve("h1/op-op", applied=True, reason="too early")
        assert refused.value.code == "ILLEGAL_TRANSITION"
        assert len(stack.ledger().history("h1/op-op")) == before
        request = LeaseRequest(operation_id="h1/op-op", executor="vanishing-executor")
        await executor.request(Subjects.lease(TOOL), request.model_dump_json().encode(),
                               timeout=10)
        for _ in range(100):
            if (await host.status("op-op")).state == "outcome_unknown":
                break
            await asyncio.sleep(0.2)
        settled = await operator.resolve("h1/op-op", applied=False,
                                         reason="the provider has no record of it")
        assert (settled.state, settled.final) == ("failed", True)
        status = await host.outcome("op-op", timeout=30)
    finally:
        await operator.close()
        await executor.close()
        await host.close()
    assert status.outcome is not None and status.outcome["code"] == "NOT_APPLIED"
    event = stack.ledger().history("h1/op-op")[-1]
    assert (type(event).__name__, event.by) == ("Reconciled", "operator:ops-lead")
