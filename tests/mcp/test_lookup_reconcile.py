"""`opledger executor mcp --lookup-tool`: what an MCP server's lookup says of a call
whose answer was lost, mapped to the executor's reconciliation. A real sample server
over Streamable HTTP, which runs on after the executor stops waiting for it; the
lookup answers by idempotency key, `unknown` while the call still runs."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from executors import ReconcileStatus, Reconciliation, Tool, ToolContext, ToolError
from ledger.mcp.executor import McpUpstream, mcp_tool
from tests.mcp.conftest import ROOT, _stop, wait_for_port
from tests.ports import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The sample server's URL, and the file where it records its effects."""
    home = tmp_path_factory.mktemp("lookup")
    effects, log, port = home / "effects.jsonl", home / "server.log", free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.mcp.sample_server", "--http", str(port)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SAMPLE_MCP_EFFECTS": str(effects)},
    )
    try:
        wait_for_port(port, server, log)
        yield f"http://127.0.0.1:{port}/mcp", effects
    finally:
        _stop(server)


def _context(operation_id: str, seconds: float) -> ToolContext:
    return ToolContext(
        operation_id=operation_id, attempt=1, fencing_token=1,
        deadline=datetime.now(UTC) + timedelta(seconds=seconds),
    )


async def _reconcile(tool: Tool, operation_id: str) -> Reconciliation:
    """The tool's reconciliation of `operation_id`, as the executor asks it."""
    assert tool.reconcile is not None
    answer = tool.reconcile(operation_id, _context(operation_id, 5))
    return answer if isinstance(answer, Reconciliation) else await answer


def _sent(effects: Path, key: str) -> list[dict[str, object]]:
    if not effects.exists():
        return []
    lines = [json.loads(line) for line in effects.read_text().splitlines() if line]
    return [line for line in lines if line["key"] == key]


async def test_a_lost_answer_is_unknown_while_it_runs_then_applied_once(
    upstream: tuple[str, Path],
) -> None:
    url, effects = upstream
    tool = mcp_tool("append_log", McpUpstream(url=url), lookup_tool="lookup_call")
    # The executor stops waiting after half a second; the server takes two.
    with pytest.raises(ToolError) as lost:
        ran = tool.run({"line": "slow", "delay_ms": 2000}, _context("op-lost", 0.5))
        assert inspect.isawaitable(ran)  # the MCP tool is async
        await ran
    assert lost.value.code == "UPSTREAM_NO_ANSWER" and lost.value.outcome_unknown
    # Asked at once, the call is still running: neither applied nor safe to retry.
    early = await _reconcile(tool, "op-lost")
    assert early.status is ReconcileStatus.UNKNOWN
    assert _sent(effects, "op-lost") == []
    for _ in range(50):
        if _sent(effects, "op-lost"):
            break
        await asyncio.sleep(0.1)
    late = await _reconcile(tool, "op-lost")
    assert late.status is ReconcileStatus.APPLIED
    (effect,) = _sent(effects, "op-lost")
    assert late.data is not None and late.data == effect["result"]
    assert late.data["line"] == "slow"


async def test_a_call_never_sent_is_not_applied(upstream: tuple[str, Path]) -> None:
    url, _ = upstream
    tool = mcp_tool("append_log", McpUpstream(url=url), lookup_tool="lookup_call")
    answer = await _reconcile(tool, "op-never")
    assert answer.status is ReconcileStatus.NOT_APPLIED


async def test_without_a_lookup_or_with_one_that_fails_a_person_decides(
    upstream: tuple[str, Path],
) -> None:
    url, _ = upstream
    for lookup in (None, "no_such_tool"):
        tool = mcp_tool("append_log", McpUpstream(url=url), lookup_tool=lookup)
        answer = await _reconcile(tool, "op-x")
        assert answer.status is ReconcileStatus.UNKNOWN, lookup
