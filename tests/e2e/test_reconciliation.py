"""Reconciliation as a runtime, on a real nats-server with the ledger service on each
storage backend and real executor processes over the fake e-mail provider.

Before: a write that timed out (the provider hung past the contract's 5 s) was
reported `outcome_unknown`, its work item acked, and nothing ever looked it up:
it stayed unknown, `final=False`, while the hung send did go through.

Now the unknown outcome queues a lookup item; the executor runs the tool's
`reconcile` by the operation's key; a lookup that cannot tell (the send is still
in flight) is repeated with backoff; after the contract's bound the operation
needs a person, the host is told, and `ops resolve` settles it.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from executors.samples.email import (
    SEND_HANG_ENV,
    FakeEmailProvider,
    count_send_requests,
    count_sends,
)
from ledger.client import AgentHostClient
from ledger.nats import connect_as
from policy.catalog import CATALOG_DIR
from schemas import OperationStatus, RuntimeContext, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack
from tests.previews import await_preview

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(150)]

SUPPORT = RuntimeContext(principal="alice", tenant="acme",
                         capabilities=frozenset({"email:send"}))
EMAIL = "send_customer_email"
ARGUMENTS = {"recipient_ids": ["cus-0001"], "template": "support_received",
             "variables": {"ticket_id": "TCK-42"}}


def _contracts(home: Path, max_rounds: int) -> Path:
    """The sample catalog, with the e-mail contract's lookups bounded at `max_rounds`."""
    target = home / "contracts"
    shutil.copytree(CATALOG_DIR, target, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    path = target / f"{EMAIL}.yaml"
    path.write_text(path.read_text().replace("max_rounds: 4", f"max_rounds: {max_rounds}"))
    return target


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def stack(backend: str, tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path, backend, hosts=["h1"], tools=[EMAIL]) as running:
        yield running


def _database(stack: BackendStack) -> list[str]:
    storage = stack.storage
    if storage.sqlite_path is not None:
        return ["--database", str(storage.sqlite_path)]
    return ["--database", storage.postgres_dsn or "", "--postgres-schema", storage.postgres_schema]


def _cli(stack: BackendStack, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ledger.entrypoints", *_database(stack), *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )


def _as_operator(stack: BackendStack) -> list[str]:
    seed = stack.credentials.operator("ops-lead").seed_path
    return ["--operator", "ops-lead", "--seed", str(seed), "--nats-url", stack.server.url]


async def _send(stack: BackendStack, host: AgentHostClient, operation_id: str) -> None:
    """Propose one e-mail and approve it, as the support lead would."""
    proposal = ToolProposal(
        proposal_id=f"p-{operation_id}", conversation_id="c-1", requested_by_user_id="alice",
        tool_name=EMAIL, arguments=ARGUMENTS, operation_id=operation_id,
    )
    reply = await host.propose(proposal, SUPPORT)
    assert reply.state == "awaiting_approval" and reply.decision is not None
    ledger = stack.ledger()
    ledger.approve(f"h1/{operation_id}", approver="lead", approver_roles=["support_lead"],
                   proposal_hash=reply.decision.proposal_hash or "",
                   preview_hash=await await_preview(ledger, f"h1/{operation_id}"))


def _history(stack: BackendStack, operation_id: str) -> list[tuple[str, str]]:
    return [(type(e).__name__, str(getattr(e, "code", "") or getattr(e, "reason", "")))
            for e in stack.ledger().history(operation_id)]


async def test_a_hung_send_is_reconciled_without_a_person_and_sent_once(
    stack: BackendStack,
) -> None:
    stack.start_executor(EMAIL, **{SEND_HANG_ENV: "8"})  # past the contract's 5 s
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    try:
        await _send(stack, host, "op-hung")
        status = await host.outcome("op-hung", timeout=90)
    finally:
        await host.close()
    history = _history(stack, "h1/op-hung")
    kinds = [kind for kind, _ in history]
    assert (status.state, status.final) == ("succeeded", True), (history, stack.log(
        "executor-send_customer_email-0.log"))
    assert status.outcome is not None and status.outcome.get("reconciled") is True
    # One send, and the provider was asked to send once: the lookups only looked.
    assert count_sends(stack.email_db, "h1/op-hung") == 1
    assert count_send_requests(stack.email_db, "h1/op-hung") == 1
    assert kinds.count("LeaseClaimed") == 1
    assert ("OutcomeUnknown", "the tool did not finish within 5000 ms") in history
    # While the send was in flight, a lookup could not tell, and said so.
    assert ("ReconciliationInconclusive", "RECONCILE_INCONCLUSIVE") in history, history
    assert kinds[-1] == "Reconciled" and "ResolutionNeeded" not in kinds


@pytest.fixture
def bounded(backend: str, tmp_path: Path) -> Iterator[BackendStack]:
    """The same stack, with the e-mail contract's lookups bounded at 2."""
    contracts = _contracts(tmp_path, max_rounds=2)
    with backend_stack(tmp_path / "stack", backend, hosts=["h1"], tools=[EMAIL],
                       contracts=contracts) as running:
        yield running


async def test_a_send_that_lookups_cannot_settle_needs_a_person_who_settles_it(
    bounded: BackendStack,
) -> None:
    stack = bounded
    stack.start_executor(EMAIL, **{SEND_HANG_ENV: "600"})  # in flight for the whole test
    notices: list[OperationStatus] = []
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1", on_attention=notices.append)
    try:
        await _send(stack, host, "op-stuck")
        for _ in range(300):
            if host.attention("op-stuck") is not None:
                break
            await asyncio.sleep(0.1)
        history = _history(stack, "h1/op-stuck")
        # The host heard, with a notice that is not final.
        assert [(n.state, n.final) for n in notices] == [("needs_resolution", False)], history
        assert (await host.status("op-stuck")).state == "needs_resolution"
        kinds = [kind for kind, _ in history]
        assert kinds.count("ReconciliationInconclusive") == 1  # lookup 1; lookup 2 gave up
        assert kinds[-1] == "ResolutionNeeded"
        # The operator finds it and settles it; the host's outcome() then returns.
        listed = _cli(stack, "--json", "ops", "list", "--state", "needs_resolution")
        assert listed.returncode == 0, listed.stderr
        assert [row["operation_id"] for row in orjson.loads(listed.stdout)] == ["h1/op-stuck"]
        # As the operator's own identity, over NATS: recorded as operator:ops-lead.
        done = _cli(stack, "ops", "resolve", "h1/op-stuck", "--not-applied",
                    *_as_operator(stack), "--reason", "the provider's support says it never left")
        assert done.returncode == 0, done.stderr
        status = await host.outcome("op-stuck", timeout=30)
    finally:
        await host.close()
    assert (status.state, status.final) == ("failed", True)
    assert status.outcome is not None and status.outcome["code"] == "NOT_APPLIED"
    # Leased once, never run again; the hung send is still in flight at the provider.
    assert [kind for kind, _ in _history(stack, "h1/op-stuck")].count("LeaseClaimed") == 1
    assert count_sends(stack.email_db, "h1/op-stuck") == 0
    assert FakeEmailProvider(stack.email_db).in_progress("h1/op-stuck")


async def test_an_executor_without_a_lookup_asks_for_a_person_at_once(
    stack: BackendStack,
) -> None:
    stack.start_executor(EMAIL, spec="tests.e2e.unreconcilable_tool:send_without_lookup")
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    try:
        await _send(stack, host, "op-blind")
        for _ in range(300):
            if host.attention("op-blind") is not None:
                break
            await asyncio.sleep(0.1)
    finally:
        await host.close()
    history = _history(stack, "h1/op-blind")
    assert history[-1] == ("ResolutionNeeded", "RECONCILE_UNSUPPORTED"), history
    assert [kind for kind, _ in history].count("ReconciliationInconclusive") == 0
    assert stack.ledger().history("h1/op-blind")[-1].rounds == 1
