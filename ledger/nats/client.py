"""Connecting as an identity, and a flush that really waits for what was sent before it.

`flush_all` exists because of a nats-py 2.16 behaviour (nats/aio/client.py,
`Client._send_ping`): `flush()` writes its PING straight to the socket, while
commands issued just before it (a SUB, a PUB) may still sit in the client's
pending buffer, waiting for the flusher task. The server can then answer the
PONG before it has seen them, so `await nc.subscribe(...); await nc.flush()`
does not guarantee the subscription is registered (observed here: a request
right after it got "no responders" a few times in a hundred).
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client

from ledger.nats.security import Identity, connect_options
from schemas import drop_undecodable_messages

__all__ = ["connect_as", "flush_all"]


async def connect_as(servers: str | list[str], identity: Identity, **overrides: Any) -> Client:
    """`nats.connect` as `identity` (NKey seed, private inbox prefix, connection name).

    `overrides` are passed on to `nats.connect` (callbacks, reconnect settings, ...)
    and may not replace the identity's own options.
    """
    options = connect_options(identity)
    clash = sorted(set(options) & set(overrides) - {"name"})
    if clash:
        raise ValueError(f"connect_as sets {', '.join(clash)} from the identity")
    drop_undecodable_messages()
    return await nats.connect(servers, **{**options, **overrides})


async def flush_all(nc: Client, timeout: float = 1.0) -> None:
    """Return once the server has processed every command issued on `nc` before the call.

    First let the client's flusher hand its pending buffer to the socket, then
    send the PING: the socket keeps order, so the PONG comes after them.
    Raises `nats.errors.TimeoutError` after `timeout` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while nc.pending_data_size > 0:
        if loop.time() >= deadline:
            raise nats.errors.TimeoutError
        # The flusher task runs as soon as we yield; a short sleep covers a
        # socket that needs a moment to drain.
        await asyncio.sleep(0.001)
    remaining = max(deadline - loop.time(), 0.001)
    # FlushTimeoutError is a nats.errors.TimeoutError. nats-py annotates the
    # timeout as int but passes it to asyncio.wait_for, which takes any number.
    await nc.flush(timeout=remaining)  # type: ignore[arg-type]
