"""`opledger up` says what the stack does: one line per stored event, as `ops watch`
prints them, unless `--quiet`."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ledger.client import AgentHostClient
from ledger.embedded import DEMO_HOST, require_running_stack
from ledger.nats import connect_as, load_credentials
from schemas import RuntimeContext, ToolProposal

pytestmark = [pytest.mark.nats, pytest.mark.timeout(120)]


class _Lines:
    """A process's stdout, read by a thread (a pipe's buffered text and `select` do not
    mix), with a wait for a line containing some text."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._queue: queue.Queue[str] = queue.Queue()
        self.seen = ""
        assert process.stdout is not None
        stream = process.stdout

        def read() -> None:
            for line in stream:
                self._queue.put(line)

        threading.Thread(target=read, daemon=True).start()

    def until(self, wanted: str, seconds: float) -> str:
        """Every line up to the first containing `wanted` (raises after `seconds`)."""
        deadline = time.monotonic() + seconds
        taken = ""
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            taken += line
            self.seen += line
            if wanted in line:
                return taken
        raise AssertionError(f"no line with {wanted!r} in:\n{self.seen}")


async def _search(home: Path) -> None:
    stack = require_running_stack(home)
    nc = await connect_as(stack.nats_url, load_credentials(stack.creds_dir).host(DEMO_HOST))
    host = AgentHostClient(nc, DEMO_HOST)
    try:
        await host.propose(
            ToolProposal(
                proposal_id="p-1", conversation_id="c-1", requested_by_user_id="alice",
                tool_name="search_documents", operation_id="look-1",
                arguments={"query": "refund window", "source_types": ["policy"], "top_k": 3},
            ),
            RuntimeContext(principal="alice", tenant="acme",
                           capabilities=frozenset({"documents:search"})),
        )
        assert (await host.outcome("look-1", timeout=60)).state == "succeeded"
    finally:
        await host.close()


def test_up_prints_each_operations_events_as_they_are_stored(tmp_path: Path) -> None:
    home = tmp_path / ".opledger"
    process = subprocess.Popen(
        [sys.executable, "-m", "ledger.entrypoints", "--home", str(home), "up"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines = _Lines(process)
    try:
        lines.until("Ctrl-C stops everything", 60)
        asyncio.run(_search(home))
        out = lines.until("demo/look-1  v", 30)
        out += lines.until("Succeeded", 30)
        assert "Proposed" in out and "demo/look-1" in out, lines.seen
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
