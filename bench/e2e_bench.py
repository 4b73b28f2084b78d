"""End-to-end operations per second and latency for an auto-approved no-op tool.

The embedded default stack, every part its own process, as in `tests/e2e`:
nats-server with generated least-privilege credentials, the ledger service
(`python -m ledger.server`, on SQLite, or with `--storage postgres` on a fresh
schema of the PostgreSQL the tests use), and 1..n executors of the `noop` tool
(`python -m executors run bench.noop_tool:noop`, contract
`bench/contracts/noop.yaml`: pure read, approval never, no limits, low risk).
This process is the agent host (`ledger.client.AgentHostClient`).

Per configuration (executors x items in flight per executor) it measures:

- throughput: `--ops` operations, `--concurrency` in flight, from the first
  propose until every outcome is final;
- latency at a fixed rate: `--rate` operations per second (a list: one phase
  per rate) for `--duration` seconds; each latency runs from the operation's
  *scheduled* start to its final outcome, so a stalled host loop counts
  against it (no coordinated omission). A rate the stack cannot sustain is
  flagged "overloaded": its latencies are then queueing time;
- the baseline in the same run, on the same nats-server: a raw JetStream round
  trip with no ledger (the bench publishes a work item to a work-queue stream,
  `bench/raw_roundtrip_worker.py` in as many processes with as many items in
  flight pulls it, publishes a result to a results stream and waits for the
  PubAck, then acks; the bench pulls the result), same two phases. Every
  consumer pulls with `schemas.PullConsumer`, as the executors and the
  service do;
- with `--floor`, the design's floor, same phases: every NATS message one
  operation makes through opledger (the proposal request and reply, five feed
  records, the work item, the lease request and reply, the result, the outcome
  notice), of about the real sizes and published as the relay publishes them,
  between processes laid out as the real ones (`bench/floor_service.py`, the raw
  worker with `--lease-subject`), with no ledger work at all. No implementation of
  this design can beat it on this machine, so `ledger / floor` says how much of
  an operation's cost is the implementation's and how much the hops'.
  `floor-3hop` leaves the lease hop out (the dispatch lease's floor).

Two host modes (`--host-modes`):

- `sdk`: `host.propose(...)` then `host.outcome(op)`, the SDK's own path
  (one outcome subscription per client; a status request only when no
  announcement came within the SDK's poll interval);
- `watch`: `host.propose(...)`, and every outcome as it comes through the SDK's
  one subscription on `ops.outcome.<host>.>` (`on_outcome`), made before the run.

During every phase the CPU time of every process is sampled from `/proc`,
and printed as CPU milliseconds per operation, which says where an
operation's cost goes. `--profile` runs the service and the executors under
`bench/launcher.py` (cProfile on every thread) and prints the top functions;
`--service-patches` / `--executor-patches` run them with experiments from
`bench/launcher.py` that mimic proposed changes outside `bench/` (no file
there is edited), to say what each change would gain.

`--peer dbos` (with the `bench` extra, DBOS Transact) then runs the same no-op as
a DBOS workflow with one step on the same PostgreSQL (`bench/dbos_peer.py`, a
process of its own), sequential and concurrent, and prints it beside opledger on
PostgreSQL with the ratio of their best throughputs.

    python bench/e2e_bench.py [--ops 3000] [--concurrency 200] [--rate 200,20] \\
        [--duration 10] [--executors 1,2] [--batch 1,16] [--host-modes watch,sdk] \\
        [--tool noop|noop_sync] [--service-log-level INFO] [--profile] \\
        [--service-patches loop-stalls=4,gc-pauses] [--executor-patches gc-pauses] \\
        [--storage sqlite,postgres] [--prefill 0,1000000] [--budget 0,100000000] \\
        [--peer dbos] [--floor] [--nats-rights production,open] \\
        [--ab sqlite-normal --pairs 3] [--ab lease-in-result --ab-executors lease-in-result]

`--ab PATCHES` compares a change against the code as it is, in one run: each
configuration runs without (A) and with (B) those service patches, A B B A ... for
`--pairs` pairs, and a table prints every run's throughput, percentiles and CPU per
operation, each side's median and B's median over A's, beside the raw round trip of
each run (how far the machine drifted meanwhile).

`--nats-rights open` (a diagnostic) runs the stack with every identity a user of
one account without permissions, to show what the accounts, imports and allow
lists cost nats-server; a list runs each.

`--budget N` gives the no-op a budget of N calls per hour (all the bench's calls
are one caller's), so every proposal is counted against it as a production
tool's would be; 0 is none. A list runs each.

`--prefill N` is the scale run: before the service starts, N events of finished
no-op operations are stored through the ledger's own batched path and sealed
with the service's key, and the relay's position is set after them (an old
history was published when it happened); the phases then run on that ledger,
and afterwards
`opledger audit verify` (its own process, read-only) checks all of it, timed.
With `--prefill 0,N` the summary prints throughput at N events against the
empty ledger of the same run (target: within 10 %).

Targets on the 2-core reference machine: at least 1,000 operations/s end to
end, and p99 under 15 ms at 200 operations/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import math
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import nkeys  # type: ignore[import-untyped]  # nkeys ships no type information
import orjson
import psycopg
from floor_service import FLOOR  # bench/, beside this script
from nats.aio.client import Client
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from ledger import StorageConfig, Submission, build_ledger
from ledger.audit.seal import SealKey
from ledger.client import AgentHostClient
from ledger.nats import CredentialSet, NatsServer, connect_as, generate_credentials
from ledger.nats.security import LEDGER_USERS_END, new_user_seed
from ledger.server.relay import RelayPositions
from ledger.service import SubmitItem
from policy.catalog import CATALOG_DIR
from schemas import (
    LeaseDecision,
    LeaseReply,
    OperationStatus,
    Provenance,
    PullConsumer,
    ResultEnvelope,
    RuntimeContext,
    StatusRequest,
    Subjects,
    ToolProposal,
    ledger_operation_id,
)

POSTGRES_DSN = os.environ.get(
    "OPLEDGER_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test"
)
"""Where `--storage postgres` runs: the DSN the tests use (a fresh schema per stack)."""

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
NOOP_CONTRACT = BENCH / "contracts" / "noop.yaml"
HOST = "bench"
TOOL = "noop"
CONTEXT = RuntimeContext(principal="bench", tenant="acme")

RAW_WORK_STREAM = "BENCH_RAW_WORK"
RAW_WORK_SUBJECT = "bench.raw.work"
RAW_WORK_CONSUMER = "raw_workers"
RAW_RESULTS_STREAM = "BENCH_RAW_RESULTS"
RAW_RESULT_SUBJECT = "bench.raw.result"
RAW_RESULTS_CONSUMER = "raw_results"
FLOOR_SERVICE_READY = "floor service ready"

OUTCOME_TIMEOUT_S = 60.0
"""Longest wait for one outcome; an operation slower than this counts as failed."""
PROPOSE_TIMEOUT_S = 10.0
"""The SDK's request timeout; it tries a proposal three times (idempotently)."""


