"""On a real nats-server with the real ledger service: the feed witnesses what the store lost.

The service runs over SQLite and over PostgreSQL; an attacker of the database
deletes the newest events together with their seal rows and signatures.
Plain verification cannot tell (the store is consistent up to an older
head); `audit verify --against-feed`, as the auditor identity, names every
event the store lost. A kept result changed by hand is refused over NATS too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger.client import AgentHostClient, RequestRefused
from ledger.nats import connect_as
from schemas import RuntimeContext, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack
from tests.ledger.helpers import cli, cli_json, use_storage

pytestmark = [pytest.mark.nats, pytest.mark.timeout(180)]

ALICE = RuntimeContext(
    principal="alice", tenant="acme", capabilities=frozenset({"documents:search"})
)
TOOL = "search_documents"


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path, request.param, hosts=["h1"], tools=[TOOL]) as running:
        running.start_executor(TOOL)
        yield running


async def _run_searches(stack: BackendStack, names: list[str]) -> None:
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
            assert status.state == "succeeded", stack.log(f"executor-{TOOL}-0.log")
    finally:
        await host.close()


async def _status_error(stack: BackendStack, name: str) -> RequestRefused:
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
    stack: BackendStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
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
    stack: BackendStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
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
