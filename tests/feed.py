"""Reading what is on the feed stream, for tests (as the ledger identity, which may)."""

from __future__ import annotations

from typing import Any

import nats

from schemas import Subjects

__all__ = ["feed_messages"]


async def feed_messages(
    js: Any, subject: str = Subjects.all_feed(), quiet_s: float = 0.5
) -> list[Any]:
    """Every message of the feed on `subject`, in order, through an ephemeral ordered
    consumer: read until none came for `quiet_s` seconds."""
    found: list[Any] = []
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        while True:
            try:
                found.append(await sub.next_msg(timeout=quiet_s))
            except nats.errors.TimeoutError:
                return found
    finally:
        await sub.unsubscribe()
