"""A tool for the soak: rate limited on its first attempt (a retry with the provider's
backoff), then slow enough on its second that a cancel reaches it mid-run, and able to
stop before any effect."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from executors import ToolContext, ToolError, tool

RETRY_AFTER_MS = 800
"""The first attempt's Retry-After: longer than the contract's 500 ms backoff."""
RUN_S = 2.0
"""How long the second attempt takes."""


@tool("query_orders", version="1.3.0")
async def soak_query_orders(_arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
    """Rate limited once, then no orders, slowly."""
    if context.attempt == 1:
        raise ToolError("TRANSIENT", "RATE_LIMITED", "slow down", retry_after_ms=RETRY_AFTER_MS)
    await asyncio.sleep(RUN_S)
    return {"orders": [], "truncated": False, "next_cursor": None}


@soak_query_orders.canceller
def _stop(_operation_id: str, _context: ToolContext) -> bool:
    return True  # a read that has read nothing yet: stopping is safe
