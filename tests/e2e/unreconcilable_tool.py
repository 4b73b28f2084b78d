"""A write tool for the end-to-end tests that loses its reply and cannot look anything up."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from executors import ToolContext, ToolError, tool


@tool("send_customer_email", version="1.0.0")
def send_without_lookup(_arguments: Mapping[str, Any], _context: ToolContext) -> dict[str, Any]:
    """The provider's reply is lost, and this executor has no `reconcile`."""
    raise ToolError("TRANSIENT", "PROVIDER_UNAVAILABLE", "the reply was lost", outcome_unknown=True)


@send_without_lookup.previewer
def _preview(arguments: Mapping[str, Any], _context: ToolContext) -> dict[str, Any]:
    """The contract asks for a preview before approval: what would be sent, as asked."""
    return {"summary": "send the e-mail as asked", "arguments": dict(arguments)}
