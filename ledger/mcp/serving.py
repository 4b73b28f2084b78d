"""Serve the gateway to MCP clients over stdio or Streamable HTTP.

The gateway connects to NATS inside the event loop it serves on, so the host
client, the MCP server and (for HTTP) uvicorn share one loop. Over HTTP, every
request must carry the gateway's bearer token (`ledger.mcp._auth`); serving
without one is possible only on a loopback address, and only when asked for.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from dataclasses import dataclass, field
from typing import Literal

import uvicorn
from mcp.server.auth.settings import AuthSettings
from mcp.server.stdio import stdio_server
from mcp.server.transport_security import TransportSecuritySettings
from pydantic import AnyHttpUrl

from ledger.client import AgentHostClient
from ledger.mcp._auth import TOKEN_ENV, StaticTokenVerifier, check_token
from ledger.mcp._errors import McpConfigError
from ledger.mcp.gateway import GatewaySettings, McpGateway
from ledger.nats import Identity, connect_as

__all__ = ["HttpListen", "is_loopback", "serve_gateway"]

_log = logging.getLogger("opledger.mcp.serving")


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (`127.0.0.0/8`, `::1`) or `localhost`."""
    name = host.strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class HttpListen:
    """Where the Streamable HTTP endpoint listens."""

    host: str = "127.0.0.1"
    port: int = 8765
    path: str = "/mcp"
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed besides loopback (DNS-rebinding protection stays on)."""
    token: str | None = field(default=None, repr=False)
    """The bearer token every request must carry (`Authorization: Bearer <token>`)."""
    insecure_no_auth: bool = False
    """Serve without a token: refused unless `host` is a loopback address."""

    def check(self) -> None:
        """`McpConfigError` unless this endpoint authenticates its clients, or is on
        loopback and was explicitly allowed not to."""
        if self.token is not None:
            check_token(self.token, "the gateway's token")
            if self.insecure_no_auth:
                raise McpConfigError(
                    "a bearer token and --insecure-no-auth contradict each other: give one"
                )
            return
        if not is_loopback(self.host):
            raise McpConfigError(
                f"the HTTP endpoint would listen on {self.host}, which is not loopback, with"
                f" no bearer token: give --token-file PATH or set {TOKEN_ENV}"
                " (--insecure-no-auth is for loopback only)"
            )
        if not self.insecure_no_auth:
            raise McpConfigError(
                f"the HTTP endpoint needs a bearer token: give --token-file PATH or set"
                f" {TOKEN_ENV} (on loopback only, --insecure-no-auth serves without one)"
            )


async def serve_gateway(
    settings: GatewaySettings,
    *,
    nats_url: str,
    identity: Identity,
    transport: Literal["stdio", "http"],
    listen: HttpListen | None = None,
) -> None:
    """Serve MCP clients until stdin closes (stdio) or a signal (HTTP).

    Over HTTP, `listen` must carry a token, or allow serving without one on loopback
    (`HttpListen.check`); that is checked before anything connects."""
    where = listen or HttpListen()
    if transport == "http":
        where.check()
    nc = await connect_as(nats_url, identity)
    host = AgentHostClient(nc, settings.host)
    server = McpGateway(host, settings).server()
    try:
        if transport == "stdio":
            async with stdio_server() as (read_stream, write_stream):
                await server.run(read_stream, write_stream, server.create_initialization_options())
        else:
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
                auth=_auth_settings(where) if where.token is not None else None,
                token_verifier=(
                    StaticTokenVerifier(where.token, client_id=settings.host)
                    if where.token is not None else None
                ),
            )
            if where.token is None:
                _log.warning(
                    "serving MCP on http://%s:%d%s WITHOUT authentication: every process that"
                    " can connect acts as host %s", where.host, where.port, where.path,
                    settings.host,
                )
            config = uvicorn.Config(
                app, host=where.host, port=where.port, log_level="warning", lifespan="on"
            )
            await uvicorn.Server(config).serve()
    finally:
        with contextlib.suppress(Exception):
            await host.close()


def _auth_settings(where: HttpListen) -> AuthSettings:
    """What makes `streamable_http_app` put the SDK's bearer middleware in front of the
    endpoint: it does so only when given `AuthSettings` as well as a token verifier.

    Their `issuer_url` is required but unused here: the SDK would advertise it only
    with an authorization-server provider or a `resource_server_url` (OAuth metadata),
    and the gateway has neither, its token being configured, not issued. It names the
    endpoint itself, the only party that knows the token."""
    name = where.host.strip("[]")
    netloc = f"[{name}]" if ":" in name else name
    return AuthSettings(
        issuer_url=AnyHttpUrl(f"http://{netloc}:{where.port}"),
        resource_server_url=None,
        required_scopes=[],
    )
