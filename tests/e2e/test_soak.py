"""A soak of the runtime: e-mails over a provider that hangs past the timeout, an
executor SIGKILLed mid-run and replaced, reads retried with the provider's backoff, and
cancels landing before the lease, mid-run and after the outcome, all at once, on a real
nats-server with the ledger service on each storage backend. It prints its figures.

What must hold: no operation lost, none stuck (each ends final, or `needs_resolution`
with its reason recorded), exactly one send per e-mail that succeeded and none for one
that did not, every retry no sooner than its backoff, and every cancel answered.
`OPLEDGER_SOAK_SCALE` multiplies the counts (1 in the suite).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from executors.samples.email import (
    CRASH_AFTER_SEND_ENV,
    SEND_HANG_ENV,
    count_messages,
    count_send_requests,
    count_sends,
)
from ledger.client import AgentHostClient
from ledger.nats import connect_as
from schemas import OperationStatus, RuntimeContext, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack
from tests.previews import await_preview

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(420)]

SCALE = max(int(os.environ.get("OPLEDGER_SOAK_SCALE", "1")), 1)
MAILS = 24 * SCALE
READS = 24 * SCALE
EMAIL, READ = "send_customer_email", "query_orders"
USERS = 8
"""Requesters: the contracts' per-user budgets must not interfere at any scale."""


def _support(n: int) -> RuntimeContext:
    return RuntimeContext(principal=f"sam-{n % USERS}", tenant="acme",
                          capabilities=frozenset({"email:send"}))


def _reader(n: int) -> RuntimeContext:
    return RuntimeContext(principal=f"rita-{n % USERS}", tenant="acme",
                          capabilities=frozenset({"orders:read"}))
SETTLE_S = 240.0


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    # Short ack wait and lease grace: a killed executor's items come back, and its
    # leases run out, within seconds.
    with backend_stack(tmp_path, request.param, hosts=["h1"], tools=[EMAIL, READ],
                       service_options=["--ack-wait", "4", "--lease-grace", "2"]) as running:
        yield running


def _settled(status: OperationStatus) -> bool:
    return status.final or status.state == "needs_resolution"


