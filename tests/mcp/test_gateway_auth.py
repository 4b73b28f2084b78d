"""Who may speak to `opledger mcp serve --transport http`: the holder of that gateway's
bearer token, and no one else (real nats-server, ledger, executors, sample server, and
gateway processes started by the CLI; the SDK's own client, and raw HTTP requests)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client, MCPError

from ledger.mcp import cli as mcp_cli
from ledger.mcp._auth import TOKEN_ENV
from tests.mcp.conftest import ROOT, McpStack, _stop, bearer_transport, wait_for_port
from tests.ports import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

MCP_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


def _call(line: str, request_id: int = 1) -> dict[str, Any]:
    """A JSON-RPC `tools/call` of `append_log` (a write h1 may make without approval)."""
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
            "params": {"name": "append_log", "arguments": {"line": line, "delay_ms": 0}}}


def _list(request_id: int = 2) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/list", "params": {}}


def _answer(response: httpx2.Response) -> dict[str, Any]:
    """The JSON-RPC result of a served request (a JSON body, or an SSE stream's answer)."""
    assert response.status_code == 200, (response.status_code, response.text)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[5:] for line in response.text.splitlines() if line.startswith("data:")]
        messages = [json.loads(text) for text in data if text.strip()]
    else:
        messages = [response.json()]
    answer = next(message for message in messages if "id" in message)
    assert "result" in answer, answer
    result = answer["result"]
    assert isinstance(result, dict)
    return result


def _operations(stack: McpStack) -> set[str]:
    """Every operation the ledger holds, by ID (with what it has not projected yet)."""
    ledger = stack.ledger()
    try:
        return {row.operation_id for row in ledger.projector.rows(current=True, limit=100_000)}
    finally:
        ledger.close()


def _lines(stack: McpStack) -> list[str]:
    """The lines the sample server appended, in order."""
    return [e["arguments"]["line"] for e in stack.effects() if e["tool"] == "append_log"]


async def test_only_the_gateways_own_token_gets_past_401_and_nothing_else_is_proposed(
    http_stack: McpStack,
) -> None:
    """No `Authorization`, a wrong token, another scheme, and the token of the other gateway
    (h2's, on h1): 401 with `WWW-Authenticate: Bearer`, no tool listed, nothing proposed,
    nothing run. The same requests with h1's token, on the same gateway, are served: the
    silence is the token's doing, not a gateway that answers no one."""
    url = http_stack.gateways["h1"]
    wrong = {
        "no header": None,
        "a wrong token": f"Bearer {secrets.token_urlsafe(32)}",
        "h2's token": f"Bearer {http_stack.tokens['h2']}",
        "h1's token, another scheme": f"Basic {http_stack.tokens['h1']}",
        "h1's token, cut short": f"Bearer {http_stack.tokens['h1'][:-1]}",
        "h1's token and more": f"Bearer {http_stack.tokens['h1']}x",
    }
    before = _operations(http_stack)
    async with httpx2.AsyncClient(timeout=30) as http:
        for number, (name, authorization) in enumerate(wrong.items()):
            headers = dict(MCP_HEADERS)
            if authorization is not None:
                headers["Authorization"] = authorization
            for body in (_call(f"refused-{number}"), _list()):
                answer = await http.post(url, headers=headers, content=json.dumps(body))
                assert answer.status_code == 401, (name, answer.status_code, answer.text)
                assert answer.headers["www-authenticate"].startswith("Bearer"), name
                assert "append_log" not in answer.text, name
        # The SDK's own client with a wrong token or none: refused when it connects.
        for token in (None, secrets.token_urlsafe(32), http_stack.tokens["h2"]):
            statuses: list[int] = []
            with pytest.raises(ExceptionGroup) as refused:  # the SDK's task groups
                async with Client(bearer_transport(url, token, statuses), cache=None) as client:
                    await client.call_tool("append_log", {"line": "refused-sdk", "delay_ms": 0})
            _, others = refused.value.split(MCPError)
            assert others is None, others
            assert statuses and set(statuses) == {401}, statuses

        # Control: the same raw request with h1's token is served, and runs once.
        headers = {**MCP_HEADERS, "Authorization": f"Bearer {http_stack.tokens['h1']}"}
        listed = await http.post(url, headers=headers, content=json.dumps(_list()))
        tools = {tool["name"] for tool in _answer(listed)["tools"]}
        assert tools == {"append_log", "lookup_note", "noop", "write_note"}
        served = await http.post(url, headers=headers, content=json.dumps(_call("admitted")))
        assert _answer(served)["structuredContent"]["line"] == "admitted", served.text
    # And the SDK's client with h1's token.
    async with http_stack.client("h1") as client:
        result = await client.call_tool("append_log", {"line": "admitted-sdk", "delay_ms": 0})
    assert not result.is_error, result
    operation = str((result.meta or {})["io.opledger/operationId"])

    # Two operations since `before`, both admitted calls' (both ran and were recorded after
    # every refused request was answered): nothing refused was proposed or run.
    new = _operations(http_stack) - before
    assert len(new) == 2, new
    assert f"h1/{operation}" in new
    lines = _lines(http_stack)
    assert lines.count("admitted") == 1 and lines.count("admitted-sdk") == 1, lines
    assert not [line for line in lines if line.startswith("refused")], lines


