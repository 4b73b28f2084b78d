"""One undecodable message must not stop a process reading NATS.

nats-py (2.16) decodes a message's subject, reply subject and header status line
as strict UTF-8 while it parses the socket; an exception there ends its read loop
for good, and the connection looks alive (pings are answered) until the server
calls it stale, minutes later. NATS subjects are bytes on the wire, and the server
passes a publisher's reply subject and headers through as they are: so one request
with the reply subject `_INBOX.\\xff` from any host or executor silenced the whole
ledger service for about six minutes (an attack review reproduced it).

`drop_undecodable_messages()` makes such a message what it is, the sender's own
malformed request: dropped and logged, with no answer (there is no subject to
answer on), while the read loop goes on for everyone else. Every process calls it
before it connects; it changes nats-py's `Client` once per process.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from nats.aio.client import Client

__all__ = ["drop_undecodable_messages"]

_log = logging.getLogger(__name__)
_GUARDED = "_opledger_drops_undecodable"


def drop_undecodable_messages() -> None:
    """Have every nats-py client drop (and log) a message it cannot decode instead of
    ending its read loop. Idempotent."""
    if getattr(Client, _GUARDED, False):
        return
    original = Client._process_msg

    @functools.wraps(original)
    async def process_msg(
        self: Client, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> Any:
        try:
            return await original(self, sid, subject, reply, data, headers)
        except UnicodeDecodeError:
            _log.warning(
                "nats: dropped a message on %r that is not UTF-8 (reply %r, %d header"
                " bytes): its sender gets no answer",
                subject[:120],
                reply[:120],
                len(headers or b""),
            )
            return None

    Client._process_msg = process_msg  # type: ignore[method-assign]
    setattr(Client, _GUARDED, True)
