"""Draft contracts from an MCP server, how calls find their operation, and the upstream's
connection and credentials (no NATS)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
import yaml
from mcp import StdioServerParameters

from executors import Tool, ToolContext, ToolError
from ledger.mcp import (
    CallIdentity,
    GatewaySettings,
    McpConfigError,
    McpUpstream,
    RequestStateRefused,
    RequestStateSeal,
    call_digest,
    caller_of,
    draft_contract,
    mcp_tool,
)
from ledger.mcp.importer import write_drafts
from policy import ContractError, ContractRegistry, parse_contract
from schemas import RuntimeContext
from tests.mcp.conftest import CONTRACTS, ROOT, gone_within


def _import(out: Path, *tools: str) -> list[Path]:
    selected = [arg for tool in tools for arg in ("--tool", tool)]
    done = subprocess.run(
        [sys.executable, "-m", "ledger.entrypoints", "tools", "import-mcp",
         "--upstream-command", f"{sys.executable} -m tests.mcp.sample_server",
         "--out", str(out), *selected],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SAMPLE_MCP_EFFECTS": str(out / "fx")},
    )
    assert done.returncode == 0, done.stderr
    return [Path(line) for line in done.stdout.split()]


def test_a_draft_keeps_the_servers_schemas_and_leaves_the_policy_to_an_operator(
    tmp_path: Path,
) -> None:
    (path,) = _import(tmp_path, "write_note")
    draft = yaml.safe_load(path.read_text())
    assert draft["name"] == "write_note"
    assert draft["input_schema"]["required"] == ["key", "text"]
    assert draft["output_schema"]["type"] == "object"
    # The server says read-only: recorded as its hint, and nothing more.
    assert draft["draft"]["server_hints"] == {"readOnlyHint": True, "destructiveHint": False}
    for field in ("effect", "timeout_ms"):
        assert str(draft[field]).startswith("FILL IN")
    assert str(draft["approval"]["mode"]).startswith("FILL IN")
    assert str(draft["risk"]["base"]).startswith("FILL IN")


def test_the_registry_refuses_a_draft_until_it_is_completed(tmp_path: Path) -> None:
    (path,) = _import(tmp_path, "append_log")
    with pytest.raises(ContractError) as refused:
        ContractRegistry.from_directory(tmp_path)
    assert refused.value.safe_details["pointer"] == "/draft"
    # Deleting the draft block without completing it is refused as well.
    document = yaml.safe_load(path.read_text())
    del document["draft"]
    with pytest.raises(ContractError):
        parse_contract(document, source=str(path))
    # Completed by an operator (what tests/mcp/contracts holds), it loads.
    completed = yaml.safe_load((CONTRACTS / "append_log.yaml").read_text())
    for field in ("effect", "required_capabilities", "approval", "risk", "retry", "timeout_ms"):
        document[field] = completed[field]
    document["description"] = completed["description"]
    document.pop("idempotency")
    assert parse_contract(document, source=str(path)).effect.writes


def test_an_import_refuses_to_overwrite_a_contract(tmp_path: Path) -> None:
    _import(tmp_path, "noop")
    done = subprocess.run(
        [sys.executable, "-m", "ledger.entrypoints", "tools", "import-mcp",
         "--upstream-command", f"{sys.executable} -m tests.mcp.sample_server",
         "--out", str(tmp_path), "--tool", "noop"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 2
    assert "MCP_CONFIG" in done.stderr and "Traceback" not in done.stderr


def _caller(host: str = "h1", principal: str = "alice", **context: Any) -> str:
    return caller_of(host, RuntimeContext(principal=principal, tenant="acme", **context))


def test_identical_writes_within_the_window_are_one_operation() -> None:
    h1 = _caller()
    ids = CallIdentity(h1, window_s=600)
    digest = call_digest(h1, "append_log", {"line": "x", "delay_ms": 0})
    assert digest is not None
    same = call_digest(h1, "append_log", {"delay_ms": 0.0, "line": "x"})  # same meaning
    assert same == digest
    first, _ = ids.windowed(digest, now=6000 + 300)
    again, _ = ids.windowed(digest, now=6000 + 599)
    assert first == again
    later, previous = ids.windowed(digest, now=6000 + 600 + 30)
    assert later != first and previous == first  # a re-issue across the boundary finds it
    assert ids.from_key("k-1") == ids.from_key("k-1")


def test_a_reissue_less_than_a_window_later_finds_the_call_wherever_the_boundary_is() -> None:
    """A call 10 s before a boundary, made again 140 s later (130 s into the next window):
    the gateway proposes the previous window's operation when it exists, so the re-issue
    must still be offered that one."""
    ids = CallIdentity(_caller(), window_s=600)
    digest = "ab" * 32
    for at in (0, 10, 300, 590, 599):
        first, _ = ids.windowed(digest, now=6000 + at)
        for later in (1, 140, 400, 599):
            current, previous = ids.windowed(digest, now=6000 + at + later)
            assert first in (current, previous), (at, later)


def test_every_part_of_the_caller_makes_another_call_and_another_key() -> None:
    base = _caller()
    others = {
        "host": _caller(host="h2"),
        "principal": _caller(principal="bob"),
        "tenant": caller_of("h1", RuntimeContext(principal="alice", tenant="other")),
        "environment": _caller(environment="production"),
        "capabilities": _caller(capabilities=frozenset({"notes:write"})),
    }
    arguments = {"line": "x", "delay_ms": 0}
    for part, other in others.items():
        assert other != base, part
        assert call_digest(other, "append_log", arguments) != call_digest(
            base, "append_log", arguments
        ), part
        assert CallIdentity(other).from_key("k") != CallIdentity(base).from_key("k"), part
    assert _caller(capabilities=frozenset({"a", "b"})) == _caller(
        capabilities=frozenset({"b", "a"})
    )


def test_a_request_state_is_honoured_only_for_its_caller_call_and_time() -> None:
    h1 = _caller()
    seal = RequestStateSeal(b"k" * 32, h1, ttl_s=60)
    digest = call_digest(h1, "write_note", {"key": "a", "text": "b"})
    other = call_digest(h1, "write_note", {"key": "a", "text": "c"})
    state = seal.seal("mcp-abc-1", digest or "", now=1000)
    assert seal.open(state, digest, now=1010) == "mcp-abc-1"
    payload, mac = state.split(".")
    flipped = payload[:5] + ("A" if payload[5] != "A" else "B") + payload[6:]
    attempts: dict[str, Callable[[], str]] = {
        "another call": lambda: seal.open(state, other, now=1010),
        "expired": lambda: seal.open(state, digest, now=1061),
        "another host": lambda: RequestStateSeal(b"k" * 32, _caller("h2")).open(
            state, digest, now=1010),
        "another principal": lambda: RequestStateSeal(b"k" * 32, _caller(principal="bob")).open(
            state, digest, now=1010),
        "another key": lambda: RequestStateSeal(b"x" * 32, h1).open(state, digest, now=1010),
        "edited": lambda: seal.open(f"{flipped}.{mac}", digest, now=1010),
        "garbage": lambda: seal.open("not-a-state", digest, now=1010),
        "not base64": lambda: seal.open("\u00e9\u00e9.\u00e9", digest, now=1010),
        "no call": lambda: seal.open(state, None, now=1010),
    }
    for name, attempt in attempts.items():
        with pytest.raises(RequestStateRefused):
            attempt()
            raise AssertionError(f"{name} was honoured")


def test_a_short_request_state_key_is_refused() -> None:
    """A key a client could guess offline from one state it holds would let it seal any
    operation of the host: below 32 bytes, the gateway does not start."""
    context = RuntimeContext(principal="alice", tenant="acme")
    with pytest.raises(McpConfigError):
        GatewaySettings(host="h1", context=context, state_key=b"short")
    with pytest.raises(McpConfigError):
        RequestStateSeal(b"k" * 31, _caller())
    done = subprocess.run(
        [sys.executable, "-m", "ledger.entrypoints", "mcp", "serve", "--host", "h1",
         "--nats-url", "nats://127.0.0.1:9", "--creds", "/nonexistent",
         "--principal", "alice", "--tenant", "acme"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OPLEDGER_MCP_STATE_KEY": "secret"},
    )
    assert done.returncode == 2, done.stderr
    assert "OPLEDGER_MCP_STATE_KEY" in done.stderr and "Traceback" not in done.stderr


# ------------------------------------------------------------------ the upstream


def test_an_upstream_url_never_shows_credentials_and_never_carries_them() -> None:
    with pytest.raises(McpConfigError):
        McpUpstream(url="https://user:hunter2@notes.example/mcp")
    with pytest.raises(McpConfigError):
        McpUpstream(url="file:///etc/passwd")
    upstream = McpUpstream(url="https://notes.example:8443/mcp?token=hunter2#frag")
    assert upstream.describe() == "https://notes.example:8443/mcp"
    assert "hunter2" not in upstream.describe()
    assert McpUpstream(url="http://[::1]:9/mcp").describe() == "http://[::1]:9/mcp"
    assert McpUpstream(command=("/opt/bin/notes", "--token", "hunter2")).describe() == "notes"


def test_a_stdio_server_gets_its_secrets_and_none_of_the_executors_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPLEDGER_DATABASE", "postgresql://ledger:hunter2@db/ledger")
    monkeypatch.setenv("OPLEDGER_CREDS_DIR", "/srv/opledger/creds")
    monkeypatch.setenv("OPLEDGER_SECRET_OTHER_TOOL", "hunter3")
    monkeypatch.setenv("LANG", "C.UTF-8")
    upstream = McpUpstream(command=("notes-server",), env_secrets={"NOTES_DB": "notes_db"})
    target = upstream.client_target({"notes_db": "/srv/notes.db", "other_tool": "hunter3"})
    assert isinstance(target, StdioServerParameters)
    env = target.env or {}
    assert env["NOTES_DB"] == "/srv/notes.db"
    assert env["LANG"] == "C.UTF-8"
    assert not [name for name in env if name.upper().startswith("OPLEDGER_")]
    assert "hunter2" not in json.dumps(env) and "hunter3" not in json.dumps(env)


def _never_answering(tmp_path: Path) -> tuple[Tool, Path]:
    """`noop` on a stdio server that starts and never answers the handshake; the file
    where that process writes its pid."""
    pid_file = tmp_path / "pid"
    hang = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
    upstream = McpUpstream(command=(sys.executable, "-c", hang, str(pid_file)))
    return mcp_tool("noop", upstream), pid_file


def _attempt(key: str, seconds: float) -> ToolContext:
    """An attempt of host `h1`'s operation `key`, due in `seconds`."""
    return ToolContext(
        operation_id=f"h1/{key}", attempt=1, fencing_token=1,
        deadline=datetime.now(UTC) + timedelta(seconds=seconds),
    )


