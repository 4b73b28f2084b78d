"""An MCP transport that says when the server's side of it has ended.

A session whose server is gone must not be given a call. The SDK's client knows
(its read loop ends) but keeps that to itself, and a call made on it then fails
with the same `CONNECTION_CLOSED` as a call whose answer was lost after it was
sent: the executor would have to call that an unknown outcome, a person's work,
for a stdio server that merely died while idle. Wrapping the transport's read
stream shows the end as it happens, so the session is dropped at once and the
next call opens a new one (a new server process over stdio) before anything is
sent.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import anyio
from mcp import StdioServerParameters
from mcp.client import Transport
from mcp.client.stdio import stdio_client

__all__ = ["WatchedTransport", "as_transport"]

_ENDED = (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError)


def as_transport(target: Transport | StdioServerParameters) -> Transport:
    """`target` as a transport: what `mcp.Client` itself makes of a stdio command."""
    if isinstance(target, StdioServerParameters):
        return stdio_client(target)
    return target


class WatchedTransport:
    """`inner`, calling `on_end` once when its read stream ends (the server's side is
    gone: a stdio server exited or closed its output, a transport shut down)."""

    def __init__(self, inner: Transport, on_end: Callable[[], None]) -> None:
        self._inner = inner
        self._on_end = on_end
        self.ended = False
        """Whether the read stream has ended: no call may be sent on this session."""

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self._on_end()

    async def __aenter__(self) -> tuple[Any, Any]:
        read, write = await self._inner.__aenter__()
        return _EndWatchingRead(read, self._end), write

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self.ended = True  # closed by its owner: never to be used again either
        return await self._inner.__aexit__(exc_type, exc, tb)


class _EndWatchingRead:
    """A read stream that reports its end (the SDK's `ReadStream` protocol, delegated)."""

    def __init__(self, inner: Any, on_end: Callable[[], None]) -> None:
        self._inner = inner
        self._on_end = on_end

    def __getattr__(self, name: str) -> Any:
        # `last_context` and whatever else the dispatcher reads off the stream.
        return getattr(self._inner, name)

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except _ENDED:
            self._on_end()
            raise

    def __aiter__(self) -> _EndWatchingRead:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._inner.__anext__()
        except (StopAsyncIteration, *_ENDED):
            self._on_end()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _EndWatchingRead:
        await self._inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        # The dispatcher stops reading only when the session ends, whatever ended it.
        self._on_end()
        result: bool | None = await self._inner.__aexit__(exc_type, exc, tb)
        return result
