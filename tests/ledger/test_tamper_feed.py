"""On a real nats-server with the real ledger service: the feed witnesses what the store lost.

The service runs over SQLite and over PostgreSQL; an attacker of the database
deletes the newest events together with their seal rows and signatures.
Plain verification cannot tell (the store is consistent up to an older
head); `audit verify --against-feed`, as the auditor identity, names every
event the store lost. A kept result changed by hand is refused over NATS too.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ledger import StorageConfig
from ledger.client import AgentHostClient, RequestRefused
from ledger.nats import CredentialSet, NatsServer, connect_as, generate_credentials
from policy.catalog import CATALOG_DIR
from schemas import RuntimeContext, StatusRequest, Subjects, ToolProposal
from tests.conftest import drop_schema, postgres_storage_or_skip
from tests.ledger.helpers import cli, cli_json, use_storage

pytestmark = [pytest.mark.nats, pytest.mark.timeout(180)]

ALICE = RuntimeContext(
    principal="alice", tenant="acme", capabilities=frozenset({"documents:search"})
)
TOOL = "search_documents"


@dataclass
class Stack:
    """nats-server, the ledger service and one executor, over one storage."""

    home: Path
    storage: StorageConfig
    server: NatsServer
    credentials: CredentialSet
    processes: list[subprocess.Popen[bytes]]

    def log(self, name: str) -> str:
        path = self.home / name
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def _start(home: Path, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
    log = (home / name).open("wb")
    return subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


async def _answers(stack: Stack) -> bool:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"),
                          allow_reconnect=False, connect_timeout=2)
    try:
        request = StatusRequest(operation_id="probe").model_dump_json().encode()
        await nc.request(Subjects.status("h1"), request, timeout=1)
        return True
    except Exception:
        return False
    finally:
        await nc.close()


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    if request.param == "sqlite":
        storage = StorageConfig.sqlite(tmp_path / "ledger.db")
        database = ["--database", str(storage.sqlite_path)]
    else:
        storage = postgres_storage_or_skip()
        database = ["--database", storage.postgres_dsn or "",
                    "--postgres-schema", storage.postgres_schema]
    credentials = generate_credentials(tmp_path / "creds", hosts=["h1"], tools=[TOOL])
    server = NatsServer(tmp_path / "nats", authorization=credentials.authorization_config)
    server.start()
    processes = [
        _start(tmp_path, "service.log", [
            "-m", "ledger.server", *database, "--nats-url", server.url,
            "--creds", str(credentials.ledger.seed_path), "--tools", TOOL,
        ]),
    ]
    running = Stack(tmp_path, storage, server, credentials, processes)
    try:
        deadline = time.monotonic() + 20
        while not asyncio.run(_answers(running)):
            assert processes[0].poll() is None, running.log("service.log")
            assert time.monotonic() < deadline, running.log("service.log")
            time.sleep(0.2)
        processes.append(_start(tmp_path, "executor.log", [
            "-m", "executors", "run", "executors.samples.documents:search_documents",
            "--creds", str(credentials.executor(TOOL).seed_path), "--nats-url", server.url,
            "--contracts", str(CATALOG_DIR), "--name", "exec-0",
        ]))
        yield running
    finally:
        for process in reversed(processes):
            _stop(process)
        server.stop()
        if storage.is_postgres:
            drop_schema(storage)


async def _run_searches(stack: Stack, names: list[str]) -> None:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1", timeout=5)
    try:
        for name in names:
            await host.propose(
                ToolProposal(proposal_id=f"p-{name}", conversation_id="c",
                             requested_by_user_id="alice", tool_name=TOOL,
                             arguments={"query": f"refund policy {name}"}, operation_id=name),
                ALICE,
            )
        for name in names:
            status = await host.outcome(name, timeout=60)
            assert status.state == "succeeded", stack.log("executor.log")
    finally:
        await host.close()


async def _status_error(stack: Stack, name: str) -> RequestRefused:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1", timeout=5)
    try:
        with pytest.raises(RequestRefused) as refused:
            await host.status(name)
        return refused.value
    finally:
        await host.close()


def _settled(capsys: Any, trust: tuple[str, ...], *, feed: tuple[str, ...] = ()) -> Any:
    """Wait until the service has sealed everything (and the feed has it all)."""
    deadline = time.monotonic() + 30
    while True:
        code, out, err = cli(capsys, "audit", "verify", *trust, *feed, "--json")
        report = __import__("json").loads(out) if out else {}
        if (
            code == 0
            and report["events_past_signed_head"] == 0
            and (not feed or report["feed_events_checked"] >= report["events_checked"])
        ):
            return report
        assert time.monotonic() < deadline, (code, out, err)
        time.sleep(0.3)


def test_the_feed_names_the_newest_events_deleted_with_their_seal(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    use_storage(monkeypatch, tmp_path / "auditor", stack.storage)
    trust = ("--public-key", stack.credentials.ledger.public_key)
    feed = ("--against-feed", "--nats-url", stack.server.url,
            "--creds", str(stack.credentials.auditor().seed_path))

    asyncio.run(_run_searches(stack, ["op-a", "op-b"]))
    first = _settled(capsys, trust)
    cut = first["signed_head"]["position"]
    asyncio.run(_run_searches(stack, ["op-c"]))
    everything = _settled(capsys, trust, feed=feed)
    assert everything["ok"] and everything["signed_head"]["position"] > cut

    # The attack: the newest events go, with their seal rows and signatures, their
    # view row and their kept result: what is left is a consistent, older ledger.
    from ledger.bootstrap import build_ledger

    ledger = build_ledger(stack.storage)
    try:
        column = "notification_id" if ledger.db.is_postgres else "rowid"
        deleted = ledger.db.query(
            f"SELECT originator_id, originator_version FROM {ledger.events_table}"
            f" WHERE {column} > ? ORDER BY {column}",
            (cut,),
        )
        assert {operation for operation, _ in deleted} == {"h1/op-c"}
        ledger.db.execute(f"DELETE FROM {ledger.events_table} WHERE {column} > ?", (cut,))
        ledger.db.execute("DELETE FROM opledger_digest WHERE notification_id > ?", (cut,))
        ledger.db.execute("DELETE FROM opledger_seal_signatures WHERE position > ?", (cut,))
        ledger.db.execute("DELETE FROM opledger_operations WHERE operation_id = 'h1/op-c'")
        ledger.db.execute("DELETE FROM opledger_results WHERE operation_id = 'h1/op-c'")
        ledger.db.execute("UPDATE opledger_positions SET position = ?", (cut,))
    finally:
        ledger.close()

    plain = cli_json(capsys, "audit", "verify", *trust)
    assert plain["ok"] is True  # the store alone cannot tell
    assert plain["signed_head"]["position"] == cut

    code, out, err = cli(capsys, "audit", "verify", *trust, *feed)
    assert code == 1, (out, err)
    extra = [line.strip() for line in out.splitlines() if line.strip().startswith("feed_extra")]
    assert len(extra) == len(deleted)
    for (operation, version), line in zip(deleted, extra, strict=True):
        assert f" {operation} v{version}: on the feed (message " in line
        assert line.endswith("not in the store")


def test_an_altered_kept_result_is_refused_over_nats(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    asyncio.run(_run_searches(stack, ["op-r"]))
    from ledger.bootstrap import build_ledger

    ledger = build_ledger(stack.storage)
    try:
        ((reference, text),) = ledger.db.query(
            "SELECT result_ref, envelope FROM opledger_results WHERE operation_id = 'h1/op-r'"
        )
        ledger.db.execute(
            "UPDATE opledger_results SET envelope = ? WHERE result_ref = ?",
            (text.replace('"truncated":false', '"truncated":true'), reference),
        )
    finally:
        ledger.close()

    refused = asyncio.run(_status_error(stack, "op-r"))
    assert (refused.code, refused.category.value) == ("RESULT_INTEGRITY", "INTERNAL")

    use_storage(monkeypatch, tmp_path / "auditor", stack.storage)
    code, out, _ = cli(capsys, "audit", "verify",
                       "--public-key", stack.credentials.ledger.public_key)
    assert code == 1
    assert "result_mismatch: " in out and reference in out
