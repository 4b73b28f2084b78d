"""What the ledger costs an MCP call: one no-op tool, through opledger and directly.

    python bench/mcp_bench.py [--calls 200] [--warmup 20] [--transport http|stdio]

In one run it starts nats-server, the ledger service (SQLite), the sample MCP
server of `tests/mcp/sample_server.py`, `opledger executor mcp` for its `noop`
tool and `opledger mcp serve` for one host (over HTTP, with a bearer token as it
must be), then times the SDK's MCP client calling `noop` (sequentially, one call
in flight) two ways:

- **direct**: client → sample server;
- **ledger**: client → gateway → ledger (check, record) → executor (lease,
  `tools/call` to the server, validate, redact, result) → ledger → gateway.

It prints both latency distributions and the ratio of their medians. Figures,
not assertions: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from ledger.nats import CredentialSet, NatsServer, connect_as, generate_credentials
from schemas import StatusRequest, Subjects

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS = ROOT / "tests" / "mcp" / "contracts"
SAMPLE = [sys.executable, "-m", "tests.mcp.sample_server"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_port(port: int, process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process {process.args!r} exited")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def _bearer(url: str, token: str) -> AbstractAsyncContextManager[Any]:
    """The SDK's Streamable HTTP transport to `url`, sending `token` as its bearer token."""

    @asynccontextmanager
    async def transport() -> AsyncIterator[Any]:
        # The SDK's transport on a client of our own, the one way to add a header
        # (its `create_mcp_http_client` is private): its timeouts and redirects.
        client = httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {token}"}, follow_redirects=True,
            timeout=httpx2.Timeout(30.0, read=300.0),
        )
        async with client as http, streamable_http_client(url, http_client=http) as streams:
            yield streams

    return transport()


async def _wait_ledger(url: str, credentials: CredentialSet, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nc = await connect_as(url, credentials.host("bench"), allow_reconnect=False)
        try:
            request = StatusRequest(operation_id="probe").model_dump_json().encode()
            await nc.request(Subjects.status("bench"), request, timeout=1)
            return
        except Exception:
            await asyncio.sleep(0.2)
        finally:
            await nc.close()
    raise RuntimeError("the ledger service did not answer")


@contextmanager
def _stack(home: Path, transport: str) -> Iterator[tuple[Client, Client]]:
    """(direct client, ledger client), both unentered, with every process running."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SAMPLE_MCP_EFFECTS": str(home / "fx")}
    env.pop("OPLEDGER_MCP_TOKEN", None)  # the gateway's token is the --token-file below
    credentials = generate_credentials(home / "creds", hosts=("bench",), tools=("noop",))
    server = NatsServer(home / "nats", authorization=credentials.authorization_config)
    server.start()
    processes: list[subprocess.Popen[bytes]] = []

    def start(*argv: str) -> subprocess.Popen[bytes]:
        log = (home / f"p{len(processes)}.log").open("wb")
        process = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                   cwd=ROOT, env=env)
        processes.append(process)
        return process

    try:
        start(sys.executable, "-m", "ledger.server", "--database", str(home / "ledger.db"),
              "--nats-url", server.url, "--creds", str(credentials.ledger.seed_path),
              "--tools", "noop", "--contracts", str(CONTRACTS))
        asyncio.run(_wait_ledger(server.url, credentials))
        if transport == "http":
            port = _free_port()
            _wait_port(port, start(*SAMPLE, "--http", str(port)))
            direct: Client = Client(f"http://127.0.0.1:{port}/mcp", cache=None)
            upstream = ["--upstream", f"http://127.0.0.1:{port}/mcp"]
        else:
            direct = Client(StdioServerParameters(command=SAMPLE[0], args=SAMPLE[1:], env=env,
                                                  cwd=str(ROOT)), cache=None)
            upstream = ["--upstream-command", " ".join(SAMPLE)]
        start(sys.executable, "-m", "ledger.entrypoints", "executor", "mcp", "--tool", "noop",
              *upstream, "--creds", str(credentials.executor("noop").seed_path),
              "--nats-url", server.url, "--contracts", str(CONTRACTS), "--log-level", "WARNING")
        gateway = [sys.executable, "-m", "ledger.entrypoints", "mcp", "serve", "--host", "bench",
                   "--creds", str(credentials.host("bench").seed_path),
                   "--nats-url", server.url, "--principal", "bench", "--tenant", "bench"]
        if transport == "http":
            # The gateway's endpoint takes only its bearer token (docs/mcp.md).
            token = secrets.token_urlsafe(32)
            token_file = home / "gateway.token"
            token_file.touch(mode=0o600)
            token_file.write_text(token, encoding="ascii")
            port = _free_port()
            _wait_port(port, start(*gateway, "--transport", "http",
                                   "--listen", f"127.0.0.1:{port}",
                                   "--token-file", str(token_file)))
            through: Client = Client(_bearer(f"http://127.0.0.1:{port}/mcp", token), cache=None)
        else:
            through = Client(StdioServerParameters(command=gateway[0], args=gateway[1:], env=env,
                                                   cwd=str(ROOT)), cache=None)
        yield direct, through
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        server.stop()


async def _time(client: Client, calls: int, warmup: int) -> list[float]:
    """Milliseconds per `noop` call, after `warmup` untimed calls."""
    async with client:
        for _ in range(warmup):
            result = await client.call_tool("noop", {})
            if result.is_error:
                raise RuntimeError(f"noop failed: {result.content}")
        timings = []
        for _ in range(calls):
            started = time.perf_counter()
            await client.call_tool("noop", {})
            timings.append((time.perf_counter() - started) * 1000)
    return timings


def _line(name: str, ms: Sequence[float]) -> str:
    ordered = sorted(ms)

    def p(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return (f"{name:<8} n={len(ms):<5} mean={statistics.fmean(ms):7.2f} ms  p50={p(0.5):7.2f}"
            f"  p90={p(0.9):7.2f}  p99={p(0.99):7.2f}  calls/s={1000 / statistics.fmean(ms):7.1f}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison and print it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--transport", choices=["http", "stdio"], default="http")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mcp-bench-") as home, \
            _stack(Path(home), args.transport) as (direct, through):
        direct_ms = asyncio.run(_time(direct, args.calls, args.warmup))
        ledger_ms = asyncio.run(_time(through, args.calls, args.warmup))
    print(f"MCP no-op tool, {args.transport}, sequential calls, SDK client")
    print(_line("direct", direct_ms))
    print(_line("ledger", ledger_ms))
    ratio = statistics.median(ledger_ms) / statistics.median(direct_ms)
    added = statistics.median(ledger_ms) - statistics.median(direct_ms)
    print(f"ratio of medians ledger/direct = {ratio:.1f}x  (+{added:.2f} ms per call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