@pytest.mark.anyio
async def test_a_server_that_never_answers_is_unavailable_and_does_not_linger(
    tmp_path: Path,
) -> None:
    """An upstream that starts and never completes the handshake: the call is
    `UPSTREAM_UNAVAILABLE` (nothing was sent; retryable) before its deadline, not a hang
    until the runner's timeout, and the server process it started is stopped."""
    tool, pid_file = _never_answering(tmp_path)
    context = _attempt("op-hang", 2)
    started = time.monotonic()
    async def run() -> None:
        await tool.run({}, context)  # type: ignore[misc]  # mcp_tool's run is async

    # The runner's own deadline is the context's (plus the tool's margin): the SDK's
    # shutdown of a silent server (seconds) must not run on the call's time, or the call
    # becomes a timeout, an unknown outcome (found in review).
    with pytest.raises(ToolError) as failed:
        await asyncio.wait_for(run(), timeout=2.5)
    assert time.monotonic() - started < 2.5
    assert failed.value.code == "UPSTREAM_UNAVAILABLE"
    assert failed.value.retryable and not failed.value.outcome_unknown
    assert await gone_within(10, int(pid_file.read_text()))


@pytest.mark.anyio
async def test_a_call_behind_another_calls_connect_gives_up_within_its_own_time(
    tmp_path: Path,
) -> None:
    """Calls share one session, opened by one of them at a time. A call with less time
    left than the one connecting waited for that connect to end, past its own deadline,
    and the runner cut it off: a timeout, an unknown outcome, for a call that sent
    nothing. It now waits within its own connect time, and is `UPSTREAM_UNAVAILABLE`."""
    tool, pid_file = _never_answering(tmp_path)

    async def run(context: ToolContext) -> None:
        await tool.run({}, context)  # type: ignore[misc]  # mcp_tool's run is async

    first = asyncio.ensure_future(run(_attempt("op-first", 4)))
    await asyncio.sleep(0.2)  # the first call is connecting: the server never answers
    started = time.monotonic()
    with pytest.raises(ToolError) as behind:
        async with asyncio.timeout(1.5):  # the runner's deadline for the second call
            await run(_attempt("op-second", 1))
    assert time.monotonic() - started < 1.5
    assert behind.value.code == "UPSTREAM_UNAVAILABLE"
    assert behind.value.retryable and not behind.value.outcome_unknown
    with pytest.raises(ToolError) as connecting:
        await first
    assert connecting.value.code == "UPSTREAM_UNAVAILABLE"
    assert await gone_within(10, int(pid_file.read_text()))


