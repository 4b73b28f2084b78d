"""The Model Context Protocol bridge: the ledger in the path of MCP, changing neither side.

Everything MCP-specific lives in this package; the ledger core knows nothing of
MCP. Three parts, each an `opledger` command (docs/mcp.md):

- `McpGateway` (`opledger mcp serve`): an MCP server, over stdio or Streamable
  HTTP, that is one agent host of the ledger. `tools/list` is what the host's
  configured caller may call; `tools/call` is a proposal.
- `mcp_tool` / `McpUpstream` (`opledger executor mcp`): one tool of an existing
  MCP server run as an ordinary executor under its contract.
- `draft_contract` / `list_upstream_tools` (`opledger tools import-mcp`): draft
  contracts from a server's `tools/list`, for an operator to complete.

Errors: `McpConfigError`, `UpstreamUnavailable`, `RequestStateRefused`, each an
`OpledgerError`. The public names are loaded on first use, so that importing
`ledger.mcp.cli` (as `opledger` does for every command) does not load the SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ledger.mcp._errors import McpConfigError, RequestStateRefused, UpstreamUnavailable

if TYPE_CHECKING:
    from ledger.mcp._calls import (
        IDEMPOTENCY_KEY_META,
        STATE_KEY_MIN_BYTES,
        CallIdentity,
        RequestStateSeal,
        call_digest,
        caller_of,
    )
    from ledger.mcp.executor import OPERATION_ID_META, McpUpstream, mcp_tool
    from ledger.mcp.gateway import GatewaySettings, McpGateway
    from ledger.mcp.importer import FILL_IN, DraftContract, draft_contract, list_upstream_tools
    from ledger.mcp.serving import HttpListen, serve_gateway

__all__ = [
    "FILL_IN",
    "IDEMPOTENCY_KEY_META",
    "OPERATION_ID_META",
    "STATE_KEY_MIN_BYTES",
    "CallIdentity",
    "DraftContract",
    "GatewaySettings",
    "HttpListen",
    "McpConfigError",
    "McpGateway",
    "McpUpstream",
    "RequestStateRefused",
    "RequestStateSeal",
    "UpstreamUnavailable",
    "call_digest",
    "caller_of",
    "draft_contract",
    "list_upstream_tools",
    "mcp_tool",
    "serve_gateway",
]

_WHERE = {
    "IDEMPOTENCY_KEY_META": "ledger.mcp._calls",
    "CallIdentity": "ledger.mcp._calls",
    "RequestStateSeal": "ledger.mcp._calls",
    "STATE_KEY_MIN_BYTES": "ledger.mcp._calls",
    "call_digest": "ledger.mcp._calls",
    "caller_of": "ledger.mcp._calls",
    "OPERATION_ID_META": "ledger.mcp.executor",
    "McpUpstream": "ledger.mcp.executor",
    "mcp_tool": "ledger.mcp.executor",
    "GatewaySettings": "ledger.mcp.gateway",
    "McpGateway": "ledger.mcp.gateway",
    "FILL_IN": "ledger.mcp.importer",
    "DraftContract": "ledger.mcp.importer",
    "draft_contract": "ledger.mcp.importer",
    "list_upstream_tools": "ledger.mcp.importer",
    "HttpListen": "ledger.mcp.serving",
    "serve_gateway": "ledger.mcp.serving",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ledger.mcp' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
