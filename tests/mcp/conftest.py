"""A real stack per transport: nats-server, the ledger service, one `opledger executor mcp`
process per tool of the sample MCP server, and `opledger mcp serve` gateways.

`stdio`: the MCP client starts the gateway over stdio, and each executor starts
the sample server over stdio. `http`: the gateways (hosts h1 and h2) and the
sample server are Streamable HTTP endpoints on free loopback ports; each gateway
has a bearer token of its own (h1's in a `--token-file`, h2's in
`OPLEDGER_MCP_TOKEN`), which `McpStack.client` sends.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from ledger import Ledger
from ledger.client import AgentHostClient, ApproverClient
from ledger.mcp import GatewaySettings, McpGateway
from ledger.nats import connect_as
from schemas import RuntimeContext
from tests.e2e.conftest import BackendStack, backend_stack
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = Path(__file__).resolve().parent / "contracts"
TOOLS = ("append_log", "lookup_note", "noop", "write_note")
HOST_CAPABILITIES = {
    "h1": ("notes:read", "notes:write"),
    "h2": ("notes:read",),  # may read notes, never write them
}
APPROVAL_ROUND_S = 1.0
STATE_KEY = b"one key shared by every gateway of a test stack, 32+ bytes"
_HOST_TOKEN = object()
"""`McpStack.client(token=...)` default: the token of the gateway connected to."""


def bearer_transport(
    url: str, token: str | None, statuses: list[int] | None = None
) -> AbstractAsyncContextManager[Any]:
    """The SDK's Streamable HTTP client transport to `url`, sending `token` as its bearer
    token (none when None), over an HTTP client closed with it; the HTTP status of every
    response is appended to `statuses`."""

    async def record(response: httpx2.Response) -> None:
        if statuses is not None:
            statuses.append(response.status_code)

    @asynccontextmanager
    async def transport() -> AsyncIterator[Any]:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else None
        async with create_mcp_http_client(headers=headers) as http:
            http.event_hooks["response"].append(record)
            async with streamable_http_client(url, http_client=http) as streams:
                yield streams

    return transport()


def wait_for_port(
    port: int, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 30
) -> None:
    """Until something accepts connections on `port` (or `process` died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            text = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"exited before listening:\n{text}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}:\n{log.read_text(errors='replace')[-3000:]}")


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


async def gone_within(seconds: float, *pids: int) -> bool:
    """Whether every process of `pids` has ended (`alive`) within `seconds`; the loop
    runs meanwhile (a session's shutdown on it may be what ends them)."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@dataclass
class McpStack:
    """The running stack of one transport, and how to reach it as an MCP client."""

    transport: str
    stack: BackendStack
    effects_file: Path
    gateways: dict[str, str] = field(default_factory=dict)
    """host → its gateway's URL (http only)."""
    tokens: dict[str, str] = field(default_factory=dict)
    """host → its gateway's bearer token (http only)."""
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def gateway_command(self, host: str) -> list[str]:
        """The `opledger mcp serve` command line of `host`'s gateway (stdio)."""
        args = [
            "-m", "ledger.entrypoints", "mcp", "serve", "--host", host,
            "--creds", str(self.stack.credentials.host(host).seed_path),
            "--nats-url", self.stack.server.url,
            "--principal", "alice", "--tenant", "acme",
            "--approval-round", str(APPROVAL_ROUND_S), "--outcome-wait", "10",
        ]
        for capability in HOST_CAPABILITIES[host]:
            args += ["--capability", capability]
        return args

    def client(self, host: str = "h1", *, token: Any = _HOST_TOKEN, **options: Any) -> Client:
        """The SDK's own MCP client, connected to `host`'s gateway; over HTTP it sends
        `token` (by default that gateway's own; None: no `Authorization` header)."""
        options.setdefault("input_required_max_rounds", 60)
        options.setdefault("cache", None)
        if self.transport == "http":
            bearer = self.tokens[host] if token is _HOST_TOKEN else token
            return Client(bearer_transport(self.gateways[host], bearer), **options)
        params = StdioServerParameters(
            command=sys.executable, args=self.gateway_command(host), cwd=str(ROOT),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        return Client(params, **options)

    def effects(self) -> list[dict[str, Any]]:
        """Every side effect the sample server performed (with the key it was sent)."""
        import json

        if not self.effects_file.exists():
            return []
        lines = self.effects_file.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line]

    def ledger(self) -> Ledger:
        """A handle on the service's ledger, for inspection."""
        return self.stack.ledger()

    async def approve_when_asked(
        self, tool: str, timeout_s: float = 30.0, *, deny: bool = False
    ) -> str:
        """Wait for an operation of `tool` awaiting approval; approve it (or deny it) over
        NATS as `lead`."""
        deadline = time.monotonic() + timeout_s
        ledger = self.ledger()
        try:
            while True:
                rows = [
                    row for row in ledger.projector.rows(state="awaiting_approval", current=True)
                    if row.tool == tool
                ]
                if rows:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"no call of {tool} awaited approval")
                await asyncio.sleep(0.1)
        finally:
            ledger.close()
        row = rows[0]
        nc = await connect_as(self.stack.server.url, self.stack.credentials.approver("lead"))
        approver = ApproverClient(nc, "lead")
        try:
            if deny:
                await approver.deny(row.operation_id, reason="a test cleans up")
            else:
                await approver.approve(row.operation_id, proposal_hash=row.proposal_hash or "")
        finally:
            await approver.close()
        return row.operation_id

    @asynccontextmanager
    async def gateway(
        self,
        host: str = "h1",
        *,
        principal: str = "alice",
        capabilities: tuple[str, ...] | None = None,
        environment: str = "development",
        client_options: dict[str, Any] | None = None,
        **settings: Any,
    ) -> AsyncIterator[Client]:
        """An `McpGateway` in this process (host `host`, over the stack's real NATS and
        ledger), and the SDK's client connected to it in-process.

        Two of them may share one host identity and differ in the runtime context: the
        case of two `opledger mcp serve` processes started with one seed."""
        nc = await connect_as(self.stack.server.url, self.stack.credentials.host(host))
        agent_host = AgentHostClient(nc, host)
        context = RuntimeContext(
            principal=principal, tenant="acme",
            capabilities=frozenset(HOST_CAPABILITIES[host] if capabilities is None
                                   else capabilities),
            environment=environment,
        )
        settings.setdefault("approval_round_s", APPROVAL_ROUND_S)
        settings.setdefault("state_key", STATE_KEY)
        gateway = McpGateway(agent_host, GatewaySettings(host=host, context=context, **settings))
        options = {"cache": None, "input_required_max_rounds": 60, **(client_options or {})}
        try:
            async with Client(gateway.server(), **options) as client:
                yield client
        finally:
            await agent_host.close()


