"""A real embedded stack per test: nats-server, the ledger service and executors,
each a separate process with its own least-privilege credentials."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ledger import Ledger, StorageConfig, build_ledger
from ledger.nats import CredentialSet, NatsServer, connect_as, generate_credentials
from policy.catalog import CATALOG_DIR, sample_plugins
from schemas import StatusRequest, Subjects
from tests.conftest import drop_schema, postgres_storage_or_skip

SAMPLE_TOOLS = {
    "search_documents": "executors.samples.documents:search_documents",
    "send_customer_email": "executors.samples.email:send_customer_email",
    "query_orders": "executors.samples.orders:query_orders",
}
HOSTS = ("h1", "h2")
ACK_WAIT_S = 2.0
LEASE_GRACE_S = 1.0
REDISPATCH_AFTER_S = 2.0


@pytest.fixture
def anyio_backend() -> str:
    """nats-py is asyncio-only."""
    return "asyncio"


@dataclass
class Stack:
    """The running processes and where their state lives."""

    home: Path
    server: NatsServer
    credentials: CredentialSet
    service: subprocess.Popen[bytes]
    executors: dict[str, list[subprocess.Popen[bytes]]] = field(default_factory=dict)

    @property
    def email_db(self) -> Path:
        """The fake e-mail provider's file, shared by every e-mail executor process."""
        return self.home / "email-provider.db"

    def start_executor(
        self, tool: str, *options: str, spec: str | None = None, **env: str
    ) -> subprocess.Popen[bytes]:
        """Start one more executor process of `tool` with its own credentials.

        `spec`: another `MODULE:TOOL` than the sample; `options`: more flags.
        """
        log = (self.home / f"exec-{tool}-{len(self.executors.get(tool, []))}.log").open("wb")
        process = subprocess.Popen(
            [
                sys.executable, "-m", "executors", "run", spec or SAMPLE_TOOLS[tool],
                "--creds", str(self.credentials.executor(tool).seed_path),
                "--nats-url", self.server.url,
                "--contracts", str(CATALOG_DIR),
                "--name", f"{tool}-{len(self.executors.get(tool, []))}",
                *options,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OPLEDGER_SECRET_EMAIL_PROVIDER_DB": str(self.email_db), **env},
        )
        self.executors.setdefault(tool, []).append(process)
        return process

    def ledger(self) -> Ledger:
        """A second handle on the service's ledger (for approvals and inspection)."""
        resolver, rules = sample_plugins()
        return build_ledger(StorageConfig.sqlite(self.home / "ledger.db"), resolver=resolver,
                            rules=rules)

    def log(self, name: str) -> str:
        """A process log, for failure messages."""
        path = self.home / name
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@dataclass
class BackendStack:
    """nats-server, the ledger service over one storage backend, and its executors."""

    home: Path
    storage: StorageConfig
    server: NatsServer
    credentials: CredentialSet
    service: subprocess.Popen[bytes]
    contracts: Path
    executors: list[subprocess.Popen[bytes]] = field(default_factory=list)
    service_argv: list[str] = field(default_factory=list)

    def restart_service(self, meanwhile: Callable[[], object] | None = None) -> None:
        """Stop the ledger service and start it again as it was started (running
        `meanwhile` while it is down)."""
        _stop(self.service)
        if meanwhile is not None:
            meanwhile()
        self.service = subprocess.Popen(
            self.service_argv,
            stdout=(self.home / "service.log").open("ab"), stderr=subprocess.STDOUT,
        )
        _wait_for_service(self)

    def log(self, name: str) -> str:
        """A process log, for failure messages."""
        path = self.home / name
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def ledger(self) -> Ledger:
        """A second handle on the service's ledger (for inspection)."""
        resolver, rules = sample_plugins()
        return build_ledger(self.storage, resolver=resolver, rules=rules,
                            contracts_dir=self.contracts)

    @property
    def email_db(self) -> Path:
        """The fake e-mail provider's file, shared by the executors and the test."""
        return self.home / "email-provider.db"

    def start_executor(
        self, tool: str, *options: str, spec: str | None = None, **env: str
    ) -> subprocess.Popen[bytes]:
        """One executor process of `tool` (the sample one, or `spec`), with its own
        credentials (and `env` added to its environment)."""
        name = f"executor-{tool}-{len(self.executors)}"
        process = subprocess.Popen(
            [sys.executable, "-m", "executors", "run", spec or SAMPLE_TOOLS[tool],
             "--creds", str(self.credentials.executor(tool).seed_path),
             "--nats-url", self.server.url, "--contracts", str(self.contracts),
             "--name", name, *options],
            stdout=(self.home / f"{name}.log").open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, "OPLEDGER_SECRET_EMAIL_PROVIDER_DB": str(self.email_db), **env},
        )
        self.executors.append(process)
        return process


