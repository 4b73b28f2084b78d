"""Run the gateway over stdio or Streamable HTTP, and an MCP executor until a signal.

Both connect to NATS inside the event loop they serve on, so the host client,
the MCP server and (for HTTP) uvicorn share one loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass
from typing import Literal

import uvicorn
from mcp.server.stdio import stdio_server
from mcp.server.transport_security import TransportSecuritySettings

from executors import ExecutorRunner
from ledger.client import AgentHostClient
from ledger.mcp.gateway import GatewaySettings, McpGateway
from ledger.nats import Identity, connect_as

__all__ = ["HttpListen", "run_executor_until_stopped", "serve_gateway"]


@dataclass(frozen=True, slots=True)
class HttpListen:
    """Where the Streamable HTTP endpoint listens."""

    host: str = "127.0.0.1"
    port: int = 8765
    path: str = "/mcp"
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed besides loopback (DNS-rebinding protection stays on)."""


async def serve_gateway(
    settings: GatewaySettings,
    *,
    nats_url: str,
    identity: Identity,
    transport: Literal["stdio", "http"],
    listen: HttpListen | None = None,
) -> None:
    """Serve MCP clients until stdin closes (stdio) or a signal (HTTP)."""
    nc = await connect_as(nats_url, identity)
    host = AgentHostClient(nc, settings.host)
    server = McpGateway(host, settings).server()
    try:
        if transport == "stdio":
            async with stdio_server() as (read_stream, write_stream):
                await server.run(read_stream, write_stream, server.create_initialization_options())
        else:
            where = listen or HttpListen()
            loopback = [f"{where.host}:*", "127.0.0.1:*", "localhost:*", "[::1]:*"]
            security = TransportSecuritySettings(
                enable_dns_rebinding_protection=True,
                allowed_hosts=loopback,
                allowed_origins=[
                    "http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*",
                    *where.allowed_origins,
                ],
            )
            # Stateless: MCP 2026-07-28 has no sessions, and each call finds its
            # operation again by what it is (`ledger.mcp._calls`), on any replica.
            app = server.streamable_http_app(
                streamable_http_path=where.path,
                stateless_http=True,
                transport_security=security,
                host=where.host,
            )
            config = uvicorn.Config(
                app, host=where.host, port=where.port, log_level="warning", lifespan="on"
            )
            await uvicorn.Server(config).serve()
    finally:
        with contextlib.suppress(Exception):
            await host.close()


async def run_executor_until_stopped(runner: ExecutorRunner) -> None:
    """Run `runner`; the first SIGTERM/SIGINT finishes the current item, a second abandons it."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            runner.stop()
        elif task is not None:
            task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await runner.run()
    except asyncio.CancelledError:
        pass  # abandoned: the item is redelivered and the ledger decides
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