def start_sample_http_server(
    home: Path, effects: Path, *options: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """The sample MCP server over Streamable HTTP on a free port, recording its effects
    in `effects` (`options`: its own, such as `--token-env`; `env`: added to its
    environment), once it listens: the process (the caller stops it) and its URL."""
    port, log = free_port(), home / f"sample-server-{secrets.token_hex(4)}.log"
    with log.open("wb") as output:  # the child keeps its own copy of the file
        server = subprocess.Popen(
            [sys.executable, "-m", "tests.mcp.sample_server", "--http", str(port), *options],
            stdout=output, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "SAMPLE_MCP_EFFECTS": str(effects),
                 **(env or {})},
        )
    try:
        wait_for_port(port, server, log)
    except BaseException:
        _stop(server)
        raise
    return server, f"http://127.0.0.1:{port}/mcp"


def _executor(
    stack: BackendStack, tool: str, upstream: list[str], effects: Path
) -> subprocess.Popen[bytes]:
    name = f"mcp-exec-{tool}"
    return subprocess.Popen(
        [sys.executable, "-m", "ledger.entrypoints", "executor", "mcp", "--tool", tool,
         *upstream, "--creds", str(stack.credentials.executor(tool).seed_path),
         "--nats-url", stack.server.url, "--contracts", str(CONTRACTS), "--name", name],
        stdout=(stack.home / f"{name}.log").open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
        # The sample server's state path reaches a stdio server only as this executor's
        # secret (`--env-secret`): the executor's own environment does not carry it.
        env={**os.environ, "PYTHONPATH": str(ROOT), "OPLEDGER_SECRET_SAMPLE_EFFECTS": str(effects)},
    )


@pytest.fixture(scope="module", params=["stdio", "http"])
def mcp_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[McpStack]:
    """The whole path, MCP client to MCP server, over one transport."""
    yield from _mcp_stack(str(request.param), tmp_path_factory)


@pytest.fixture(scope="module")
def http_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpStack]:
    """The whole path over Streamable HTTP only: two gateways, each with its own token."""
    yield from _mcp_stack("http", tmp_path_factory)


@pytest.fixture(scope="module")
def ledger_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpStack]:
    """The ledger and the executors (sample server over stdio), for gateways run in the
    test's own process (`McpStack.gateway`)."""
    yield from _mcp_stack("stdio", tmp_path_factory)


def _mcp_stack(transport: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpStack]:
    home = tmp_path_factory.mktemp(f"mcp-{transport}")
    effects = home / "effects.jsonl"
    with backend_stack(home, "sqlite", hosts=tuple(HOST_CAPABILITIES), tools=TOOLS,
                       contracts=CONTRACTS, approvers={"lead": ["approver"]}) as stack:
        mcp = McpStack(transport, stack, effects)
        try:
            if transport == "http":
                server, url = start_sample_http_server(home, effects)
                mcp.processes.append(server)
                upstream = ["--upstream", url]
            else:
                upstream = ["--upstream-command", f"{sys.executable} -m tests.mcp.sample_server",
                            "--env-secret", "SAMPLE_MCP_EFFECTS=sample_effects"]
            for tool in TOOLS:
                mcp.processes.append(_executor(stack, tool, upstream, effects))
            if transport == "http":
                for host in HOST_CAPABILITIES:
                    port = free_port()
                    log = home / f"gateway-{host}.log"
                    token = mcp.tokens[host] = secrets.token_urlsafe(32)
                    env = {**os.environ, "PYTHONPATH": str(ROOT)}
                    env.pop("OPLEDGER_MCP_TOKEN", None)
                    auth: list[str] = []
                    if host == "h1":  # one gateway reads its token from a file, one from env
                        token_file = home / f"{host}.token"
                        token_file.touch(mode=0o600)
                        token_file.write_text(token + "\n", encoding="ascii")
                        auth = ["--token-file", str(token_file)]
                    else:
                        env["OPLEDGER_MCP_TOKEN"] = token
                    gateway = subprocess.Popen(
                        [sys.executable, *mcp.gateway_command(host), "--transport", "http",
                         "--listen", f"127.0.0.1:{port}", *auth],
                        stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                    )
                    mcp.processes.append(gateway)
                    wait_for_port(port, gateway, log)
                    mcp.gateways[host] = f"http://127.0.0.1:{port}/mcp"
            yield mcp
        finally:
            for process in reversed(mcp.processes):
                _stop(process)