def interrupt(process: subprocess.Popen[Any], timeout_s: float) -> None:
    """Ctrl-C to `process` (SIGINT), as a person at its terminal would; killed if it has
    not stopped within `timeout_s`."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def opledger_command() -> list[str]:
    """The `opledger` command the package installed beside this Python, as a reader runs
    it (`.ci/run` installs the package, not a checkout: this is the console script)."""
    script = Path(sys.executable).parent / "opledger"
    if script.exists():
        return [str(script)]
    found = shutil.which("opledger")
    assert found is not None, "the package's `opledger` command is not installed"
    return [found]


@contextmanager
def backend_stack(
    home: Path,
    backend: str,
    *,
    hosts: Sequence[str] = HOSTS,
    tools: Sequence[str] = tuple(sorted(SAMPLE_TOOLS)),
    contracts: Path = CATALOG_DIR,
    service_options: Sequence[str] = (),
    approvers: Mapping[str, Sequence[str]] | None = None,
) -> Iterator[BackendStack]:
    """A running stack whose ledger service writes to `backend` ("sqlite" or "postgres",
    a fresh schema, dropped afterwards); no executors until a test starts them.

    `approvers`: approver identity -> the roles the service gives it (an identity
    mapped to no role exists, and holds none)."""
    if backend == "sqlite":
        storage = StorageConfig.sqlite(home / "ledger.db")
        database = ["--database", str(home / "ledger.db")]
    else:
        storage = postgres_storage_or_skip()
        database = ["--database", storage.postgres_dsn or "",
                    "--postgres-schema", storage.postgres_schema]
    approvers = approvers or {}
    credentials = generate_credentials(
        home / "creds", hosts=hosts, tools=tools, auditors=("auditor",), operators=("ops-lead",),
        approvers=sorted(approvers),
    )
    roles = [f"--approver={name}={','.join(held)}" for name, held in approvers.items() if held]
    server = NatsServer(home / "nats", authorization=credentials.authorization_config)
    server.start()
    argv = [sys.executable, "-m", "ledger.server", *database, "--nats-url", server.url,
            "--creds", str(credentials.ledger.seed_path), "--tools", ",".join(tools),
            "--contracts", str(contracts), *roles, *service_options]
    service = subprocess.Popen(
        argv, stdout=(home / "service.log").open("wb"), stderr=subprocess.STDOUT
    )
    stack = BackendStack(home, storage, server, credentials, service, contracts,
                         service_argv=argv)
    try:
        _wait_for_service(stack)
        yield stack
    finally:
        for process in reversed(stack.executors):
            _stop(process)
        _stop(stack.service)  # the one running now (`restart_service` replaces it)
        server.stop()
        if storage.is_postgres:
            drop_schema(storage)


def _wait_for_service(stack: Stack | BackendStack, timeout_s: float = 20.0) -> None:
    async def probe() -> bool:
        nc = await connect_as(stack.server.url, stack.credentials.host("h1"),
                              allow_reconnect=False, connect_timeout=2)
        try:
            request = StatusRequest(operation_id="probe").model_dump_json().encode()
            await nc.request(Subjects.status("h1"), request, timeout=1)
            return True
        except Exception:
            return False
        finally:
            await nc.close()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stack.service.poll() is not None:
            raise RuntimeError(f"ledger service exited:\n{stack.log('service.log')}")
        if asyncio.run(probe()):
            return
        time.sleep(0.2)
    raise RuntimeError(f"ledger service did not answer:\n{stack.log('service.log')}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """nats-server + ledger service (no executors yet: each test starts its own)."""
    credentials = generate_credentials(
        tmp_path / "creds", hosts=HOSTS, tools=sorted(SAMPLE_TOOLS), auditors=("auditor",)
    )
    server = NatsServer(tmp_path / "nats", authorization=credentials.authorization_config)
    server.start()
    service_log = (tmp_path / "service.log").open("wb")
    service = subprocess.Popen(
        [
            sys.executable, "-m", "ledger.server",
            "--database", str(tmp_path / "ledger.db"),
            "--nats-url", server.url,
            "--creds", str(credentials.ledger.seed_path),
            "--tools", ",".join(sorted(SAMPLE_TOOLS)),
            "--ack-wait", str(ACK_WAIT_S),
            "--lease-grace", str(LEASE_GRACE_S),
            "--redispatch-after", str(REDISPATCH_AFTER_S),
        ],
        stdout=service_log,
        stderr=subprocess.STDOUT,
    )
    running = Stack(tmp_path, server, credentials, service)
    try:
        _wait_for_service(running)
        yield running
    finally:
        for processes in running.executors.values():
            for process in processes:
                _stop(process)
        _stop(running.service)  # the one running now (a test may have replaced it)
        server.stop()
