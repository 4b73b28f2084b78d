"""Waiting for the tool's preview of a call that awaits approval, as an approver would.

A contract with `approval.preview` (the sample e-mail's) is approved only once its
executor has run the tool's preview and the ledger recorded it; the approval names
its digest. Tests that approve such a call over a running stack wait for it here.
"""

from __future__ import annotations

import asyncio
import time

from ledger import Ledger

__all__ = ["await_preview"]


async def await_preview(ledger: Ledger, operation_id: str, *, timeout: float = 60.0) -> str:
    """The recorded preview's digest of `operation_id` (the ledger's ID), once there is one."""
    deadline = time.monotonic() + timeout
    while True:
        operation = await asyncio.to_thread(ledger.get, operation_id)
        if operation.preview_hash is not None:
            return operation.preview_hash
        if time.monotonic() > deadline:
            raise AssertionError(f"no preview of {operation_id} within {timeout} s")
        await asyncio.sleep(0.05)
