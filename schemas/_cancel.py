"""`cancel_and_wait`: stop a task that may not hear its first cancel.

Every process stops loops that wait on nats-py (the ledger service's relay and
consumers, an executor's check-ins and in-progress acks), hence its place beside
`PullConsumer` and `drop_undecodable_messages`."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["cancel_and_wait"]

_AGAIN_AFTER_S = 0.5


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel `tasks` (None: none) and wait until each has ended, cancelling again
    every half second any that goes on. What they raised is dropped, as `gather`
    with `return_exceptions` would.

    One `cancel()` may not end a task. Python 3.11's `asyncio.wait_for` (fixed
    in 3.12), which nats-py uses inside its requests, flushes and fetches,
    returns what it awaited and drops a cancel that arrives in the same turn of
    the loop as the answer. A loop that was in such a call then goes on as if
    never told, and whoever waits for it to end waits for ever: a service whose
    `stop()` never returned (seen under load in the relay). Our own code uses
    `asyncio.timeout` instead, which keeps the cancel (ruff's TID251 bans
    `wait_for` in the packages); nats-py also turns a cancel into an error in places
    (`publish_async` stalled), which a loop may catch and go on from.
    """
    running = {task for task in tasks if task is not None}
    while running:
        for task in running:
            task.cancel()
        _, running = await asyncio.wait(running, timeout=_AGAIN_AFTER_S)
    for ended in tasks:
        if ended is not None and not ended.cancelled():
            ended.exception()  # retrieved: no "exception was never retrieved" at exit
