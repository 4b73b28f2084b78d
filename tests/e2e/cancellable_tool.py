"""A slow tool for the end-to-end cancellation tests that can stop before any effect."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from executors import ToolContext, tool

SLOW_S = 20.0
"""Long enough that only a cancel ends a call before the test's patience does."""


@tool("query_orders", version="1.3.0")
async def cancellable_query_orders(
    _arguments: Mapping[str, Any], _context: ToolContext
) -> dict[str, Any]:
    """Find no orders, very slowly."""
    await asyncio.sleep(SLOW_S)
    return {"orders": [], "truncated": False, "next_cursor": None}


@cancellable_query_orders.canceller
def _stop(_operation_id: str, _context: ToolContext) -> bool:
    # Nothing has been read or written yet: stopping is safe, and says so.
    return True
