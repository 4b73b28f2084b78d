"""A tool for the end-to-end tests that is rate limited on its first attempt."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from executors import ToolContext, ToolError, tool

RETRY_AFTER_MS = 1_500
"""What the first attempt's provider says: longer than the contract's 500 ms backoff."""


@tool("query_orders", version="1.3.0")
async def flaky_query_orders(_arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
    """Rate limited once (with the provider's Retry-After), then no orders."""
    if context.attempt == 1:
        raise ToolError(
            "TRANSIENT", "RATE_LIMITED", "slow down", retry_after_ms=RETRY_AFTER_MS
        )
    return {"orders": [], "truncated": False, "next_cursor": None}


@tool("query_orders", version="1.3.0")
async def revoked_key_query_orders(
    _arguments: Mapping[str, Any], context: ToolContext
) -> dict[str, Any]:
    """Refused by its provider (a revoked key: no policy retries that) until the file
    `$OPLEDGER_TEST_KEY_ROTATED` exists: as until an operator rotates the key."""
    if not Path(os.environ["OPLEDGER_TEST_KEY_ROTATED"]).exists():
        raise ToolError("UNAUTHORIZED", "PROVIDER_KEY_REVOKED", "the API key was revoked")
    return {"orders": [], "truncated": False, "next_cursor": None}