def test_two_tools_that_would_be_one_contract_are_refused_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    tools = [
        types.Tool(name=name, input_schema={"type": "object"})
        for name in ("get-note", "get_note", "put_note")
    ]
    drafts = [draft_contract(tool, source="test") for tool in tools]
    with pytest.raises(McpConfigError):
        write_drafts(drafts, tmp_path)
    assert not list(tmp_path.iterdir())
    (tmp_path / "put_note.yaml").write_text("completed: by an operator\n")
    with pytest.raises(McpConfigError):
        write_drafts([drafts[0], drafts[2]], tmp_path)
    # All or nothing: get_note.yaml was not written beside the refused put_note.yaml.
    assert sorted(path.name for path in tmp_path.iterdir()) == ["put_note.yaml"]


def test_dropping_a_session_does_not_swallow_a_cancel_of_the_caller() -> None:
    """Found in stop 32's review of the same pattern in the executor: `drop` waited for
    the session's owner under `suppress(CancelledError)`, so a caller cancelled meanwhile
    (an executor stopping) ran on as if it had not been."""
    from ledger.mcp.executor import _Connection

    async def run() -> tuple[bool, bool]:
        connection = _Connection(McpUpstream(url="https://notes.example/mcp"))
        stop = asyncio.Event()

        async def closing_slowly() -> None:
            await stop.wait()
            await asyncio.sleep(0.3)  # the session takes its time to close

        owner = asyncio.create_task(closing_slowly())
        connection._owner, connection._stop = owner, stop
        caller = asyncio.create_task(connection.drop())
        await asyncio.sleep(0.05)
        caller.cancel()
        try:
            await caller
            cancelled = False
        except asyncio.CancelledError:
            cancelled = True
        await asyncio.wait({owner}, timeout=2)
        return cancelled, owner.cancelled()

    # The caller ends cancelled, and so does the session's owner (as with the old
    # wait_for): a stopping executor leaves no session, nor a server it started.
    assert asyncio.run(run()) == (True, True)
