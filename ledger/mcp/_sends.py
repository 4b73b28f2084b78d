"""Which calls to an MCP server over HTTP certainly never left this process.

A call whose session dies before an answer is an unknown outcome: it may have run.
Over Streamable HTTP one case is certain, though: a call whose request never got a
connection (refused, or not opened in time) sent no byte, and an HTTP MCP server
that is down for a restart makes every call in that window such a call. Calling
them unknown outcomes would hand each to a lookup or a person; they are retryable
instead, as a server that cannot be reached at connect time is.

The SDK does not say which: a connection error inside its transport ends the whole
session and reaches the caller as a closed connection, like an answer lost after
the request went out. So the HTTP client under the SDK counts, per idempotency key
(the operation ID every keyed call carries in `_meta`), the requests it was given
and those that failed before a connection was open. A request that got no
connection is answered by the client itself (`NOT_CONNECTED`), so that only its
own call fails and the session's other calls carry on; the count, not that code,
says whether the call was sent. Where the session itself ended, the count is read
only after it is gone, so that no request of the call can still start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx2
import orjson

__all__ = ["NOT_CONNECTED", "SendLog", "SendLoggingClient"]

NOT_CONNECTED = -32050
"""The JSON-RPC error code of the answer `SendLoggingClient` makes up for a request that
got no connection. A hint only: a server may send any code, so whether a call was sent
is read from its `SendLog` count, never from this code."""

_NOT_CONNECTED = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)
"""Raised before a connection was open for the request: not one byte of it was sent."""


class _Count:
    """One call's requests: how many were handed to the client, how many never connected."""

    __slots__ = ("given", "not_connected")

    def __init__(self) -> None:
        self.given = 0
        self.not_connected = 0


class SendLog:
    """Counts, per idempotency key, the requests that carried it (module doc)."""

    def __init__(self, key_field: str) -> None:
        self._key_field = key_field
        self._counts: dict[str, list[_Count]] = {}
        self._in_flight: dict[str, int] = {}
        self._unreadable = 0

    @contextmanager
    def call(self, key: str) -> Iterator[Callable[[], bool]]:
        """While a call with `key` runs: a function telling whether any of its requests
        may have reached the server (counted from here; every request carrying the key
        counts, whichever call made it, and so does any request whose body could not be
        read)."""
        count = _Count()
        self._counts.setdefault(key, []).append(count)
        unreadable = self._unreadable
        # A request with this key still on its way from before (an earlier attempt's,
        # cut off by a timeout) may reach the server during this call: never "not sent".
        earlier = self._in_flight.get(key, 0) > 0

        def may_have_reached() -> bool:
            return (earlier or self._unreadable != unreadable
                    or count.given != count.not_connected)

        try:
            yield may_have_reached
        finally:
            counts = self._counts[key]
            counts.remove(count)
            if not counts:
                del self._counts[key]

    def given(self, request: httpx2.Request) -> tuple[list[str], list[_Count]]:
        """A request is about to be sent: its keys, and the calls it counts for (both
        handed back to `sent`)."""
        if request.method != "POST":
            return [], []  # calls go by POST; a GET stream or a DELETE carries none
        keys = self._keys(request)
        if keys is None:
            self._unreadable += 1
            return [], []
        for key in keys:
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
        counts = [count for key in keys for count in self._counts.get(key, ())]
        for count in counts:
            count.given += 1
        return keys, counts

    def sent(self, given: tuple[list[str], list[_Count]], *, connected: bool) -> None:
        """The request `given` was sent, or failed (`connected`: whether a connection
        was open for it, so some of it may have left)."""
        keys, counts = given
        for key in keys:
            left = self._in_flight[key] - 1
            if left:
                self._in_flight[key] = left
            else:
                del self._in_flight[key]
        if not connected:
            for count in counts:
                count.not_connected += 1

    def _keys(self, request: httpx2.Request) -> list[str] | None:
        """The idempotency keys in a JSON-RPC body (one message or a batch); None if the
        body cannot be read as one, or holds a tool call without a key where one should
        be (it might be any call: fail closed, should the SDK ever move the key)."""
        try:
            body = orjson.loads(request.content)
        except (httpx2.RequestNotRead, orjson.JSONDecodeError):
            return None
        messages = body if isinstance(body, list) else [body]
        keys = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            params = message.get("params")
            meta = params.get("_meta") if isinstance(params, dict) else None
            key = meta.get(self._key_field) if isinstance(meta, dict) else None
            if isinstance(key, str):
                keys.append(key)
            elif message.get("method") == "tools/call":
                return None  # a lookup's call (sent unkeyed) lands here too: safe
        return keys


