"""`opledger up`'s stack: where things are, metrics, secrets only where they belong,
commands that find it without flags, and a clean stop; `opledger demo` as a smoke test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ledger.client import AgentHostClient
from ledger.embedded import DEMO_HOST, EmbeddedStack, require_running_stack, running_stack
from ledger.nats import connect_as, load_credentials
from schemas import RuntimeContext, ToolProposal
from tests.e2e.conftest import interrupt, opledger_command

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(
        f"/proc/{pid}/status").read_text().lower()


async def _propose_one(url: str, creds_dir: Path) -> None:
    nc = await connect_as(url, load_credentials(creds_dir).host(DEMO_HOST))
    host = AgentHostClient(nc, DEMO_HOST)
    try:
        await host.propose(
            ToolProposal(proposal_id="p", conversation_id="c", requested_by_user_id="alice",
                         tool_name="search_documents", arguments={"query": "refunds"},
                         operation_id="op-up-1"),
            RuntimeContext(principal="alice", tenant="acme",
                           capabilities=frozenset({"documents:search"})),
        )
        assert (await host.outcome("op-up-1", timeout=30)).state == "succeeded"
    finally:
        await host.close()


def test_embedded_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPLEDGER_SECRET_SUPERVISOR_ONLY", "must-not-leak")
    home = tmp_path / ".opledger"
    stack = EmbeddedStack(home)
    info = stack.start()
    pids = dict(info.pids)
    try:
        assert running_stack(home) == info
        # As the README's tour finds it: from a folder under the stack's, with no home named.
        inner = tmp_path / "agent" / "src"
        inner.mkdir(parents=True)
        monkeypatch.delenv("OPLEDGER_HOME", raising=False)
        monkeypatch.chdir(inner)
        assert require_running_stack() == info
        assert not info.nats_url.endswith(":4222")
        assert set(pids) == {"ledger"} | {f"executor-{t}" for t in stack.executors}
        # Secrets: the supervisor's never leak; only the e-mail executor gets its own.
        for name, pid in pids.items():
            env = _environ(pid)
            assert "OPLEDGER_SECRET_SUPERVISOR_ONLY" not in env, name
        commands = {name: _cmdline(pid) for name, pid in pids.items()}
        holders = {name for name, cmd in commands.items() if "--secrets" in cmd}
        holders |= {name for name, pid in pids.items()
                    if any(key.startswith("OPLEDGER_SECRET_") for key in _environ(pid))}
        assert holders == {"executor-send_customer_email"}
        email_secrets = json.loads(Path(_flag(commands["executor-send_customer_email"],
                                              "--secrets")).read_text())
        assert set(email_secrets) == {"email_provider_db"}
        # Credentials: every process its own NKey, each executor its own tool's.
        seeds = {name: _flag(cmd, "--creds") for name, cmd in commands.items()}
        assert len(set(seeds.values())) == len(seeds)
        creds = load_credentials(Path(info.creds_dir))
        assert seeds["ledger"] == str(creds.ledger.seed_path)
        for tool in stack.executors:
            assert seeds[f"executor-{tool}"] == str(creds.executor(tool).seed_path)
        # Metrics, named as in the seed, without operation or user labels.
        with urllib.request.urlopen(info.metrics["ledger"], timeout=5) as response:
            text = response.read().decode()
        assert "tool_proposals_total" in text
        assert "tool_executions_total" in text
        # `opledger ops list` finds the stack's ledger from the default home, no flags.
        asyncio.run(_propose_one(info.nats_url, Path(info.creds_dir)))
        listed = subprocess.run(
            [sys.executable, "-m", "ledger.entrypoints", "ops", "list"],
            cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.splitlines()[0].split()[:2] == ["OPERATION", "STATE"]
        assert listed.stdout.splitlines()[1].split()[:3] == [
            "demo/op-up-1", "succeeded", "search_documents@2.1.0"
        ]
        # `opledger status` from a folder under the home: every process, the backlog.
        shown = subprocess.run(
            [sys.executable, "-m", "ledger.entrypoints", "--json", "status"],
            cwd=inner, capture_output=True, text=True, timeout=60,
        )
        assert shown.returncode == 0, shown.stderr
        status = json.loads(shown.stdout)
        alive = {name: p["alive"] for name, p in status["stack"]["processes"].items()}
        assert alive == dict.fromkeys(pids, True)
        assert status["consumers"]["OPS_WORK/exec_search_documents"]["waiting"] == 0
        assert status["operations"] == {"succeeded": 1}
    finally:
        stack.stop()
    assert running_stack(home) is None
    assert [name for name, pid in pids.items() if _alive(pid)] == []
    assert stack.server is not None
    assert not stack.server.running


def test_demo_runs_every_step_as_stated(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "ledger.entrypoints", "demo", "--home", str(tmp_path / "home")],
        capture_output=True, text=True, timeout=280,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "all steps behaved as stated" in run.stdout
    table = run.stdout.split("step ")[-1]
    for step in ("auto-approved read", "repair loop", "cross-tenant attempt", "approved e-mail",
                 "forbidden delete", "killed executor", "audit verify"):
        assert step in table
    assert "✘" not in table


def _started_at(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), None if it is gone: with its
    PID, what tells it from a later process given the same PID."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[19])  # field 22 of stat; 19 here, after the name and two before it


def _descendants(pid: int) -> set[tuple[int, int]]:
    """Every process started under `pid`, at any depth, alive now: (PID, start time)."""
    found: set[tuple[int, int]] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                started = _started_at(child)
                if started is not None and (child, started) not in found:
                    found.add((child, started))
                    todo.append(child)
    return found


def _still_running(process: tuple[int, int]) -> bool:
    """The same process still there, not a later one with its PID, and not a zombie."""
    pid, started = process
    try:
        return _started_at(pid) == started and _alive(pid)
    except OSError:
        return False


@pytest.mark.timeout(480)  # its waits: 60 s for up, 280 s for the demo, 60 s for Ctrl-C
def test_up_serves_the_demo_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    """`opledger up` in the foreground, `opledger demo` against it from another
    terminal, then Ctrl-C (SIGINT) to `up`: every process it started is gone. Both
    through the `opledger` command the package installs."""
    home = tmp_path / "home"
    log = tmp_path / "up.log"
    started: set[tuple[int, int]] = set()
    with log.open("w") as out:
        up = subprocess.Popen(
            [*opledger_command(), "up", "--home", str(home)],
            stdout=out, stderr=subprocess.STDOUT, text=True,
        )
    try:
        deadline = time.monotonic() + 60
        while "Ctrl-C stops everything." not in log.read_text():
            assert up.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        started = _descendants(up.pid)
        info = running_stack(home.resolve())
        assert info is not None
        # nats-server, the ledger service and one executor per sample tool, at least.
        pids = {pid for pid, _ in started}
        assert set(info.pids.values()) <= pids and len(started) >= 5, (info.pids, started)

        demo = subprocess.run(
            [*opledger_command(), "demo", "--home", str(home)],
            capture_output=True, text=True, timeout=280,
        )
        assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-2000:]
        assert f"using the stack running from {home.resolve()}" in demo.stdout
        assert "starting the embedded stack" not in demo.stdout
        assert "all steps behaved as stated" in demo.stdout
        assert up.poll() is None, "up stopped during the demo"
        # Still the same stack: the demo paused an executor and let it go again.
        assert set(info.pids.values()) <= {pid for pid, _ in _descendants(up.pid)}

        started |= _descendants(up.pid)
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert "stopping…" in log.read_text()
        left = [pid for pid, since in started if _still_running((pid, since))]
        assert left == [], [_cmdline(pid) for pid in left]
    finally:
        # A failure above must not leave the stack behind: Ctrl-C first, as a person
        # would, then whatever `up` started and did not stop.
        if up.poll() is None:
            started |= _descendants(up.pid)
            interrupt(up, timeout_s=30)
        for process in started:
            if _still_running(process):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process[0], signal.SIGKILL)
    assert running_stack(home.resolve()) is None
