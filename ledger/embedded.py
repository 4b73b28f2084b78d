"""The embedded default: every process of opledger on this machine, supervised.

`EmbeddedStack` starts a private nats-server (free loopback port, own store
directory), the ledger service over a SQLite file, and one executor process
per sample tool, each with its own NKey and only its own secrets. Everything
lives under one directory (default `./.opledger`); `stack.json` there tells
other commands (`opledger ops list`, `opledger demo`) what is running.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from executors.samples import SAMPLE_TOOLS
from ledger.config import find_home
from ledger.nats import (
    CredentialsError,
    CredentialSet,
    NatsServer,
    Role,
    connect_as,
    generate_credentials,
    load_credentials,
)
from ledger.nats.supervisor import free_port
from schemas import OpledgerError, StatusRequest, Subjects

__all__ = [
    "DEMO_APPROVERS",
    "SAMPLE_EXECUTORS",
    "EmbeddedStack",
    "StackInfo",
    "StackNotRunning",
    "StackStartError",
    "process_alive",
    "require_running_stack",
    "running_stack",
]

SAMPLE_EXECUTORS: dict[str, str] = dict(SAMPLE_TOOLS)
"""Tool → the sample executor that implements it."""

DEMO_HOST = "demo"
"""The agent host identity `opledger demo` uses."""
DEMO_APPROVERS: dict[str, tuple[str, ...]] = {
    "lead": ("support_lead",),
    "steward": ("data_steward",),
    "finance-1": ("finance_approver",),
    "finance-2": ("finance_approver",),
}
"""The embedded stack's approver identities and the approver roles its ledger
service gives them (one for each role the sample contracts ask for, and two
finance approvers for refunds that need two)."""
DEMO_OPERATOR = "ops"
"""The embedded stack's operator identity (`opledger ops cancel|resolve|retry --operator ops`)."""
_SECRET_PREFIX = "OPLEDGER_SECRET_"
_STATE_FILE = "stack.json"


class StackStartError(OpledgerError):
    """A process of the stack did not come up; its log tail says why."""

    code = "STACK_START_FAILED"


