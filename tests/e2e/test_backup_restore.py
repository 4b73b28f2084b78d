"""operations.md's backup, as written: an online copy of the SQLite ledger
(`sqlite3 ... ".backup ..."`) while the stack runs, `opledger audit verify` of the
copy, then a restore over a ledger that had moved on. The e-mail sent after the
copy is `ready` again in the restored ledger, is dispatched again, and its executor
meets the same operation ID: still one e-mail, and the ledger converges on it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from executors.samples.email import count_send_requests, count_sends
from ledger import StorageConfig
from ledger.client import AgentHostClient, ApproverClient
from ledger.nats import connect_as
from schemas import RuntimeContext, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack
from tests.previews import await_preview

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(240)]

ALICE = RuntimeContext(principal="alice", tenant="acme", capabilities=frozenset({"email:send"}))
EMAIL = "send_customer_email"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(
        tmp_path / "stack", "sqlite", hosts=["h1"], tools=[EMAIL],
        approvers={"lead": ["support_lead"]},
        # A ready call with no work item queued is sent again after 2 s (default 60).
        service_options=["--redispatch-after", "2"],
    ) as running:
        yield running


def _backup(database: Path, copy: Path) -> None:
    """operations.md's command for the embedded default (Python's own backup API where
    the `sqlite3` command is not installed: the same online copy)."""
    if shutil.which("sqlite3") is not None:
        subprocess.run(["sqlite3", str(database), f".backup '{copy}'"], check=True, timeout=60)
    else:
        with (
            contextlib.closing(sqlite3.connect(database)) as source,
            contextlib.closing(sqlite3.connect(copy)) as target,
        ):
            source.backup(target)


def _kinds_in(database: Path, operation_id: str) -> list[str]:
    """The kinds of an operation's stored events, read from the file itself."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        rows = db.execute(
            f"SELECT topic FROM {StorageConfig.sqlite(database).events_table}"
            " WHERE originator_id = ?"
            " ORDER BY originator_version", (operation_id,),
        ).fetchall()
    return [str(topic).rsplit(".", 1)[-1] for (topic,) in rows]


def _verify(database: Path, public_key: str) -> subprocess.CompletedProcess[str]:
    """`opledger audit verify` of `database`, trusting the service's seal key."""
    return subprocess.run(
        [sys.executable, "-m", "ledger.entrypoints", "audit", "verify", "--database",
         str(database), "--public-key", public_key],
        capture_output=True, text=True, timeout=120,
    )


async def _previewed_email(host: AgentHostClient, stack: BackendStack, op: str) -> tuple[str, str]:
    """Propose an e-mail as host h1; its proposal hash and, once its executor previewed
    it, its preview hash."""
    reply = await host.propose(
        ToolProposal(
            proposal_id=f"p-{op}", conversation_id="c-1", requested_by_user_id="alice",
            tool_name=EMAIL, operation_id=op,
            arguments={"recipient_ids": ["cus-0001"], "template": "support_received",
                       "variables": {"ticket_id": "TCK-42"}},
        ),
        ALICE,
    )
    assert reply.state == "awaiting_approval" and reply.decision is not None
    return reply.decision.proposal_hash or "", await await_preview(stack.ledger(), f"h1/{op}")


async def _approve(stack: BackendStack, op: str, hashes: tuple[str, str]) -> None:
    nc = await connect_as(stack.server.url, stack.credentials.approver("lead"))
    approver = ApproverClient(nc, "lead")
    try:
        await approver.approve(f"h1/{op}", proposal_hash=hashes[0], preview_hash=hashes[1])
    finally:
        await approver.close()


async def test_a_restored_backup_verifies_and_converges_on_one_send(
    stack: BackendStack, tmp_path: Path
) -> None:
    database = stack.storage.sqlite_path
    assert database is not None
    executor = stack.start_executor(EMAIL)
    host = AgentHostClient(await connect_as(stack.server.url, stack.credentials.host("h1")), "h1")
    try:
        await _approve(stack, "op-before", await _previewed_email(host, stack, "op-before"))
        assert (await host.outcome("op-before", timeout=60)).state == "succeeded"

        # The second e-mail is approved while its executor is paused, before it can send:
        # the copy is taken with it `ready`, while the stack runs.
        hashes = await _previewed_email(host, stack, "op-after")
        os.kill(executor.pid, signal.SIGSTOP)
        try:
            await _approve(stack, "op-after", hashes)
            copy = tmp_path / "ledger-backup.db"
            _backup(database, copy)
        finally:
            os.kill(executor.pid, signal.SIGCONT)
        assert _kinds_in(copy, "h1/op-after")[-2:] == ["ApprovalGranted", "Readied"]
        verified = _verify(copy, stack.credentials.ledger.public_key)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert (await host.outcome("op-after", timeout=60)).state == "succeeded"
        assert count_sends(stack.email_db, "h1/op-after") == 1

        # The disaster: the ledger is replaced by the copy, which knows nothing of the send.
        def restore() -> None:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{database}{suffix}").unlink(missing_ok=True)
            shutil.copy(copy, database)

        await asyncio.to_thread(stack.restart_service, restore)

        # Dispatched again: the executor meets the same operation ID, and the provider's
        # record of it. One e-mail, and the ledger converges on it.
        deadline = asyncio.get_running_loop().time() + 90
        while True:
            ledger = stack.ledger()
            try:
                state = ledger.get("h1/op-after").state.value
            finally:
                ledger.close()
            if state not in ("ready", "executing"):
                break
            assert asyncio.get_running_loop().time() < deadline, stack.log("service.log")
            await asyncio.sleep(0.5)
        assert state == "succeeded", stack.log("service.log")
        # It ran again in the restored ledger (one new lease), and the executor found the
        # e-mail sent under its key: reported, not sent again.
        assert _kinds_in(database, "h1/op-after")[-3:] == ["Readied", "LeaseClaimed", "Succeeded"]
        assert count_sends(stack.email_db, "h1/op-after") == 1
        assert count_send_requests(stack.email_db, "h1/op-after") == 1
        assert count_sends(stack.email_db, "h1/op-before") == 1
        after = _verify(database, stack.credentials.ledger.public_key)
        assert after.returncode == 0, after.stdout + after.stderr
    finally:
        await host.close()