async def test_soak_none_lost_none_stuck_one_send_each(stack: BackendStack) -> None:
    rng = random.Random(20261201)
    hung = stack.start_executor(EMAIL, "--progress-every", "0.5", "--batch", "4",
                                **{SEND_HANG_ENV: "7"})
    healthy = stack.start_executor(EMAIL, "--progress-every", "0.5")
    # Dies right after its first send, before publishing or acking (like a SIGKILL at the
    # worst moment); replaced by a healthy one.
    crashing = stack.start_executor(EMAIL, "--progress-every", "0.5",
                                    **{CRASH_AFTER_SEND_ENV: "1"})
    for _ in range(2):
        stack.start_executor(READ, "--progress-every", "0.3",
                             spec="tests.e2e.soak_tool:soak_query_orders")
    host = AgentHostClient(await connect_as(stack.server.url, stack.credentials.host("h1")),
                           "h1", timeout=10)
    ledger = stack.ledger()
    started = time.monotonic()
    settled_at: dict[str, float] = {}
    cancels: dict[str, str] = {}
    try:
        async def mail(n: int) -> None:
            operation_id = f"mail-{n:04d}"
            proposal = ToolProposal(
                proposal_id=f"p-{operation_id}", conversation_id=f"c-{n}",
                requested_by_user_id=f"sam-{n % USERS}", tool_name=EMAIL,
                operation_id=operation_id,
                arguments={"recipient_ids": [f"cus-{1 + n % 500:04d}"],
                           "template": "support_received", "variables": {"ticket_id": f"TCK-{n}"}},
            )
            reply = await host.propose(proposal, _support(n), attempts=5)
            assert reply.decision is not None
            shown = await await_preview(ledger, f"h1/{operation_id}", timeout=300)
            await asyncio.to_thread(
                ledger.approve, f"h1/{operation_id}", approver="lead",
                approver_roles=["support_lead"], proposal_hash=reply.decision.proposal_hash or "",
                preview_hash=shown,
            )

        async def read(n: int) -> None:
            operation_id = f"read-{n:04d}"
            proposal = ToolProposal(
                proposal_id=f"p-{operation_id}", conversation_id=f"r-{n}",
                requested_by_user_id=f"rita-{n % USERS}", tool_name=READ,
                operation_id=operation_id,
                arguments={"limit": 5},
            )
            await host.propose(proposal, _reader(n), attempts=5)
            if n % 3 == 0:
                # Before the lease, during attempt 1's backoff, mid-run, or after.
                await asyncio.sleep(rng.uniform(0.0, 6.0))
                cancels[operation_id] = (await host.cancel(operation_id)).state

        async def kill_midway() -> None:
            nonlocal healthy
            await asyncio.sleep(4.0)
            os.kill(healthy.pid, signal.SIGKILL)
            await asyncio.to_thread(healthy.wait)
            healthy = stack.start_executor(EMAIL, "--progress-every", "0.5")
            exit_code = await asyncio.to_thread(crashing.wait, 60)
            assert exit_code == 137, "the crashing executor never sent"
            stack.start_executor(EMAIL, "--progress-every", "0.5")

        await asyncio.gather(*(mail(n) for n in range(MAILS)), *(read(n) for n in range(READS)),
                             kill_midway())
        pending = {f"mail-{n:04d}" for n in range(MAILS)} | {f"read-{n:04d}" for n in range(READS)}
        statuses: dict[str, OperationStatus] = {}
        deadline = time.monotonic() + SETTLE_S
        while pending and time.monotonic() < deadline:
            for operation_id in sorted(pending):
                status = await host.status(operation_id)
                if _settled(status):
                    statuses[operation_id] = status
                    settled_at[operation_id] = time.monotonic() - started
                    pending.discard(operation_id)
            await asyncio.sleep(0.5)
    finally:
        await host.close()
    elapsed = time.monotonic() - started
    assert not pending, (sorted(pending)[:10], stack.log("service.log"))
    assert hung.poll() is None  # the hung executor lived through it

    history: dict[str, list[Any]] = {op: ledger.history(f"h1/{op}") for op in statuses}
    kinds = Counter(type(e).__name__ for events in history.values() for e in events)
    states = Counter(status.state for status in statuses.values())
    mails = {op: s for op, s in statuses.items() if op.startswith("mail-")}
    reads = {op: s for op, s in statuses.items() if op.startswith("read-")}
    db = stack.email_db

    # None stuck: final, or needing a person with the reason recorded.
    for op, status in statuses.items():
        if status.state == "needs_resolution":
            assert type(history[op][-1]).__name__ == "ResolutionNeeded", op
    # Exactly one send per e-mail that succeeded, none for one that did not, and the
    # provider was never asked to send one twice.
    for op, status in mails.items():
        sends, asked = count_sends(db, f"h1/{op}"), count_send_requests(db, f"h1/{op}")
        assert asked <= 1, (op, asked)
        if status.state == "succeeded":
            assert (sends, count_messages(db, f"h1/{op}")) == (1, 1), op
        elif status.state in ("failed", "cancelled"):
            assert sends == 0, (op, status.state, sends)
        assert [type(e).__name__ for e in history[op]].count("LeaseClaimed") == 1, op
    assert kinds["LeaseExpired"] >= 1  # the crash at the worst moment did happen
    assert kinds["ReconciliationInconclusive"] >= 1  # and a send hung past its timeout
    # Every retry waited for its backoff; every cancel was answered.
    for op, status in reads.items():
        events = history[op]
        for retry in (e for e in events if type(e).__name__ == "RetryScheduled"):
            later = [e for e in events if type(e).__name__ == "LeaseClaimed"
                     and e.attempt == retry.after_attempt + 1]
            assert all(e.timestamp >= retry.not_before for e in later), op
        if op in cancels:
            assert status.state == "cancelled" or status.cancel == "too_late", (op, status)
        else:
            assert (status.state, status.attempts) == ("succeeded", 2), (op, status)

    times = sorted(settled_at.values())
    unsent = {op: (s.state, (s.outcome or {}).get("code")) for op, s in mails.items()
              if s.state != "succeeded"}
    print(
        f"\nsoak ({'postgres' if stack.storage.is_postgres else 'sqlite'}): "
        f"{len(statuses)} operations in {elapsed:.1f} s; states {dict(states)}; "
        f"sends {count_sends(db)} for {sum(s.state == 'succeeded' for s in mails.values())}"
        f" e-mails succeeded; lookups inconclusive {kinds['ReconciliationInconclusive']},"
        f" reconciled {kinds['Reconciled']}, leases expired {kinds['LeaseExpired']},"
        f" retries {kinds['RetryScheduled']}, cancelled {kinds['Cancelled']},"
        f" too late {kinds['CancelTooLate']}, needing a person {kinds['ResolutionNeeded']};"
        f" settled p50 {times[len(times) // 2]:.1f} s, max {times[-1]:.1f} s;"
        f" e-mails not sent: {unsent}"
    )