@dataclass(frozen=True)
class StackInfo:
    """What `stack.json` records about a running stack."""

    home: str
    nats_url: str
    database: str
    creds_dir: str
    supervisor_pid: int
    pids: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    nats_monitor: str | None = None
    """nats-server's HTTP monitoring URL, if the stack was started with the monitor on."""


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (signal 0: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StackNotRunning(OpledgerError):
    """No embedded stack runs from the home directory; the message says where it looked."""

    code = "STACK_NOT_RUNNING"


def require_running_stack(home: Path | None = None) -> StackInfo:
    """The stack running from `home` (default: the one `find_home` finds, as every
    `opledger` command does), or `StackNotRunning` naming where it looked."""
    home = (home or find_home()).resolve()
    info = running_stack(home)
    if info is None:
        raise StackNotRunning(
            f"no stack runs from {home}: start one with `opledger up` there,"
            " or point OPLEDGER_HOME at the home of a running one"
        )
    return info


def running_stack(home: Path) -> StackInfo | None:
    """The stack running from `home`, if its supervisor is alive."""
    path = home / _STATE_FILE
    try:
        info = StackInfo(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return info if process_alive(info.supervisor_pid) else None


def _die_with_parent() -> None:
    """In the child: receive SIGTERM when the supervisor dies, so nothing is orphaned."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _clean_env(extra: Mapping[str, str] = {}) -> dict[str, str]:
    # No process inherits another's secrets: only an executor gets its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SECRET_PREFIX)}
    env.update(extra)
    return env


class EmbeddedStack:
    """Start, watch and stop the embedded default.

    `monitor` turns on nats-server's HTTP monitoring endpoints, on 127.0.0.1
    only. Off by default: they answer without credentials, and `/connz` lists
    every connection's NKey and subscriptions, `/jsz` every stream, to any
    local user. Readiness is then asked over the client port, as the ledger.

    `seal_existing` lets the ledger service seal events no signed head covers
    yet (a home from before signed heads): see `--seal-existing` of the service.
    """

    def __init__(
        self,
        home: Path,
        *,
        executors: Mapping[str, str] = SAMPLE_EXECUTORS,
        contracts_dir: Path | None = None,
        ack_wait_s: float = 10.0,
        lease_grace_s: float = 2.0,
        metrics: bool = True,
        monitor: bool = False,
        seal_existing: bool = False,
        extra_env: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.home = home.resolve()
        self.executors = dict(executors)
        self.contracts_dir = contracts_dir
        self.ack_wait_s = ack_wait_s
        self.lease_grace_s = lease_grace_s
        self.metrics = metrics
        self.monitor = monitor
        self.seal_existing = seal_existing
        self.extra_env = {k: dict(v) for k, v in (extra_env or {}).items()}
        self.server: NatsServer | None = None
        self.credentials: CredentialSet | None = None
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.metric_ports: dict[str, int] = {}
        self._logs: list[IO[bytes]] = []

    # ------------------------------------------------------------------ paths

    @property
    def database(self) -> Path:
        """The SQLite ledger."""
        return self.home / "ledger.db"

    @property
    def creds_dir(self) -> Path:
        """One NKey seed per identity."""
        return self.home / "creds"

    @property
    def email_db(self) -> Path:
        """The sample e-mail provider's records (the e-mail executor's secret)."""
        return self.home / "email-provider.db"

    def log_path(self, name: str) -> Path:
        """Where process `name` logs."""
        return self.home / "logs" / f"{name}.log"

    # -------------------------------------------------------------- credentials

    def _credentials(self) -> CredentialSet:
        tools = sorted(self.executors)
        try:
            existing = load_credentials(self.creds_dir)
            names = {(i.role.value, i.name) for i in existing.identities}
            wanted = {(Role.EXECUTOR.value, t) for t in tools} | {(Role.HOST.value, DEMO_HOST)}
            wanted |= {(Role.APPROVER.value, a) for a in DEMO_APPROVERS}
            wanted |= {(Role.OPERATOR.value, DEMO_OPERATOR)}
            if wanted <= names:
                return existing
        except CredentialsError:
            pass
        return generate_credentials(
            self.creds_dir,
            hosts=[DEMO_HOST],
            tools=tools,
            approvers=sorted(DEMO_APPROVERS),
            operators=[DEMO_OPERATOR],
        )

    def _secrets_file(self, tool: str) -> Path | None:
        secrets = {"email_provider_db": str(self.email_db)} if tool == "send_customer_email" else {}
        if not secrets:
            return None
        path = self.home / "secrets" / f"{tool}.json"
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.write_text(json.dumps(secrets))
        path.chmod(0o600)
        return path

    # -------------------------------------------------------------- processes

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        path = self.log_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        log = path.open("ab")
        self._logs.append(log)
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )
        self.processes[name] = process
        return process

    def start_service(self) -> None:
        """Start the ledger service process."""
        assert self.server is not None and self.credentials is not None
        argv = [
            sys.executable,
            "-m",
            "ledger.server",
            "--database",
            str(self.database),
            "--nats-url",
            self.server.url,
            "--creds",
            str(self.credentials.ledger.seed_path),
            "--tools",
            ",".join(sorted(self.executors)),
            "--ack-wait",
            str(self.ack_wait_s),
            "--lease-grace",
            str(self.lease_grace_s),
        ]
        for approver, roles in sorted(DEMO_APPROVERS.items()):
            argv += ["--approver", f"{approver}={','.join(roles)}"]
        if self.seal_existing:
            argv.append("--seal-existing")
        if self.contracts_dir is not None:
            argv += ["--contracts", str(self.contracts_dir)]
        if self.metrics:
            self.metric_ports["ledger"] = free_port()
            argv += ["--metrics-port", str(self.metric_ports["ledger"])]
        self._spawn("ledger", argv, _clean_env())

    def start_executor(
        self, tool: str, *, name: str | None = None, env: Mapping[str, str] = {}
    ) -> subprocess.Popen[bytes]:
        """Start one executor process of `tool` with its own NKey and secrets."""
        assert self.server is not None and self.credentials is not None
        name = name or f"executor-{tool}"
        argv = [
            sys.executable,
            "-m",
            "executors",
            "run",
            self.executors[tool],
            "--creds",
            str(self.credentials.executor(tool).seed_path),
            "--nats-url",
            self.server.url,
            "--contracts",
            str(self.contracts_dir or _catalog_dir()),
            "--name",
            name,
        ]
        secrets = self._secrets_file(tool)
        if secrets is not None:
            argv += ["--secrets", str(secrets)]
        if self.metrics and name == f"executor-{tool}":
            self.metric_ports[name] = free_port()
            argv += ["--metrics-port", str(self.metric_ports[name]), "--metrics-addr", "127.0.0.1"]
        return self._spawn(name, argv, _clean_env({**self.extra_env.get(tool, {}), **env}))

    def start_nats(self) -> NatsServer:
        """Generate (or reuse) the credentials and start nats-server, as `start` does.

        Ready once JetStream answers the ledger's identity (or `/healthz`, with
        the monitor on).
        """
        self.home.mkdir(parents=True, exist_ok=True)
        self.credentials = self._credentials()
        self.server = NatsServer(
            self.home / "nats",
            authorization=self.credentials.authorization_config,
            monitor=self.monitor,
            probe_identity=self.credentials.ledger,
        )
        self.server.start()
        return self.server

    def start(self, timeout_s: float = 30.0) -> StackInfo:
        """Start everything and wait until the ledger answers."""
        try:
            self.start_nats()
            self.start_service()
            self._wait_for_ledger(timeout_s)
            for tool in sorted(self.executors):
                self.start_executor(tool)
            self._check_alive()
        except BaseException:
            self.stop()
            raise
        info = self.info()
        (self.home / _STATE_FILE).write_text(json.dumps(asdict(info), indent=2))
        return info

    def info(self) -> StackInfo:
        """Where everything is."""
        assert self.server is not None
        return StackInfo(
            home=str(self.home),
            nats_url=self.server.url,
            database=str(self.database),
            creds_dir=str(self.creds_dir),
            supervisor_pid=os.getpid(),
            pids={name: p.pid for name, p in self.processes.items()},
            metrics={
                n: f"http://127.0.0.1:{port}/metrics" for n, port in self.metric_ports.items()
            },
            logs={name: str(self.log_path(name)) for name in self.processes},
            nats_monitor=self.server.monitor_url,
        )

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                tail = self.log_path(name).read_text(errors="replace")[-2000:]
                raise StackStartError(f"{name} exited with {process.returncode}:\n{tail}")

    def _wait_for_ledger(self, timeout_s: float) -> None:
        assert self.server is not None and self.credentials is not None
        url, host = self.server.url, self.credentials.host(DEMO_HOST)

        async def probe() -> bool:
            try:
                nc = await connect_as(url, host, allow_reconnect=False, connect_timeout=2)
            except Exception:
                return False
            try:
                request = StatusRequest(operation_id="probe").model_dump_json().encode()
                await nc.request(Subjects.status(DEMO_HOST), request, timeout=1)
                return True
            except Exception:
                return False
            finally:
                await nc.close()

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            if asyncio.run(probe()):
                return
            time.sleep(0.2)
        raise StackStartError(f"the ledger service did not answer within {timeout_s:.0f} s")

    def stop(self) -> None:
        """Stop every process (executors first, the server last) and forget the stack."""
        order = sorted(self.processes, key=lambda n: n == "ledger")
        for name in order:
            process = self.processes[name]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for name in order:
            process = self.processes[name]
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        if self.server is not None:
            self.server.stop()
        for log in self._logs:
            log.close()
        state = self.home / _STATE_FILE
        if state.exists():
            try:
                info = json.loads(state.read_text())
                if info.get("supervisor_pid") == os.getpid():
                    state.unlink()
            except (OSError, ValueError):
                pass

    def describe(self) -> str:
        """People-readable: where everything is."""
        info = self.info()
        lines = [
            f"opledger is running from {info.home}",
            f"  NATS        {info.nats_url}",
        ]
        if info.nats_monitor is not None:
            lines.append(f"  NATS monitor {info.nats_monitor} (answers without credentials)")
        lines += [
            f"  ledger      sqlite:{info.database}",
            f"  credentials {info.creds_dir}",
        ]
        lines += [f"  metrics     {name}: {url}" for name, url in sorted(info.metrics.items())]
        lines.append(f"  processes   {len(info.pids)} (logs in {self.home / 'logs'})")
        return "\n".join(lines)


def _catalog_dir() -> Path:
    from policy.catalog import CATALOG_DIR

    return CATALOG_DIR


def as_dict(info: StackInfo) -> dict[str, Any]:
    """`info` as JSON-friendly data."""
    return asdict(info)
