"""A tool for the end-to-end tests whose work outlasts the work consumer's ack wait."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

from executors import ToolContext, tool

SLOW_S = 3.5
"""How long one call takes: longer than the test stack's ack wait (`ACK_WAIT_S`); an
executor started with `OPLEDGER_TEST_SLOW_S` in its environment takes that long."""


@tool("query_orders", version="1.3.0")
async def slow_query_orders(_arguments: Mapping[str, Any], _context: ToolContext) -> dict[str, Any]:
    """Find no orders, slowly."""
    await asyncio.sleep(float(os.environ.get("OPLEDGER_TEST_SLOW_S", SLOW_S)))
    return {"orders": [], "truncated": False, "next_cursor": None}
