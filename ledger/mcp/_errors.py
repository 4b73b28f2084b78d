"""The errors of the MCP bridge, each an `OpledgerError` with a stable code."""

from __future__ import annotations

from schemas import ErrorCategory, OpledgerError

__all__ = ["McpConfigError", "RequestStateRefused", "UpstreamUnavailable"]


class McpConfigError(OpledgerError):
    """A gateway, executor or import command that cannot start as configured."""

    category = ErrorCategory.INVALID_INPUT
    code = "MCP_CONFIG"


class UpstreamUnavailable(OpledgerError):
    """The upstream MCP server could not be reached (nothing was sent to it)."""

    category = ErrorCategory.TRANSIENT
    code = "UPSTREAM_UNAVAILABLE"
    retryable = True


class RequestStateRefused(OpledgerError):
    """A `requestState` the gateway did not mint, for another call, host, or expired.

    MCP requires a server to treat the echoed state as attacker-controlled: it is
    refused, never followed to an operation.
    """

    category = ErrorCategory.INVALID_INPUT
    code = "REQUEST_STATE_REFUSED"
