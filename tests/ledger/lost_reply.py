"""A TCP proxy to PostgreSQL that loses the server's reply to one statement.

The statement reaches the server and its transaction runs to its end (in
autocommit, the statement's own; in a transaction, the proxy passes the answers on
until the client's COMMIT, and waits for the server to be idle again), then the
client's connection is cut before it reads a byte of the last answer. This is the
failure a network or a server restart makes at the worst moment: stored, and not told.

With `at_once`, the connection is cut as soon as the statement is forwarded,
whatever the server is doing with it: still waiting for a lock, it runs on and
may commit after the client has looked and tried again.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from urllib.parse import urlsplit, urlunsplit

__all__ = ["LostReplyProxy"]

_NEGOTIATIONS = (
    bytes.fromhex("0000000804d2162f"),  # SSLRequest
    bytes.fromhex("0000000804d21630"),  # GSSENCRequest
)
"""What a client may send before its startup message; the server answers each with one
byte (`S`, `G` or `N`), the only server bytes not framed as messages."""


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
        self._at_once = False
        self.lost = threading.Event()
        """Set once a reply was lost: the statement had run to its end on the server and
        its transaction committed (with `at_once`: once the statement was sent)."""
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_reply_to(self, *markers: str, at_once: bool = False) -> None:
        """Lose the reply to the next statement whose bytes hold every one of `markers`
        (an append holds its operations' IDs and its events' topics: a read before it
        holds the IDs alone); `at_once`: cut without waiting for the server's answer."""
        with self._lock:
            self._markers = tuple(marker.encode() for marker in markers)
            self._at_once = at_once
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
        losing = False  # the marked statement went out: the server's answer is held back
        held: list[bytes] = []
        failed = False  # an ErrorResponse since: nothing of that transaction is stored
        replies = _Messages()
        with client, server:
            while True:
                # Waiting for a lost answer, not forever: a test then fails, not hangs.
                readable, _, _ = select.select([client, server], [], [], 30 if losing else None)
                if not readable:
                    return
                for source in readable:
                    try:
                        data = source.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    if source is client:
                        server.sendall(data)  # all of it, a long statement's later chunks too
                        if data[:8] in _NEGOTIATIONS:
                            replies.unframed += 1  # the server answers it with one byte
                        if not losing and self._take_marker(data):
                            if self._at_once:
                                self.lost.set()
                                return  # both ends close now, the statement on its way
                            losing = True
                        continue
                    passed: list[bytes] = []
                    for message in replies.feed(data):
                        if not losing:
                            passed.append(message)
                            continue
                        held.append(message)
                        kind = message[:1]
                        failed = failed or kind == b"E"
                        if kind == b"Z" and message[5:6] == b"I":  # the transaction is over
                            if not failed:  # committed: an answer lost, not a failure
                                self.lost.set()
                            return
                        if kind == b"Z":  # within a transaction: on, up to its COMMIT
                            passed += held
                            held = []
                    if passed:
                        client.sendall(b"".join(passed))


class _Messages:
    """The server's bytes, cut into protocol messages: a type byte, then an int32 length
    that counts itself and the body."""

    def __init__(self) -> None:
        self._buffer = b""
        self.unframed = 0
        """Single bytes owed before the next message (answers to SSL or GSS requests)."""
        self._encrypted = False

    def feed(self, data: bytes) -> list[bytes]:
        """The messages `data` completes, in order (a partial one waits for the rest)."""
        self._buffer += data
        messages: list[bytes] = []
        while self.unframed and self._buffer:
            answer, self._buffer = self._buffer[:1], self._buffer[1:]
            messages.append(answer)
            self.unframed -= 1
            # Encryption accepted: nothing after is readable here (nor is any marker in
            # what the client sends, so no answer is lost, and a test says so).
            self._encrypted = self._encrypted or answer in (b"S", b"G")
        if self._encrypted:
            messages.append(self._buffer)
            self._buffer = b""
            return [m for m in messages if m]
        while len(self._buffer) >= 5:
            end = 1 + int.from_bytes(self._buffer[1:5], "big")
            if len(self._buffer) < end:
                break
            messages.append(self._buffer[:end])
            self._buffer = self._buffer[end:]
        return messages