# ---------------------------------------------------------------- measurements


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` percentile (0..100) of already sorted values; NaN if empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclass
class PhaseResult:
    """One measured phase: how many operations, how long, their latencies (seconds)."""

    name: str
    ops: int
    wall_s: float
    failures: int
    latencies: list[float]
    cpu_ms_per_op: dict[str, float] = field(default_factory=dict)
    nats_per_op: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    """Connection name → messages in and out and kilobytes through the server per
    operation, from nats-server's own `/connz` (what each process sends and gets)."""
    rss_mb: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    """Process group → resident memory (MB) before and after the phase, and its peak."""
    service_rss_curve: list[float] = field(default_factory=list)
    """The service's resident memory (MB) sampled through the phase, every half second."""

    @property
    def ops_per_s(self) -> float:
        """Successfully completed operations per second of wall time."""
        return (self.ops - self.failures) / self.wall_s if self.wall_s > 0 else math.nan

    def p(self, q: float) -> float:
        """Latency percentile `q`, in milliseconds."""
        return percentile(sorted(self.latencies), q) * 1000

    @property
    def ours_cpu_ms_per_op(self) -> float:
        """CPU milliseconds per operation of the stack's own processes (not "other")."""
        return sum(v for k, v in self.cpu_ms_per_op.items() if k != "other" and not math.isnan(v))


class Driver:
    """One way of running a single operation end to end; `run_one` says if it succeeded."""

    name = "driver"

    async def start(self) -> None:
        """Connect and subscribe."""

    async def run_one(self, key: str) -> bool:  # pragma: no cover - interface
        """Run operation `key` until its outcome is known."""
        raise NotImplementedError

    async def close(self) -> None:
        """Disconnect."""


async def run_throughput(
    driver: Driver, prefix: str, ops: int, concurrency: int, timeout_s: float
) -> PhaseResult:
    """`ops` operations with at most `concurrency` in flight; wall time until all are final."""
    counter = itertools.count()
    latencies: list[float] = []
    failures = 0
    loop = asyncio.get_running_loop()

    async def worker() -> None:
        nonlocal failures
        while (index := next(counter)) < ops:
            started = loop.time()
            ok = await _attempt(driver, f"{prefix}-{index}")
            latencies.append(loop.time() - started)
            failures += not ok

    started = loop.time()
    workers = [loop.create_task(worker()) for _ in range(min(concurrency, ops))]
    await _bounded(workers, timeout_s)
    # Operations never started or cut off by the timeout count as failures.
    failures += ops - len(latencies)
    return PhaseResult(driver.name, ops, loop.time() - started, failures, latencies)


async def run_fixed_rate(
    driver: Driver, prefix: str, rate: float, duration_s: float, timeout_s: float
) -> PhaseResult:
    """`rate` operations per second for `duration_s`; latency from each scheduled start."""
    total = max(1, int(rate * duration_s))
    latencies: list[float] = []
    failures = 0
    loop = asyncio.get_running_loop()

    async def one(index: int, scheduled: float) -> None:
        nonlocal failures
        ok = await _attempt(driver, f"{prefix}-{index}")
        latencies.append(loop.time() - scheduled)
        failures += not ok

    tasks: list[asyncio.Task[None]] = []
    first = loop.time() + 0.05
    for index in range(total):
        scheduled = first + index / rate
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(one(index, scheduled)))
    await _bounded(tasks, timeout_s)
    failures += total - len(latencies)
    return PhaseResult(driver.name, total, loop.time() - first, failures, latencies)


async def _attempt(driver: Driver, name: str) -> bool:
    """One operation through `driver`: True if it succeeded (an exception is a failure)."""
    try:
        return await driver.run_one(name)
    except Exception:
        return False


async def _bounded(tasks: list[asyncio.Task[None]], timeout_s: float) -> None:
    """Wait for `tasks` at most `timeout_s`; cancel what is left (counted by the caller)."""
    _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
        print(f"!! {len(pending)} tasks still running after {timeout_s:g} s; cancelled",
              file=sys.stderr)


# ------------------------------------------------------------------- processes


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads), from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return math.nan
    fields = stat.rsplit(")", 1)[1].split()
    # After the command name: state is field 3; utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mb(pid: int) -> tuple[float, float]:
    """(resident, peak resident) memory of process `pid` in MB, from /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return math.nan, math.nan
    values = {
        line.split(":", 1)[0]: int(line.split()[1]) / 1024
        for line in status.splitlines()
        if line.startswith(("VmRSS:", "VmHWM:"))
    }
    return values.get("VmRSS", math.nan), values.get("VmHWM", math.nan)


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all CPUs, not idle or iowait), from /proc."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _stop(process: subprocess.Popen[bytes], name: str, timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; says so when a process had to be killed."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"!! {name} did not stop within {timeout_s:g} s of SIGTERM; killed",
                  file=sys.stderr)
            process.kill()
            process.wait(timeout=5)
    elif process.returncode:
        print(f"!! {name} had exited early with {process.returncode}", file=sys.stderr)


def _contracts_dir(home: Path, budget: int = 0) -> Path:
    """The sample catalog plus `noop.yaml` (with `budget` calls per hour, if any), as an
    operator's contract directory."""
    directory = home / "contracts"
    directory.mkdir()
    for contract in sorted(CATALOG_DIR.glob("*.yaml")):
        shutil.copy(contract, directory / contract.name)
    text = NOOP_CONTRACT.read_text()
    if budget:
        text = text.replace("\ntargets: []", f"\nlimits:\n  max_per_hour: {budget}\n\ntargets: []")
        assert f"max_per_hour: {budget}" in text, "noop.yaml no longer has `targets: []`"
    (directory / NOOP_CONTRACT.name).write_text(text)
    return directory


def _new_bench_key(seed_path: Path) -> str:
    """A new NKey user for the bench's own connections: its seed written to `seed_path`
    (0600), its public key returned for the server's config."""
    seed = new_user_seed()
    seed_path.write_bytes(seed + b"\n")
    seed_path.chmod(0o600)
    return str(nkeys.from_seed(bytearray(seed)).public_key.decode())


def _with_bench_user(credentials: CredentialSet, seed_path: Path) -> str:
    """The server's authorization block plus one unrestricted NKey user for the baseline.

    The raw round trip then runs on the very server the ledger uses, and
    authenticates the same way (an NKey user), without touching the ledger's
    own identities or their permissions.
    """
    public_key = _new_bench_key(seed_path)
    block = credentials.authorization_config
    head, closing, tail = block.partition(LEDGER_USERS_END)
    assert closing, "unexpected authorization block layout"
    # In the streams' account, without permissions: the baseline's own stream.
    user = (
        "      {\n        # bench raw JetStream baseline\n"
        f"        nkey: {json.dumps(public_key)}\n      }}\n"
    )
    return head + user + closing + tail


def _open_accounts(credentials: CredentialSet, seed_path: Path) -> str:
    """Every identity, and the bench's user, in one account without permissions.

    A diagnostic only (`--nats-rights open`): the same processes, subjects and NKeys
    as production, with none of the accounts, service imports and allow lists that
    keep each executor to its own tool. What nats-server spends with them, against
    this, is what least privilege costs it.
    """
    keys = [identity.public_key for identity in credentials.identities]
    keys.append(_new_bench_key(seed_path))
    users = "".join(f"      {{ nkey: {json.dumps(key)} }}\n" for key in keys)
    return (
        "accounts {\n  LEDGER {\n    jetstream: enabled\n    users: [\n"
        f"{users}    ]\n  }}\n}}\n"
    )


@dataclass
class Settings:
    """What one stack runs with."""

    executors: int
    batch: int
    tool: str
    service_log_level: str
    profile: bool
    service_patches: tuple[str, ...] = ()
    executor_patches: tuple[str, ...] = ()
    storage: str = "sqlite"
    """sqlite (a file in the stack's home) or postgres (a fresh schema at
    $OPLEDGER_TEST_POSTGRES_DSN, the DSN the tests use, dropped afterwards)."""
    prefill: int = 0
    """Events stored before the service starts (the scale run), 0 for an empty ledger."""
    budget: int = 0
    """The no-op's budget, calls per hour (0: none)."""
    services: int = 1
    """Ledger service processes sharing the request subjects (PostgreSQL only: the
    production topology's queue groups; one of them relays)."""
    floor: bool = False
    """Also run the design's floor (`bench/floor_service.py`): every message of an
    operation, no ledger work."""
    nats_rights: str = "production"
    """production: the accounts, imports and allow lists `opledger` deploys; open: every
    identity a user of one account without permissions (a diagnostic: what least
    privilege costs nats-server; the service then runs with the `any-reply` patch)."""

    @property
    def label(self) -> str:
        """A short name for reports."""
        label = f"{self.storage} exec={self.executors} batch={self.batch} tool={self.tool}"
        if self.service_patches:
            label += f" service-patches={','.join(self.service_patches)}"
        if self.executor_patches:
            label += f" executor-patches={','.join(self.executor_patches)}"
        if self.prefill:
            label += f" prefill={self.prefill:,}"
        if self.budget:
            label += f" budget={self.budget:,}/h"
        if self.services > 1:
            label += f" services={self.services}"
        if self.nats_rights != "production":
            label += f" nats-rights={self.nats_rights}"
        return label


class Stack:
    """nats-server, the ledger service, noop executors and raw workers, in one temp dir."""

    def __init__(self, home: Path, settings: Settings) -> None:
        self.home = home
        self.settings = settings
        self.storage = (
            StorageConfig.postgres(POSTGRES_DSN, schema=f"bench_{uuid.uuid4().hex[:12]}")
            if settings.storage == "postgres"
            else StorageConfig.sqlite(home / "ledger.db")
        )
        self.server: NatsServer | None = None
        self.credentials: CredentialSet | None = None
        self.bench_seed = home / "bench-raw.nk"
        self.contracts = _contracts_dir(home, settings.budget)
        self.service: subprocess.Popen[bytes] | None = None
        """The first service (the one `--service-patches` and `--profile` also reach)."""
        self.services: list[subprocess.Popen[bytes]] = []
        self.executors: list[subprocess.Popen[bytes]] = []
        self.prefill_report: str | None = None
        self.raw_workers: list[subprocess.Popen[bytes]] = []
        self.floor_service: subprocess.Popen[bytes] | None = None
        self.floor_workers: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []
        self._env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        )}

    @property
    def url(self) -> str:
        """The nats-server client URL."""
        assert self.server is not None
        return self.server.url

    def _spawn(
        self, module: str, args: list[str], log_name: str, patches: Sequence[str]
    ) -> subprocess.Popen[bytes]:
        """`python -m module args`, or through `bench/launcher.py` to profile or patch it."""
        log = self._log_file(log_name)
        options = [option for patch in patches for option in ("--patch", patch)]
        if self.settings.profile:
            options += ["--profile", str(self.home / f"prof-{log_name}")]
        if options:
            command = [sys.executable, str(BENCH / "launcher.py"), *options, "-m", module, *args]
        else:
            command = [sys.executable, "-m", module, *args]
        # cwd and PYTHONPATH at the repository root: `bench.noop_tool` must import.
        return subprocess.Popen(command, cwd=REPO, env=self._env, stdout=log,
                                stderr=subprocess.STDOUT)

    def _log_file(self, name: str) -> Any:
        log = (self.home / f"{name}.log").open("wb")
        self._logs.append(log)
        return log

    def log(self, name: str) -> str:
        """The tail of one process log, for error messages."""
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    async def start(self) -> None:
        """Start every process and wait until each is serving."""
        self.credentials = generate_credentials(
            self.home / "creds", hosts=(HOST,), tools=(TOOL,), auditors=("auditor",)
        )
        authorization = (
            _open_accounts(self.credentials, self.bench_seed)
            if self.settings.nats_rights == "open"
            else _with_bench_user(self.credentials, self.bench_seed)
        )
        self.server = NatsServer(self.home / "nats", authorization=authorization)
        self.server.start()
        if self.settings.prefill:
            self.prefill_report = prefill_ledger(self, self.settings.prefill)
        for index in range(self.settings.services):
            self.services.append(self._spawn(
                "ledger.server",
                [
                    *self._database_args(),
                    "--nats-url", self.url,
                    "--creds", str(self.credentials.ledger.seed_path),
                    "--contracts", str(self.contracts),
                    "--tools", TOOL,
                    "--ack-wait", "30",
                    "--lease-grace", "5",
                    "--log-level", self.settings.service_log_level,
                ],
                "service" if index == 0 else f"service-{index}",
                self.settings.service_patches,
            ))
            if index == 0:
                # The first creates the schema and the streams; the others join it.
                self.service = self.services[0]
                await self._wait_for_service()
        if len(self.services) > 1:
            # The others have no status of their own to probe (any instance may
            # answer one): they must be up and still running after a while.
            await asyncio.sleep(3.0)
            for index, process in enumerate(self.services[1:], start=1):
                if process.poll() is not None:
                    raise RuntimeError(
                        f"ledger service {index} exited:\n{self.log(f'service-{index}')}"
                    )
        for index in range(self.settings.executors):
            self.executors.append(self._spawn(
                "executors",
                [
                    "run", f"bench.noop_tool:{self.settings.tool}",
                    "--creds", str(self.credentials.executor(TOOL).seed_path),
                    "--nats-url", self.url,
                    "--contracts", str(self.contracts),
                    "--name", f"noop-{index}",
                    "--batch", str(self.settings.batch),
                ],
                f"exec-{index}",
                self.settings.executor_patches,
            ))
        await self._declare_raw_topology()
        for index in range(self.settings.executors):
            log = self._log_file(f"raw-{index}")
            self.raw_workers.append(subprocess.Popen(
                [
                    sys.executable, str(BENCH / "raw_roundtrip_worker.py"),
                    "--nats-url", self.url, "--seed", str(self.bench_seed),
                    "--stream", RAW_WORK_STREAM, "--consumer", RAW_WORK_CONSUMER,
                    "--result-subject", RAW_RESULT_SUBJECT,
                    "--batch", str(self.settings.batch), "--name", f"raw-{index}",
                ],
                cwd=REPO, env=self._env, stdout=log, stderr=subprocess.STDOUT,
            ))
        if self.settings.floor:
            await self._start_floor()
        for index in range(self.settings.executors):
            await self._wait_for_line(f"exec-{index}", "runs noop@", self.executors[index])

    async def _start_floor(self) -> None:
        """The design's floor: its service and as many workers as executors."""
        await self._declare_floor_topology()
        self.floor_service = subprocess.Popen(
            [sys.executable, str(BENCH / "floor_service.py"), "--nats-url", self.url,
             "--seed", str(self.bench_seed)],
            cwd=REPO, env=self._env, stdout=self._log_file("floor-service"),
            stderr=subprocess.STDOUT,
        )
        await self._wait_for_line("floor-service", FLOOR_SERVICE_READY, self.floor_service)
        for index in range(self.settings.executors):
            log = self._log_file(f"floor-{index}")
            self.floor_workers.append(subprocess.Popen(
                [
                    sys.executable, str(BENCH / "raw_roundtrip_worker.py"),
                    "--nats-url", self.url, "--seed", str(self.bench_seed),
                    "--stream", FLOOR["work_stream"], "--consumer", FLOOR["work_consumer"],
                    "--result-subject", FLOOR["result"], "--lease-subject", FLOOR["lease"],
                    "--batch", str(self.settings.batch), "--name", f"floor-{index}",
                ],
                cwd=REPO, env=self._env, stdout=log, stderr=subprocess.STDOUT,
            ))

    async def _wait_for_service(self, timeout_s: float = 30.0) -> None:
        assert self.credentials is not None and self.service is not None
        deadline = time.monotonic() + timeout_s
        request = StatusRequest(operation_id="probe").model_dump_json().encode()
        while time.monotonic() < deadline:
            if self.service.poll() is not None:
                raise RuntimeError(f"ledger service exited:\n{self.log('service')}")
            nc = await connect_as(self.url, self.credentials.host(HOST),
                                  allow_reconnect=False, connect_timeout=2)
            try:
                await nc.request(Subjects.status(HOST), request, timeout=1)
                return
            except Exception:
                await asyncio.sleep(0.2)
            finally:
                await nc.close()
        raise RuntimeError(f"ledger service did not answer:\n{self.log('service')}")

    async def _wait_for_line(
        self, name: str, text: str, process: subprocess.Popen[bytes], timeout_s: float = 30.0
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited:\n{self.log(name)}")
            if text in self.log(name):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{name} did not start:\n{self.log(name)}")

    async def _declare_raw_topology(self) -> None:
        await self._declare_streams((
            (RAW_WORK_STREAM, RAW_WORK_SUBJECT, RetentionPolicy.WORK_QUEUE, RAW_WORK_CONSUMER),
            (RAW_RESULTS_STREAM, RAW_RESULT_SUBJECT, RetentionPolicy.LIMITS,
             RAW_RESULTS_CONSUMER),
        ))

    async def _declare_floor_topology(self) -> None:
        await self._declare_streams((
            (FLOOR["work_stream"], FLOOR["work"], RetentionPolicy.WORK_QUEUE,
             FLOOR["work_consumer"]),
            (FLOOR["results_stream"], FLOOR["result"], RetentionPolicy.LIMITS,
             FLOOR["results_consumer"]),
            (FLOOR["feed_stream"], FLOOR["feed"] + ".>", RetentionPolicy.LIMITS, None),
        ))

    async def _declare_streams(
        self, streams: Sequence[tuple[str, str, RetentionPolicy, str | None]]
    ) -> None:
        # The same stream kinds and consumer settings as ledger.nats.topology
        # declares for OPS_WORK / OPS_RESULTS / OPS_FEED, on other subjects.
        nc = await nats.connect(self.url, nkeys_seed=str(self.bench_seed))
        try:
            js = nc.jetstream()
            for stream, subject, retention, consumer in streams:
                await js.add_stream(StreamConfig(
                    name=stream, subjects=[subject], retention=retention,
                    storage=StorageType.FILE, duplicate_window=120,
                ))
                if consumer is None:
                    continue
                await js.add_consumer(stream, ConsumerConfig(
                    name=consumer, durable_name=consumer, filter_subject=subject,
                    ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                    ack_wait=30, max_deliver=10,
                ))
        finally:
            await nc.close()

    def pids(self) -> dict[str, list[int]]:
        """Process IDs by component, for CPU accounting."""
        assert self.server is not None and self.service is not None
        return {
            "nats-server": [self.server.pid] if self.server.pid else [],
            "service": [process.pid for process in self.services],
            "executors": [p.pid for p in self.executors],
            "raw-workers": [p.pid for p in self.raw_workers],
            "floor-service": [self.floor_service.pid] if self.floor_service else [],
            "floor-workers": [p.pid for p in self.floor_workers],
        }

    def _database_args(self) -> list[str]:
        if self.storage.is_postgres:
            return [
                "--database", self.storage.postgres_dsn or "",
                "--postgres-schema", self.storage.postgres_schema,
            ]
        return ["--database", str(self.home / "ledger.db")]

    def stop(self) -> None:
        """Stop everything this stack started (workers first, the server last)."""
        for index, process in enumerate(self.raw_workers):
            _stop(process, f"raw-{index}")
        for index, process in enumerate(self.floor_workers):
            _stop(process, f"floor-{index}")
        if self.floor_service is not None:
            _stop(self.floor_service, "floor-service")
        for index, process in enumerate(self.executors):
            _stop(process, f"exec-{index}")
        for index, process in enumerate(self.services[1:], start=1):
            _stop(process, f"service-{index}", 45.0 if self.settings.profile else 15.0)
        if self.service is not None:
            # Its shutdown sometimes waits out nats-py's 30 s drain timeout; a
            # profiled service must get that long, or it dies before writing.
            _stop(self.service, "service", 45.0 if self.settings.profile else 15.0)
        if self.server is not None:
            self.server.stop()
        for log in self._logs:
            log.close()

    def drop_storage(self) -> None:
        """Drop the PostgreSQL schema (a SQLite ledger goes with the stack's home)."""
        if self.storage.is_postgres:
            with psycopg.connect(self.storage.postgres_dsn or "", autocommit=True) as db:
                db.execute(f'DROP SCHEMA IF EXISTS "{self.storage.postgres_schema}" CASCADE')


# ------------------------------------------------------------------- scale run

PREFILL_BATCH = 500
"""Operations per prefill round (one append each for proposals, leases, results)."""
PREFILL_REFRESH_EVERY = 40
"""Rounds between view and seal catch-ups while prefilling, as the service would."""


def prefill_ledger(stack: Stack, events: int) -> str:
    """Store at least `events` events of finished no-op operations before the service
    starts, through the ledger's own batched path (check, lease, result: the events
    the service would write), view and seal brought up to date with the service's
    own key; returns a line for the report."""
    assert stack.credentials is not None
    ledger = build_ledger(
        stack.storage,
        contracts_dir=stack.contracts,
        seal_key=SealKey.from_seed_file(stack.credentials.ledger.seed_path),
    )
    start = time.perf_counter()
    operations = rounds = 0
    per_operation = 0.0
    try:
        while operations * per_operation < events or not operations:
            first = operations
            items: list[SubmitItem] = [
                (ToolProposal(proposal_id=f"prefill-{n}", conversation_id="prefill",
                              requested_by_user_id="bench", tool_name=TOOL,
                              arguments={"n": n}), CONTEXT, HOST)
                for n in range(first, first + PREFILL_BATCH)
            ]
            submitted = [s for s in ledger.submit_many(items) if isinstance(s, Submission)]
            grants = [
                grant
                for grant in ledger.lease_many(
                    [(s.operation_id, "prefill", TOOL) for s in submitted]
                )
                if isinstance(grant, LeaseReply) and grant.decision is LeaseDecision.EXECUTE
            ]
            if len(grants) != PREFILL_BATCH:
                raise RuntimeError(f"prefill: {len(grants)} of {PREFILL_BATCH} leased")
            now = datetime.now(UTC)
            ledger.record_results([
                ResultEnvelope(
                    operation_id=grant.operation_id, fencing_token=grant.fencing_token,
                    ok=True, data={"ok": True},
                    provenance=Provenance(tool=TOOL, tool_version=grant.tool_version or "",
                                          executor="prefill", attempt=grant.attempt,
                                          latency_ms=0.1, completed_at=now),
                )
                for grant in grants
            ])
            operations += PREFILL_BATCH
            rounds += 1
            if not per_operation:
                ((count,),) = ledger.db.query(f"SELECT COUNT(*) FROM {ledger.events_table}")
                per_operation = int(count) / operations
            if rounds % PREFILL_REFRESH_EVERY == 0:
                ledger.refresh()
        ledger.refresh()
        ((count,),) = ledger.db.query(f"SELECT COUNT(*) FROM {ledger.events_table}")
        # The history is old: its events went out when they happened. The relay starts
        # after them, as it would on a ledger that has been running (without this it
        # would republish the whole history during the phases, and they would measure
        # that instead of a large store).
        positions = RelayPositions(ledger.db)
        now = datetime.now(UTC)
        if positions.take("prefill", now, now + timedelta(seconds=30)) is not None:
            positions.release("prefill", ledger.event_reader.last_position())
    finally:
        ledger.close()
    seconds = time.perf_counter() - start
    return (f"prefilled {int(count):,} events ({operations:,} operations) in {seconds:.0f} s"
            f" ({int(count) / seconds:,.0f} events/s, view and seal included)")


def time_verify(stack: Stack) -> str:
    """`opledger audit verify` over the whole ledger, as an auditor runs it (its own
    process, read-only, trusting the service's public key); returns a report line."""
    assert stack.credentials is not None
    database = (
        ["--database", stack.storage.postgres_dsn or "",
         "--postgres-schema", stack.storage.postgres_schema]
        if stack.storage.is_postgres else ["--database", str(stack.home / "ledger.db")]
    )
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "ledger.entrypoints", *database, "audit", "verify",
         "--public-key", stack.credentials.ledger.public_key],
        cwd=REPO, env=stack._env, capture_output=True, text=True, timeout=3600, check=False,
    )
    seconds = time.perf_counter() - start
    checked = next((line.strip() for line in done.stdout.splitlines()
                    if "events checked" in line), done.stdout.strip()[-200:])
    verdict = "OK" if done.returncode == 0 else f"FAILED (exit {done.returncode})"
    return f"audit verify: {verdict} in {seconds:.1f} s; {checked}"


# --------------------------------------------------------------------- drivers


async def _ignore_error(_error: Exception) -> None:
    """nats-py prints every connection error (e.g. a slow drain at close); phases count failures."""


class LedgerDriver(Driver):
    """Operations through the ledger: propose, then wait for the final outcome."""

    def __init__(self, stack: Stack, mode: str) -> None:
        self.stack = stack
        self.mode = mode
        self.name = f"ledger/{mode}"
        self._nc: Client | None = None
        self._host: AgentHostClient | None = None
        self._waiting: dict[str, asyncio.Future[OperationStatus]] = {}
        self.timeline: dict[str, tuple[float, float]] | None = None
        """Set to a dict to record (sent, outcome received) wall-clock times per operation."""

    async def start(self) -> None:
        """Connect as the bench host; in `watch` mode subscribe to all its outcomes."""
        assert self.stack.credentials is not None
        self._nc = await connect_as(self.stack.url, self.stack.credentials.host(HOST),
                                    error_cb=_ignore_error)
        # Watch mode hears outcomes through the SDK's own subscription: a second one
        # on the same subject had every outcome delivered twice to this process.
        watching = self._on_outcome if self.mode == "watch" else None
        self._host = AgentHostClient(
            self._nc, HOST, timeout=PROPOSE_TIMEOUT_S, on_outcome=watching
        )
        if self.mode == "watch":
            await self._host.listen()  # subscribed before the first proposal goes out

    def _on_outcome(self, status: OperationStatus) -> None:
        future = self._waiting.pop(status.operation_id, None)
        if future is not None and not future.done():
            future.set_result(status)

    async def run_one(self, key: str) -> bool:
        """Propose `noop` and wait until the operation is final; True if it succeeded."""
        sent = time.time()
        ok = await self._run_one(key)
        if self.timeline is not None and ok:
            self.timeline[f"op-{key}"] = (sent, time.time())
        return ok

    async def _run_one(self, key: str) -> bool:
        assert self._host is not None
        operation_id = f"op-{key}"
        proposal = ToolProposal(
            proposal_id=f"p-{key}", conversation_id="c-bench", requested_by_user_id="bench",
            tool_name=TOOL, arguments={"n": 1}, operation_id=operation_id,
        )
        if self.mode == "sdk":
            reply = await self._host.propose(proposal, CONTEXT)
            if reply.state != "ready":
                return False
            status = await self._host.outcome(operation_id, timeout=OUTCOME_TIMEOUT_S)
            return status.state == "succeeded"
        future: asyncio.Future[OperationStatus] = asyncio.get_running_loop().create_future()
        self._waiting[operation_id] = future
        try:
            reply = await self._host.propose(proposal, CONTEXT)
            if reply.state != "ready":
                return False
            status = await asyncio.wait_for(future, OUTCOME_TIMEOUT_S)
        finally:
            self._waiting.pop(operation_id, None)
        return status.state == "succeeded"

    async def close(self) -> None:
        """Drain the host connection (close it if draining takes too long)."""
        if self._nc is not None:
            try:
                await self._nc.drain()
            except Exception:
                await self._nc.close()


class RawDriver(Driver):
    """The baseline: a work item through JetStream to a raw worker and its result back."""

    name = "raw-jetstream"

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self._nc: Client | None = None
        self._js: Any = None
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._results: PullConsumer | None = None

    async def start(self) -> None:
        """Connect as the bench user and start consuming results (as the service does)."""
        self._nc = await nats.connect(self.stack.url, nkeys_seed=str(self.stack.bench_seed))
        self._js = self._nc.jetstream()
        self._results = PullConsumer(self._nc, RAW_RESULTS_STREAM, RAW_RESULTS_CONSUMER)
        await self._results.start()
        self._task = asyncio.get_running_loop().create_task(self._consume(self._results))

    async def _consume(self, results: PullConsumer) -> None:
        # Like LedgerService._consume_results: pull up to 256, ack each.
        while not self._closing.is_set():
            for message in await results.take(256, timeout=1):
                future = self._waiting.pop(orjson.loads(message.data)["operation_id"], None)
                if future is not None and not future.done():
                    future.set_result(None)
                await message.ack()

    async def run_one(self, key: str) -> bool:
        """Publish one work item (PubAck awaited, as the relay does) and await its result."""
        item_id = f"raw-{key}"
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[item_id] = future
        payload = orjson.dumps(
            {"id": item_id, "tool": "raw", "tool_version": "1.0.0", "attempt": 1}
        )
        try:
            await self._js.publish(RAW_WORK_SUBJECT, payload, headers={"Nats-Msg-Id": item_id})
            await asyncio.wait_for(future, OUTCOME_TIMEOUT_S)
        finally:
            self._waiting.pop(item_id, None)
        return True

    async def close(self) -> None:
        """Stop consuming and disconnect."""
        self._closing.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5)
        if self._results is not None:
            await self._results.stop()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.flush(timeout=2)
            await self._nc.close()


class FloorDriver(Driver):
    """The design's floor: the host's side of every message of an operation, against
    `bench/floor_service.py` (no ledger work); `lease=False` skips the lease hop."""

    def __init__(self, stack: Stack, *, lease: bool) -> None:
        self.stack = stack
        self.lease = lease
        self.name = "floor-4hop" if lease else "floor-3hop"
        self._nc: Client | None = None
        self._waiting: dict[str, asyncio.Future[None]] = {}

    async def start(self) -> None:
        """Connect as the bench user and subscribe to the outcome notices."""
        self._nc = await nats.connect(self.stack.url, nkeys_seed=str(self.stack.bench_seed),
                                      error_cb=_ignore_error)
        await self._nc.subscribe(FLOOR["outcome"] + ".*", cb=self._on_outcome)
        await self._nc.flush()

    async def _on_outcome(self, message: Any) -> None:
        future = self._waiting.pop(message.subject.rsplit(".", 1)[-1], None)
        if future is not None and not future.done():
            future.set_result(None)

    async def run_one(self, key: str) -> bool:
        """Propose (a request of a real proposal's size) and await the outcome notice."""
        assert self._nc is not None
        operation_id = f"floor-{key}"
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[operation_id] = future
        proposal = orjson.dumps({"operation_id": operation_id, "lease": self.lease,
                                 "tool_name": TOOL, "arguments": {"n": 1}, "pad": "p" * 600})
        try:
            reply = await self._nc.request(FLOOR["propose"], proposal, timeout=PROPOSE_TIMEOUT_S)
            if orjson.loads(reply.data)["state"] != "ready":
                return False
            await asyncio.wait_for(future, OUTCOME_TIMEOUT_S)
        finally:
            self._waiting.pop(operation_id, None)
        return True

    async def close(self) -> None:
        """Disconnect."""
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.flush(timeout=2)
            await self._nc.close()


# ------------------------------------------------------------------- breakdown

STAGES = (
    ("host -> submit", "the proposal's trip to the service, its queue, up to the check"),
    ("submit -> lease", "submit commit, relay publishes the work item, executor pull + lease"),
    ("lease -> result", "lease commit, tool run, result publish, service pull, record"),
    ("result -> host", "result commit, relay reads it and announces the outcome"),
)
"""Where one operation's latency goes, cut at the ledger's own event timestamps."""


def latency_breakdown(
    stack: Stack, timeline: dict[str, tuple[float, float]], limit: int = 2000
) -> dict[str, list[float]]:
    """Per stage, the durations (seconds) of the operations in `timeline`.

    The cuts are the timestamps the service put on Readied (taken when the
    check starts), LeaseClaimed and Succeeded, against the host's wall clock
    when it sent the proposal and when the outcome arrived: one machine, one
    clock. Read from the database after the phase, through a second handle,
    as the e2e tests inspect it.
    """
    ledger = build_ledger(stack.storage, contracts_dir=stack.contracts)
    stages: dict[str, list[float]] = {name: [] for name, _ in STAGES}
    try:
        for operation_id, (sent, received) in itertools.islice(timeline.items(), limit):
            # The ledger knows the host's operations by `<host>/<id>`.
            history = ledger.history(ledger_operation_id(HOST, operation_id))
            at = {type(e).__name__: e.timestamp.timestamp() for e in history}
            if not {"Readied", "LeaseClaimed", "Succeeded"} <= at.keys():
                continue
            cuts = (sent, at["Readied"], at["LeaseClaimed"], at["Succeeded"], received)
            for (name, _), start, end in zip(STAGES, cuts, cuts[1:], strict=False):
                stages[name].append(end - start)
    finally:
        ledger.close()
    return stages


# ------------------------------------------------------------------------ runs


@dataclass
class ConfigReport:
    """Every phase of one stack configuration."""

    settings: Settings
    phases: dict[str, PhaseResult] = field(default_factory=dict)
    breakdowns: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """Lines of the scale run: the prefill, and `audit verify` over the whole ledger."""


async def _with_cpu(
    stack: Stack, ops: int, measure: Callable[[], Awaitable[PhaseResult]]
) -> PhaseResult:
    """Run `measure` and attach CPU milliseconds per operation of each component.

    "other" is the machine's busy time that none of our processes used: on a
    shared 2-core machine, anything else running (another benchmark, a test
    run) takes CPU from the stack, and the figures of such a phase are suspect.
    """
    pids = stack.pids()
    before = {name: sum(cpu_seconds(p) for p in group) for name, group in pids.items()}
    rss_before = {
        name: sum(memory_mb(p)[0] for p in group) for name, group in pids.items() if group
    }
    bench_before = time.process_time()
    machine_before = machine_busy_seconds()
    connz_before = _connections(stack)
    curve: list[float] = []

    async def sample_service_memory() -> None:
        # A leak shows as a rise that goes on through the phase; caches that fill
        # up and stop (bounded) as a rise that levels off. Start and end alone
        # cannot tell the two apart.
        while True:
            curve.append(sum(memory_mb(p)[0] for p in pids.get("service", [])))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample_service_memory())
    try:
        result = await measure()
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    result.service_rss_curve = curve
    after = {name: sum(cpu_seconds(p) for p in group) for name, group in pids.items()}
    result.cpu_ms_per_op = {
        name: (after[name] - before[name]) * 1000 / ops for name in pids if pids[name]
    }
    result.cpu_ms_per_op["bench (host)"] = (time.process_time() - bench_before) * 1000 / ops
    ours = sum(result.cpu_ms_per_op.values())
    machine = (machine_busy_seconds() - machine_before) * 1000 / ops
    result.cpu_ms_per_op["other"] = max(machine - ours, 0.0)
    connz_after = _connections(stack)
    for name, (msgs_in, msgs_out, kbytes) in connz_after.items():
        was = connz_before.get(name, (0, 0, 0.0))
        # Pings and idle pull heartbeats are no operation's messages.
        if max(msgs_in - was[0], msgs_out - was[1]) >= 0.05 * ops:
            result.nats_per_op[name] = (
                (msgs_in - was[0]) / ops, (msgs_out - was[1]) / ops, (kbytes - was[2]) / ops
            )
    for name, group in pids.items():
        if group:
            now = [memory_mb(p) for p in group]
            result.rss_mb[name] = (
                rss_before[name], sum(r for r, _ in now), sum(peak for _, peak in now)
            )
    return result


def _connections(stack: Stack) -> dict[str, tuple[int, int, float]]:
    """Per connection name (summed over connections of one name): messages the server
    got from it, messages it sent to it, and kilobytes both ways; empty without the
    monitor."""
    url = stack.server.monitor_url if stack.server is not None else None
    if url is None:
        return {}
    with urllib.request.urlopen(f"{url}/connz?limit=1024", timeout=5) as response:
        connz = json.loads(response.read())
    totals: dict[str, tuple[int, int, float]] = {}
    for conn in connz.get("connections", []):
        name = conn.get("name") or "(unnamed)"
        was = totals.get(name, (0, 0, 0.0))
        # The server's in_msgs are what the client published; out_msgs what it delivered.
        totals[name] = (
            was[0] + conn.get("in_msgs", 0), was[1] + conn.get("out_msgs", 0),
            was[2] + (conn.get("in_bytes", 0) + conn.get("out_bytes", 0)) / 1024,
        )
    return totals


async def _quiesce(stack: Stack, timeout_s: float = 180.0, window_s: float = 0.5) -> None:
    """Wait until the service and executors are (nearly) idle, so phases do not overlap.

    A host that gave up on a proposal leaves it queued in NATS for the
    service, which works through it after the phase ended; measuring the next
    phase meanwhile would charge that work to it.
    """
    assert stack.service is not None
    pids = [*(p.pid for p in stack.services), *(p.pid for p in stack.executors)]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = sum(cpu_seconds(pid) for pid in pids)
        await asyncio.sleep(window_s)
        busy = (sum(cpu_seconds(pid) for pid in pids) - before) / window_s
        if busy < 0.05:  # under 5 % of one core: idle polling only
            return
    print(f"!! the stack was still busy after {timeout_s:g} s; measuring anyway", file=sys.stderr)


async def run_config(settings: Settings, args: argparse.Namespace, root: Path) -> ConfigReport:
    """Start one stack, run every phase on it, stop it."""
    home = Path(tempfile.mkdtemp(prefix="stack-", dir=root))
    stack = Stack(home, settings)
    report = ConfigReport(settings)
    tag = home.name.rsplit("-", 1)[-1]
    try:
        await stack.start()
        # The baseline first, on a quiet stack: an overloaded ledger phase can
        # leave the service busy with queued requests for a while.
        drivers: list[Driver] = [RawDriver(stack)]
        if settings.floor:
            drivers += [FloorDriver(stack, lease=True), FloorDriver(stack, lease=False)]
        drivers += [LedgerDriver(stack, mode) for mode in args.host_modes]
        for driver in drivers:
            await driver.start()
            try:
                prefix = f"{driver.name.replace('/', '_')}-{tag}"
                # Warm-up: imports, caches, consumer state, SQLite pages; not measured.
                await run_throughput(driver, f"{prefix}-warm", args.warmup, 50, 120)
                await _quiesce(stack)
                result = await _with_cpu(stack, args.ops, functools.partial(
                    run_throughput, driver, f"{prefix}-tp", args.ops, args.concurrency,
                    max(300.0, args.ops / 5),
                ))
                report.phases[f"{driver.name} throughput"] = result
                for rate in args.rate:
                    await _quiesce(stack)
                    total = max(1, int(rate * args.duration))
                    if isinstance(driver, LedgerDriver):
                        driver.timeline = {}
                    phase = f"{driver.name} @{rate:g}/s"
                    report.phases[phase] = await _with_cpu(
                        stack, total, functools.partial(
                            run_fixed_rate, driver, f"{prefix}-rate{rate:g}", rate,
                            args.duration,
                            args.duration + PROPOSE_TIMEOUT_S * 3 + OUTCOME_TIMEOUT_S + 30,
                        ),
                    )
                    if isinstance(driver, LedgerDriver) and driver.timeline:
                        await _quiesce(stack)  # reading the database is not measured
                        report.breakdowns[phase] = latency_breakdown(stack, driver.timeline)
                        driver.timeline = None
            finally:
                await driver.close()
    except Exception:
        print(f"!! {settings.label}: failed; service log tail:\n{stack.log('service')}",
              file=sys.stderr)
        for index in range(len(stack.executors)):
            print(f"!! exec-{index} log tail:\n{stack.log(f'exec-{index}')}", file=sys.stderr)
        raise
    finally:
        stack.stop()
        try:
            if settings.prefill:
                report.notes.append(stack.prefill_report or "prefill: not done")
                report.notes.append(time_verify(stack))
        finally:
            stack.drop_storage()
    if settings.profile:
        _print_profiles(home, args.profile_top)
    return report


def _print_profiles(home: Path, top: int) -> None:
    """The heaviest functions (own time) of each profiled thread that did real work."""
    for directory in sorted(home.glob("prof-*")):
        for path in sorted(directory.glob("*.prof")):
            stats = pstats.Stats(str(path))
            total = getattr(stats, "total_tt", 0.0)
            if total < 0.5:  # idle pool threads and the like
                continue
            print(f"\n--- profile {directory.name}/{path.stem}: {total:.2f} s on this thread")
            stats.sort_stats("tottime").print_stats(top)


def _fmt(value: float, width: int = 8, digits: int = 1) -> str:
    return f"{value:{width}.{digits}f}"


def _overloaded(phase: PhaseResult, rate: float) -> bool:
    """A fixed-rate phase the stack could not keep up with (so its latencies are queueing)."""
    return phase.failures > 0 or phase.ops_per_s < 0.95 * rate


_TARGETS = {"sqlite": (1_500, 10.0), "postgres": (1_000, 15.0)}
"""Issue 15's targets per storage: (least operations/s at throughput, greatest p99 ms at
200/s). The ratio to DBOS (PostgreSQL, >= 4) is printed by the peer phase."""


def print_report(report: ConfigReport, args: argparse.Namespace) -> None:
    """One block per configuration: each phase, CPU per operation, then ledger/raw ratios."""
    print(f"\n=== {report.settings.label} (service log level {report.settings.service_log_level})")
    for note in report.notes:
        print(f"  {note}")
    print(f"  {'phase':<34} {'ops/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'fail':>5}")
    for name, phase in report.phases.items():
        worst = max(phase.latencies, default=math.nan) * 1000
        rate = float(name.rsplit("@", 1)[1][:-2]) if "@" in name else None
        note = "  overloaded" if rate is not None and _overloaded(phase, rate) else ""
        print(f"  {name:<34} {_fmt(phase.ops_per_s)} {_fmt(phase.p(50), digits=2)} "
              f"{_fmt(phase.p(99), digits=2)} {_fmt(worst)} {phase.failures:>5}{note}")
    for name, phase in report.phases.items():
        if phase.cpu_ms_per_op:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in phase.cpu_ms_per_op.items())
            print(f"  CPU ms/op, {name}: {parts} (ours {phase.ours_cpu_ms_per_op:.2f})")
        if phase.nats_per_op:
            counts = phase.nats_per_op.values()
            parts = ", ".join(f"{k} {i:.1f}/{o:.1f}/{kb:.1f}"
                              for k, (i, o, kb) in sorted(phase.nats_per_op.items()))
            print(f"  NATS per op (messages in/out, KB), {name}: {parts}; all"
                  f" {sum(c[0] for c in counts):.1f}/{sum(c[1] for c in counts):.1f}"
                  f"/{sum(c[2] for c in counts):.1f}")
        if "service" in phase.rss_mb:
            start, end, peak = phase.rss_mb["service"]
            print(f"  service memory MB, {name}: {start:.0f} -> {end:.0f} (peak {peak:.0f})")
        if len(phase.service_rss_curve) >= 20:
            # At each tenth of the phase: flat at the end means bounded.
            curve = phase.service_rss_curve
            tenths = [curve[min(len(curve) - 1, len(curve) * k // 10)] for k in range(11)]
            print(f"  service memory MB at each tenth, {name}: "
                  + " ".join(f"{mb:.0f}" for mb in tenths))
    for name, stages in report.breakdowns.items():
        parts = ", ".join(
            f"{stage} {percentile(sorted(values), 50) * 1000:.1f}/"
            f"{percentile(sorted(values), 99) * 1000:.1f}"
            for stage, values in stages.items()
        )
        print(f"  latency by stage p50/p99 ms, {name}: {parts}")
    raw_tp = report.phases.get("raw-jetstream throughput")
    for mode in args.host_modes:
        tp = report.phases.get(f"ledger/{mode} throughput")
        if tp and raw_tp:
            print(f"  ratio ledger/{mode} to raw: throughput {tp.ops_per_s / raw_tp.ops_per_s:.3f}")
        for rate in args.rate:
            at_rate = report.phases.get(f"ledger/{mode} @{rate:g}/s")
            raw = report.phases.get(f"raw-jetstream @{rate:g}/s")
            if at_rate and raw:
                print(f"  ratio ledger/{mode} to raw at {rate:g}/s: p50 "
                      f"{at_rate.p(50) / raw.p(50):.1f}, p99 {at_rate.p(99) / raw.p(99):.1f}")
        for floor in ("floor-4hop", "floor-3hop"):
            bound = report.phases.get(f"{floor} throughput")
            if tp and bound:
                line = (f"  ratio ledger/{mode} to {floor}: throughput"
                        f" {tp.ops_per_s / bound.ops_per_s:.3f}")
                for rate in args.rate:
                    at_rate = report.phases.get(f"ledger/{mode} @{rate:g}/s")
                    floor_at = report.phases.get(f"{floor} @{rate:g}/s")
                    if at_rate and floor_at:
                        line += (f"; at {rate:g}/s p50 {at_rate.p(50) / floor_at.p(50):.1f},"
                                 f" p99 {at_rate.p(99) / floor_at.p(99):.1f}")
                print(line)
        at_200 = report.phases.get(f"ledger/{mode} @200/s")
        raw_200 = report.phases.get("raw-jetstream @200/s")
        least_ops, most_p99 = _TARGETS[report.settings.storage]
        if tp:
            verdict = "met" if tp.ops_per_s >= least_ops else "MISSED"
            print(f"  target ledger/{mode} >= {least_ops:,} ops/s: {verdict}"
                  f" ({tp.ops_per_s:.0f})", end="")
            if at_200:
                verdict = (
                    "met" if at_200.p(99) <= most_p99 and not _overloaded(at_200, 200)
                    else "MISSED"
                )
                print(f"; p99 <= {most_p99:g} ms at 200/s: {verdict} ({at_200.p(99):.1f} ms)",
                      end="")
                if raw_200:
                    times = at_200.p(50) / raw_200.p(50)
                    verdict = "met" if times <= 3 else "MISSED"
                    print(f"; p50 <= 3x raw at 200/s: {verdict} ({times:.1f}x)", end="")
            print()


def print_summary(reports: Sequence[ConfigReport], args: argparse.Namespace) -> None:
    """One line per configuration and host mode, for comparing runs."""
    print("\n=== summary (ops/s; latency p50/p99 ms; ratio = ledger / raw)")
    for report in reports:
        raw_tp = report.phases.get("raw-jetstream throughput")
        for mode in args.host_modes:
            tp = report.phases.get(f"ledger/{mode} throughput")
            if not tp or not raw_tp:
                continue
            line = (f"  {report.settings.label} {mode:>5}: {tp.ops_per_s:7.1f} ops/s "
                    f"(raw {raw_tp.ops_per_s:7.1f}, ratio {tp.ops_per_s / raw_tp.ops_per_s:.3f})")
            for rate in args.rate:
                phase = report.phases.get(f"ledger/{mode} @{rate:g}/s")
                raw = report.phases.get(f"raw-jetstream @{rate:g}/s")
                if phase and raw:
                    flag = "!" if _overloaded(phase, rate) else ""
                    line += (f" | @{rate:g}/s{flag} {phase.p(50):.1f}/{phase.p(99):.1f}"
                             f" (raw {raw.p(50):.1f}/{raw.p(99):.1f})")
            print(line)
        for floor in ("floor-4hop", "floor-3hop"):
            bound = report.phases.get(f"{floor} throughput")
            if not bound or not raw_tp:
                continue
            ratio = bound.ops_per_s / raw_tp.ops_per_s
            line = (f"  {report.settings.label} {floor}: {bound.ops_per_s:7.1f} ops/s "
                    f"(raw {raw_tp.ops_per_s:7.1f}, ratio {ratio:.3f})")
            for rate in args.rate:
                phase = report.phases.get(f"{floor} @{rate:g}/s")
                if phase:
                    flag = "!" if _overloaded(phase, rate) else ""
                    line += f" | @{rate:g}/s{flag} {phase.p(50):.1f}/{phase.p(99):.1f}"
            print(line)
    print("  (! = the stack could not sustain that rate: latencies are queueing, failures counted)")
    for report in reports:
        if not report.settings.prefill:
            continue
        empty = next((r for r in reports if not r.settings.prefill and replace(
            r.settings, prefill=report.settings.prefill) == report.settings), None)
        for mode in args.host_modes:
            full = report.phases.get(f"ledger/{mode} throughput")
            base = empty.phases.get(f"ledger/{mode} throughput") if empty else None
            if full and base:
                ratio = full.ops_per_s / base.ops_per_s
                verdict = "met" if ratio >= 0.9 else "MISSED"
                print(f"  scale {report.settings.storage} {mode}: {full.ops_per_s:.1f} ops/s at"
                      f" {report.settings.prefill:,} stored events, {base.ops_per_s:.1f} empty:"
                      f" ratio {ratio:.3f} (target >= 0.9: {verdict})")


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=3000, help="operations in the throughput run")
    parser.add_argument("--concurrency", type=int, default=200, help="operations in flight")
    parser.add_argument("--rate", type=lambda t: [float(r) for r in t.split(",") if r],
                        default=[200.0, 20.0],
                        help="operations/s of the latency runs (200: the target; 20: the "
                        "latency of an unloaded stack)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds, latency run")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured operations first")
    parser.add_argument("--executors", type=_ints, default=[1, 2],
                        help="executor (and raw worker) process counts to try, e.g. 1,2")
    parser.add_argument("--batch", type=_ints, default=[1, 16],
                        help="items in flight per executor to try (--batch), e.g. 1,16")
    parser.add_argument("--host-modes", type=lambda s: [m for m in s.split(",") if m],
                        default=["watch", "sdk"], help="watch and/or sdk")
    parser.add_argument("--tool", choices=["noop", "noop_sync"], default="noop",
                        help="async tool, or a plain function run in a worker thread")
    parser.add_argument("--service-log-level", default="INFO",
                        help="the service's --log-level (INFO is its default)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the service and executors (slows them down)")
    parser.add_argument("--service-patches", type=_names, default=(),
                        help="experiments from bench/launcher.py PATCHES for the service, "
                        "e.g. loop-stalls=4,gc-pauses (diagnostics)")
    parser.add_argument("--ab", type=_names, default=None,
                        help="compare: each configuration runs without (A) and with (B)"
                        " these service patches, interleaved A B B A ... for --pairs pairs,"
                        " then a table of every run's figures, the medians and B/A")
    parser.add_argument("--ab-executors", type=_names, default=(),
                        help="with --ab: these executor patches too, on the B side only"
                        " (e.g. lease-in-result, which both sides of the stack need)")
    parser.add_argument("--pairs", type=int, default=2,
                        help="A/B pairs per configuration with --ab")
    parser.add_argument("--executor-patches", type=_names, default=(),
                        help="experiments for the executors, e.g. gc-pauses")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, db)")
    parser.add_argument("--peer", choices=["dbos"], default=None,
                        help="after the configurations, the same no-op as a DBOS workflow"
                        " with one step on the same PostgreSQL (needs the bench extra),"
                        " printed beside opledger with the ratio")
    parser.add_argument("--prefill", type=_ints, default=[0],
                        help="events stored before the service starts, a list: e.g."
                        " 0,1000000 runs each storage on an empty ledger and on one of 1 M"
                        " events (the scale run; `audit verify` is timed after it)")
    parser.add_argument("--budget", type=_ints, default=[0],
                        help="the no-op's budget in calls per hour, a list: e.g. 0,100000000"
                        " runs each without and with one (0: none)")
    parser.add_argument("--services", type=_ints, default=[1],
                        help="ledger service processes sharing the request subjects, a"
                        " list: e.g. 1,2 (PostgreSQL only: the production topology)")
    parser.add_argument("--floor", action="store_true",
                        help="also run the design's floor after the raw round trip: every"
                        " NATS message of an operation with no ledger work"
                        " (bench/floor_service.py), with the lease hop (floor-4hop) and"
                        " without it (floor-3hop)")
    parser.add_argument("--nats-rights", type=_names, default=("production",),
                        help="production and/or open, a list: open puts every identity in"
                        " one account without permissions, to show what least privilege"
                        " costs nats-server (a diagnostic; the service gets the any-reply"
                        " patch)")
    parser.add_argument("--storage", type=lambda s: [m for m in s.split(",") if m],
                        default=["sqlite"],
                        help="sqlite and/or postgres (a fresh schema at"
                        " $OPLEDGER_TEST_POSTGRES_DSN, default the tests' local server)")
    return parser


async def _main(args: argparse.Namespace, root: Path) -> None:
    reports = []
    for storage, prefill, budget, services, executors, batch, rights in itertools.product(
        args.storage, args.prefill, args.budget, args.services, args.executors, args.batch,
        args.nats_rights,
    ):
        if services > 1 and storage != "postgres":
            print(f"(skipping {storage} with {services} services: one SQLite file has"
                  " one writer; several services share a PostgreSQL)")
            continue
        # Open rights: no service import rewrites a lease request's reply into `_R_.`,
        # so the service must answer an executor's own inbox.
        patches = (*args.service_patches, "any-reply") if rights == "open" else (
            args.service_patches)
        settings = Settings(executors, batch, args.tool, args.service_log_level, args.profile,
                            patches, args.executor_patches, storage, prefill,
                            budget, services, args.floor, rights)
        # With --ab, B is the same stack with the patches added.
        variants = {"A": settings, "B": replace(
            settings,
            service_patches=(*patches, *(args.ab or ())),
            executor_patches=(*args.executor_patches, *args.ab_executors),
        )}
        sides: dict[str, list[ConfigReport]] = {"A": [], "B": []}
        for side in ["A"] if args.ab is None else ab_order(args.pairs):
            if args.ab is not None:
                print(f"\n--- {side} ({len(sides[side]) + 1} of {args.pairs})")
            sides[side].append(await run_config(variants[side], args, root))
            reports.append(sides[side][-1])
            print_report(reports[-1], args)
            sys.stdout.flush()
        if args.ab is not None:
            print_ab(sides["A"], sides["B"], args)
    print_summary(reports, args)
    if args.peer == "dbos":
        print_peer(reports, args)


def ab_order(pairs: int) -> list[str]:
    """A B, then B A, and so on: each side runs as often first as second, so a machine
    that drifts during the runs favours neither."""
    return [side for n in range(pairs) for side in (("A", "B") if n % 2 == 0 else ("B", "A"))]


def _ab_figures(report: ConfigReport, args: argparse.Namespace) -> dict[str, float]:
    """The figures of one run that an A/B table compares, by label, in table order."""
    figures: dict[str, float] = {}
    phases = report.phases
    if "raw-jetstream throughput" in phases:
        figures["raw JetStream ops/s (the machine's drift)"] = (
            phases["raw-jetstream throughput"].ops_per_s
        )
    for mode in args.host_modes:
        if (tp := phases.get(f"ledger/{mode} throughput")) is not None:
            figures[f"{mode} ops/s"] = tp.ops_per_s
        for rate in args.rate:
            if (at_rate := phases.get(f"ledger/{mode} @{rate:g}/s")) is not None:
                figures[f"{mode} p50 ms at {rate:g}/s"] = at_rate.p(50)
                figures[f"{mode} p99 ms at {rate:g}/s"] = at_rate.p(99)
        for when in ("throughput", f"@{max(args.rate):g}/s"):
            phase = phases.get(f"ledger/{mode} {when}")
            if phase is None or not phase.cpu_ms_per_op:
                continue
            if "service" in phase.cpu_ms_per_op:
                figures[f"{mode} service CPU ms/op, {when}"] = phase.cpu_ms_per_op["service"]
            figures[f"{mode} all processes CPU ms/op, {when}"] = phase.ours_cpu_ms_per_op
    return figures


def print_ab(side_a: Sequence[ConfigReport], side_b: Sequence[ConfigReport],
             args: argparse.Namespace) -> None:
    """Each run's figures for A (without `--ab`'s patches) and B (with them), the median
    of each side, and B's median over A's: what a change buys, read against the spread
    of its own side and the raw round trip's drift between runs."""
    executors = f" (executors: {','.join(args.ab_executors)})" if args.ab_executors else ""
    print(f"\n=== A/B {side_a[0].settings.label}: B adds {','.join(args.ab)}{executors};"
          f" runs in the order {' '.join(ab_order(args.pairs))}")
    runs_a = [_ab_figures(report, args) for report in side_a]
    runs_b = [_ab_figures(report, args) for report in side_b]
    for label in runs_a[0]:
        a = [run[label] for run in runs_a if label in run]
        b = [run[label] for run in runs_b if label in run]
        if not b:
            continue
        median_a = statistics.median(a)
        ratio = statistics.median(b) / median_a if median_a else math.nan
        print(f"  {label:<46} A {' '.join(f'{v:8.2f}' for v in a)} | B"
              f" {' '.join(f'{v:8.2f}' for v in b)} | median B/A {ratio:.3f}")


def print_peer(reports: Sequence[ConfigReport], args: argparse.Namespace) -> None:
    """Run the DBOS peer (`bench/dbos_peer.py`, its own process) and print it beside
    opledger on PostgreSQL, with the ratio of their best throughputs."""
    dsn = POSTGRES_DSN
    low = min(args.rate)
    done = subprocess.run(
        [sys.executable, str(BENCH / "dbos_peer.py"), "--dsn", dsn, "--ops", "2000",
         "--concurrency", str(max(args.batch)), "--rate", f"{low:g}",
         "--duration", f"{args.duration:g}"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"\n=== peer dbos: failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        return
    peer = json.loads(lines[-1])
    if "skipped" in peer:
        print(f"\n=== peer dbos: skipped: {peer['skipped']}")
        return
    best = max(peer["sequential_ops_per_s"], peer["concurrent_ops_per_s"])
    print(f"\n=== peer dbos (one-step workflow, same PostgreSQL; {max(args.batch)} threads)")
    print(f"  sequential {peer['sequential_ops_per_s']:.1f} wf/s, concurrent "
          f"{peer['concurrent_ops_per_s']:.1f} wf/s; @{low:g}/s p50/p99 "
          f"{peer['p50_ms']:.1f}/{peer['p99_ms']:.1f} ms")
    for report in reports:
        if report.settings.storage != "postgres":
            continue
        for mode in args.host_modes:
            phase = report.phases.get(f"ledger/{mode} throughput")
            if phase is not None:
                print(f"  ratio opledger {report.settings.label} {mode} / dbos best: "
                      f"{phase.ops_per_s / best:.2f} (target >= 4)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run every configuration and print the reports."""
    args = build_parser().parse_args(argv)
    if any(mode not in ("watch", "sdk") for mode in args.host_modes):
        print("error: --host-modes takes watch and/or sdk", file=sys.stderr)
        return 2
    if any(storage not in ("sqlite", "postgres") for storage in args.storage):
        print("error: --storage takes sqlite and/or postgres", file=sys.stderr)
        return 2
    if args.pairs < 1 or (args.ab_executors and args.ab is None):
        print("error: --pairs takes 1 or more, and --ab-executors goes with --ab",
              file=sys.stderr)
        return 2
    rates = ", ".join(f"{rate:g}" for rate in args.rate)
    print(f"e2e bench: {args.ops} ops x {args.concurrency} in flight; {rates} ops/s for "
          f"{args.duration:g} s; {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
    root = Path(tempfile.mkdtemp(prefix="opledger-e2e-bench-"))
    try:
        asyncio.run(_main(args, root))
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