async def test_each_gateway_takes_its_own_token_and_no_other(http_stack: McpStack) -> None:
    """h2 (token from `OPLEDGER_MCP_TOKEN`) serves its own token's holder and refuses h1's
    (from a `--token-file`): one token per gateway, one gateway per caller."""
    async with http_stack.client("h2") as reader:
        listed = {tool.name for tool in (await reader.list_tools()).tools}
    assert listed == {"lookup_note", "noop"}
    statuses: list[int] = []
    url = http_stack.gateways["h2"]
    with pytest.raises(ExceptionGroup) as refused:  # the SDK's task groups
        async with Client(bearer_transport(url, http_stack.tokens["h1"], statuses),
                          cache=None) as client:
            await client.list_tools()
    _, others = refused.value.split(MCPError)
    assert others is None, others
    assert statuses and set(statuses) == {401}, statuses


# ------------------------------------------------------------------ refusing to start


def _serve(*extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`opledger mcp serve --transport http` with `extra`: its exit, before any NATS."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    if env is None or "OPLEDGER_MCP_TOKEN" not in env:
        environment.pop("OPLEDGER_MCP_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "ledger.entrypoints", "mcp", "serve", "--host", "h1",
         "--nats-url", "nats://127.0.0.1:9", "--creds", "/nonexistent",
         "--principal", "alice", "--tenant", "acme", "--transport", "http", *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=60, env=environment,
    )


def _token_file(directory: Path, token: str, mode: int) -> Path:
    path = directory / f"token-{mode:o}-{len(token)}"
    path.write_text(token + "\n", encoding="ascii")
    path.chmod(mode)
    return path


def test_the_http_gateway_does_not_start_without_a_sound_token(tmp_path: Path) -> None:
    """Refused with `MCP_CONFIG` (exit 2, one line, no traceback) before anything
    connects: no token; a short or non-random one (file or environment); a token file
    group or others may read; a non-loopback listen without a token, even with
    `--insecure-no-auth`; two tokens at once."""
    good = secrets.token_urlsafe(32)
    cases: dict[str, tuple[list[str], dict[str, str] | None, str]] = {
        "no token": ([], None, "needs a bearer token"),
        "short file": (["--token-file", str(_token_file(tmp_path, "s3cr3t-but-short", 0o600))],
                       None, "at least 32 random bytes"),
        "31 random bytes": (
            ["--token-file", str(_token_file(tmp_path, secrets.token_hex(31), 0o600))],
            None, "at most 31 bytes"),
        "not random": (["--token-file", str(_token_file(tmp_path, "a" * 64, 0o600))],
                       None, "too few distinct characters"),
        "short env": ([], {"OPLEDGER_MCP_TOKEN": "hunter2"}, "OPLEDGER_MCP_TOKEN"),
        "world-readable": (["--token-file", str(_token_file(tmp_path, good, 0o644))],
                           None, "chmod 600"),
        "group-readable": (["--token-file", str(_token_file(tmp_path, good, 0o640))],
                           None, "chmod 600"),
        "no such file": (["--token-file", str(tmp_path / "absent")], None, "absent"),
        "two tokens": (["--token-file", str(_token_file(tmp_path, good, 0o600))],
                       {"OPLEDGER_MCP_TOKEN": secrets.token_urlsafe(32)}, "not both"),
        "non-loopback, no token": (["--listen", "0.0.0.0:8765"], None, "not loopback"),
        "non-loopback, --insecure-no-auth": (
            ["--listen", "0.0.0.0:8765", "--insecure-no-auth"], None, "not loopback"),
        "another interface, --insecure-no-auth": (
            ["--listen", "192.0.2.7:8765", "--insecure-no-auth"], None, "not loopback"),
    }
    # Each case is a process that imports the CLI and exits: run a few at once.
    with ThreadPoolExecutor(max_workers=3) as pool:
        ran = dict(zip(cases, pool.map(lambda case: _serve(*case[0], env=case[1]),
                                       cases.values()), strict=True))
    for name, (_, _, says) in cases.items():
        done = ran[name]
        assert done.returncode == 2, (name, done.stderr)
        assert "MCP_CONFIG" in done.stderr and says in done.stderr, (name, done.stderr)
        assert "Traceback" not in done.stderr, (name, done.stderr)
        assert good not in done.stderr, name  # a token is never echoed
    assert mcp_cli._TOKEN_ENV == TOKEN_ENV  # named twice: the CLI loads no SDK to build
    # Control: a sound token file gets past every check (and fails on the missing seed).
    sound = _serve("--token-file", str(_token_file(tmp_path, good, 0o600)))
    assert sound.returncode == 2 and "MCP_CONFIG" not in sound.stderr, sound.stderr
    assert "nonexistent" in sound.stderr, sound.stderr


def test_insecure_no_auth_serves_without_a_token_on_loopback_only_when_asked(
    http_stack: McpStack,
) -> None:
    """`--insecure-no-auth` on 127.0.0.1 starts (and says so on stderr); the refusal of
    every other way to start without a token is above."""
    port = free_port()
    log = http_stack.stack.home / "gateway-insecure.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OPLEDGER_MCP_TOKEN", None)
    gateway = subprocess.Popen(
        [sys.executable, *http_stack.gateway_command("h2"), "--transport", "http",
         "--listen", f"127.0.0.1:{port}", "--insecure-no-auth"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
    )
    try:
        wait_for_port(port, gateway, log)
        answer = httpx2.post(f"http://127.0.0.1:{port}/mcp", headers=MCP_HEADERS,
                             content=json.dumps(_list()), timeout=30)
    finally:
        _stop(gateway)
    assert {tool["name"] for tool in _answer(answer)["tools"]} == {"lookup_note", "noop"}
    assert "WITHOUT authentication" in log.read_text(errors="replace")
