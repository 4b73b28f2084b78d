"""A TCP proxy to PostgreSQL that loses the server's reply to one statement.

The statement reaches the server and runs to its end (in autocommit, that is its
commit: the proxy waits for the server's ReadyForQuery), then the client's
connection is cut before it reads a byte of the answer. This is the failure a
network or a server restart makes at the worst moment: stored, and not told.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

__all__ = ["LostReplyProxy"]

_READY_FOR_QUERY = b"Z\x00\x00\x00\x05"
"""The server's ReadyForQuery message, up to its transaction status byte."""


class LostReplyProxy:
    """Forwards every connection to the DSN's server; `lose_reply_to` arms one loss."""

    def __init__(self, dsn: str) -> None:
        parts = urlsplit(dsn)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        user = f"{parts.username}@" if parts.username else ""
        self.dsn = urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{port}"))
        """The DSN to give the client: the same database, through this proxy."""
        self._lock = threading.Lock()
        self._markers: tuple[bytes, ...] | None = None
        self.lost = threading.Event()
        """Set once a reply was lost: the statement had run to its end on the server."""
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_reply_to(self, *markers: str) -> None:
        """Lose the reply to the next statement whose bytes hold every one of `markers`
        (an append holds its operations' IDs and its events' topics: a read before it
        holds the IDs alone)."""
        with self._lock:
            self._markers = tuple(marker.encode() for marker in markers)
        self.lost.clear()

    def close(self) -> None:
        """Stop accepting (the connections open now run on until their ends close)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()

    def _take_marker(self, chunk: bytes) -> bool:
        with self._lock:
            if self._markers is not None and all(m in chunk for m in self._markers):
                self._markers = None
                return True
        return False

    def _pipe(self, client: socket.socket, server: socket.socket) -> None:
        with client, server:
            for source, data in _chunks(client, server):
                if source is client:
                    server.sendall(data)
                    if self._take_marker(data):
                        self._swallow_reply(server)
                        return  # both ends close: the client never hears the answer
                else:
                    client.sendall(data)

    def _swallow_reply(self, server: socket.socket) -> None:
        seen = b""
        while _READY_FOR_QUERY not in seen:
            data = server.recv(65536)
            if not data:
                return
            seen = seen[-16:] + data
        self.lost.set()


def _chunks(
    client: socket.socket, server: socket.socket
) -> Iterator[tuple[socket.socket, bytes]]:
    """What either end sends, as it comes, until one of them closes."""
    while True:
        readable, _, _ = select.select([client, server], [], [])
        for source in readable:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            yield source, data