class SendLoggingClient(httpx2.AsyncClient):
    """The SDK's HTTP client, counting each request in a `SendLog`.

    `send` is where every request of the SDK goes, one at a time (it follows
    redirects itself); a subclass rather than a transport of our own, because a
    client given a transport no longer honours the environment's proxy settings.
    What makes a connection error mean "nothing of it left" holds for this client
    only as built here: HTTP/1.1 (over HTTP/2 the pool may resend a request on a new
    connection after a GOAWAY, and then fail to connect) and no `auth` flow (which
    may send several requests within one `send`).
    """

    def __init__(self, *args: Any, sends: SendLog, **kwargs: Any) -> None:
        if kwargs.pop("http2", False) or kwargs.get("auth") is not None:
            raise ValueError("a SendLoggingClient counts only HTTP/1.1 without an auth flow")
        super().__init__(*args, http2=False, **kwargs)
        self._sends = sends

    async def send(self, request: httpx2.Request, **kwargs: Any) -> httpx2.Response:
        """Send `request`, counting it (and whether it never got a connection).

        A JSON-RPC request (one message with an `id`) that gets no connection is
        answered here with a JSON-RPC error (`NOT_CONNECTED`, HTTP 503), which the SDK
        hands to that request's caller alone. Raised, the connection error would end the
        SDK's whole session, and every call in flight on it, answered or not, would
        become an unknown outcome: a server draining for a restart refuses new
        connections while it answers those it holds. A courtesy the client owes the
        server (a cancel notification, its answer to the server's own request) that
        gets no connection is answered 202: lost, as on any network, and the session
        goes on. The handshake's requests and the other notifications are raised, as
        the SDK would have them.
        """
        given = self._sends.given(request)
        connected = True
        try:
            return await super().send(request, **kwargs)
        except _NOT_CONNECTED as error:
            connected = False
            kind, request_id = _message(request)
            if kind in ("notifications/cancelled", _ANSWER):
                return httpx2.Response(202, request=request)
            if request_id is None or kind in ("server/discover", "initialize"):
                # A notification or a batch; or the handshake, where the SDK's `auto` mode
                # would take any JSON-RPC error as "legacy server" and downgrade the session.
                raise
            return httpx2.Response(
                503,
                headers={"content-type": "application/json"},
                content=orjson.dumps({
                    "jsonrpc": "2.0",
                    "id": request_id,
                    "error": {
                        "code": NOT_CONNECTED,
                        "message": f"no connection to the MCP server ({type(error).__name__})",
                    },
                }),
                request=request,
            )
        finally:
            self._sends.sent(given, connected=connected)


_ANSWER = "(an answer)"
"""`_message`'s kind for a JSON-RPC response or error the client sends the server."""


def _message(request: httpx2.Request) -> tuple[str | None, str | int | None]:
    """The method (`_ANSWER` for a response) and `id` of the one JSON-RPC message a POST
    carries; (None, None) for anything else."""
    if request.method != "POST":
        return None, None
    try:
        body = orjson.loads(request.content)
    except (httpx2.RequestNotRead, orjson.JSONDecodeError):
        return None, None
    if not isinstance(body, dict):
        return None, None
    if "method" not in body and "id" in body and ("result" in body or "error" in body):
        return _ANSWER, None
    if not isinstance(body.get("method"), str):
        return None, None
    request_id = body.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, str | int):
        return body["method"], None
    return body["method"], request_id
