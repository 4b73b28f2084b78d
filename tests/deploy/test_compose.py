"""docker-compose.yml against the code it runs and the files deploy/generate.py writes.

Docker does not run here, so this checks what can be checked without it:

- the file parses, and names the services of the production topology;
- every command's entry point exists (`python -m X` has a `__main__`; a
  `MODULE:TOOL` argument is an `executors.Tool`), and every flag it passes is
  accepted by that entry point's own argument parser (this is what catches
  drift when a CLI changes);
- every mounted configuration file is one the generator writes, each service
  sees only the generated files that are its own (an executor: its own seed
  and its own secrets), and the generated nats configs pass `nats-server -t`
  and actually form a JetStream cluster that takes the ledger's topology with
  three replicas;
- the two ledger instances share one database and ask for three replicas;
- the approval page publishes no port, and the proxy (the only way to it)
  forwards to it with the origin the page checks; its token settings accept a
  token from the generated key, with roles the catalog's contracts ask for;
- Grafana is provisioned with the Prometheus datasource and a dashboard whose
  every query names metrics (and labels) the project's registries expose.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import re
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from argparse import ArgumentParser, Namespace
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, cast
from urllib.parse import urlsplit

import nats
import nats.aio.client
import nats.errors
import pytest
import yaml
from jsonschema import Draft202012Validator
from prometheus_client.metrics import MetricWrapperBase

from executors import ExecutorMetrics, Tool, load_contract, load_secrets, load_tool
from executors import _main as executor_main
from executors.samples import SAMPLE_TOOLS
from ledger.config import ENV_PREFIX, Settings
from ledger.domain.operation import ALLOWED, Operation
from ledger.domain.states import OperationState
from ledger.entrypoints import cli as opledger_cli
from ledger.nats import (
    Role,
    connect_as,
    declare_topology,
    find_nats_server,
    load_credentials,
    permissions_for,
)
from ledger.server import main as ledger_main
from ledger.server.metrics import LedgerMetrics
from ledger.web import (
    LOCAL_AUDIENCE,
    LOCAL_ISSUER,
    LocalSigner,
    NotAuthenticated,
    TokenSettings,
    TokenVerifier,
)
from policy import ApprovalMode, ContractRegistry
from schemas import (
    FEED_AUDITOR_CONSUMER,
    FEED_STREAM,
    RESULTS_CONSUMER,
    RESULTS_STREAM,
    SCHEMA_DIR,
    WORK_STREAM,
    work_consumer,
)
from schemas._publish import WIRE_MODELS
from tests.deploy.generator import GENERATOR, gen
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
GENERATED = "./deploy/generated/"
"""Where the compose file expects the generator's output (`generate.py deploy/generated`)."""
COMMITTED = ("./deploy/grafana/", "./deploy/proxy/")
"""Hand-written configuration the compose file mounts: committed, with no secret in it."""


COMPOSE: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
LEDGERS = sorted(name for name in SERVICES if name.startswith("ledger-"))
EXECUTORS = sorted(name for name in SERVICES if name.startswith("executor-"))
NATS_NODES = sorted(name for name in SERVICES if name.startswith("nats-"))
OUR_IMAGE = sorted(name for name, service in SERVICES.items() if "build" in service)


# --------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class Mount:
    """One entry of a service's `volumes`."""

    source: str
    target: str
    read_only: bool

    @property
    def generated(self) -> str | None:
        """The path relative to the generator's output, if this mounts a generated file."""
        if self.source.startswith(GENERATED):
            return self.source[len(GENERATED) :]
        return None

    @property
    def is_bind(self) -> bool:
        """A host path (rather than a named volume)."""
        return self.source.startswith((".", "/", "~"))


def mounts(service: dict[str, Any]) -> list[Mount]:
    """A service's volumes, short (`src:dst:ro`) or long syntax."""
    found = []
    for entry in service.get("volumes", []):
        if isinstance(entry, str):
            source, target, *mode = entry.split(":")
            read_only = bool(mode) and "ro" in mode[0].split(",")
            found.append(Mount(source, target, read_only))
        else:
            found.append(
                Mount(entry.get("source", ""), entry["target"], bool(entry.get("read_only")))
            )
    return found


def generated_mounts(service: dict[str, Any]) -> dict[str, Mount]:
    """Generated file (relative path) → its mount, for one service."""
    return {m.generated: m for m in mounts(service) if m.generated is not None}


def mount_at(service: dict[str, Any], target: str) -> Mount:
    """The mount that puts something at `target` in the container."""
    for mount in mounts(service):
        if mount.target == target:
            return mount
    raise AssertionError(f"nothing is mounted at {target}")


def parse(parser: ArgumentParser, argv: list[str], what: str) -> Namespace:
    """`parser.parse_args(argv)`, failing the test (not exiting) on a rejected flag."""
    try:
        return parser.parse_args(argv)
    except SystemExit as stop:
        pytest.fail(f"{what}: the entry point's parser rejects {argv} (exit {stop.code})")


def ledger_args(name: str) -> Namespace:
    """The parsed arguments of ledger service `name`."""
    command = SERVICES[name]["command"]
    assert command[:3] == ["python", "-m", "ledger.server"], command
    return parse(ledger_main.build_parser(), command[3:], name)


def executor_args(name: str) -> Namespace:
    """The parsed arguments of executor service `name`."""
    command = SERVICES[name]["command"]
    assert command[:3] == ["python", "-m", "executors"], command
    return parse(executor_main.build_parser(), command[3:], name)


def image_copies() -> dict[PurePosixPath, Path]:
    """Where the Dockerfile's COPY lines put repository paths inside the image."""
    workdir = PurePosixPath("/")
    copies: dict[PurePosixPath, Path] = {}
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        words = line.split()
        if words[:1] == ["WORKDIR"]:
            workdir = workdir / words[1]
        elif words[:1] == ["COPY"] and not any(w.startswith("--") for w in words):
            *sources, destination = words[1:]
            if len(sources) == 1:
                copies[workdir / destination] = REPO / sources[0]
    return copies


def in_repo(image_path: str) -> Path:
    """The repository path an absolute path inside the image was copied from."""
    path = PurePosixPath(image_path)
    for destination, source in image_copies().items():
        if path == destination or destination in path.parents:
            return source / path.relative_to(destination)
    raise AssertionError(f"{image_path} is not copied into the image by the Dockerfile")


def nats_servers(url: str) -> list[str]:
    """The servers of a comma-separated `--nats-url`."""
    return [part.strip() for part in url.split(",") if part.strip()]


def networks(service: dict[str, Any]) -> set[str]:
    """The networks a service joins (list or mapping syntax)."""
    joined = service.get("networks", ["default"])
    return set(joined)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One run of the generator, as the compose file's first step does it."""
    return gen.generate(tmp_path_factory.mktemp("generated"))


def expected_own_files() -> dict[str, set[str]]:
    """Service → exactly the generated files it may see."""
    own: dict[str, set[str]] = {node: {f"nats/{node}.conf"} for node in gen.NATS_NODES}
    own["postgres"] = {"postgres/password"}
    # The page records decisions in the ledger's database; it checks tokens
    # against the public half of the key pair only.
    own["approvals"] = {"postgres/pgpass", "web/signing-key.pub.pem"}
    own["proxy"] = set()
    own["grafana"] = {"grafana/admin-password"}
    for ledger in gen.LEDGER_SERVICES:
        own[ledger] = {"creds/ledger-ledger.nk", "postgres/pgpass"}
    for name, spec in SAMPLE_TOOLS.items():
        files = {f"creds/exec-{name}.nk"}
        if load_tool(spec).required_secrets:
            files.add(f"secrets/{name}.json")
        own[gen.executor_service(name)] = files
    own["prometheus"] = {"prometheus/prometheus.yml"}
    return own


# ------------------------------------------------------------- the file itself


def test_compose_file_names_the_production_topology() -> None:
    assert isinstance(COMPOSE, dict)
    assert set(SERVICES) == {
        *gen.NATS_NODES,
        "postgres",
        *gen.LEDGER_SERVICES,
        *(gen.executor_service(tool) for tool in SAMPLE_TOOLS),
        "approvals",
        "proxy",
        "prometheus",
        "grafana",
    }
    assert len(NATS_NODES) == 3
    assert len(LEDGERS) == 2
    assert SERVICES["postgres"]["image"].startswith("postgres:16")
    assert SERVICES["prometheus"]["image"].startswith("prom/prometheus")
    assert SERVICES["grafana"]["image"].startswith("grafana/grafana:")
    assert SERVICES["proxy"]["image"].startswith("caddy:")
    for node in NATS_NODES:
        assert SERVICES[node]["image"].startswith("nats:")
    assert set(OUR_IMAGE) == {*LEDGERS, *EXECUTORS, "approvals"}


def test_only_loopback_ports_are_published() -> None:
    published = {
        (name, str(port)) for name, service in SERVICES.items() for port in service.get("ports", [])
    }
    assert published == {
        ("nats-1", f"127.0.0.1:{gen.CLIENT_PORT}:{gen.CLIENT_PORT}"),
        ("proxy", f"127.0.0.1:{PROXY_PORT}:443"),
        ("prometheus", "127.0.0.1:9090:9090"),
        ("grafana", "127.0.0.1:3000:3000"),
    }


def test_only_the_ledger_services_reach_the_database() -> None:
    database_networks = networks(SERVICES["postgres"])
    assert database_networks
    for network in database_networks:
        assert COMPOSE["networks"][network].get("internal") is True
    reach = {n for n, s in SERVICES.items() if n != "postgres" and networks(s) & database_networks}
    # The approval page too: it records the decisions in the ledger itself.
    assert reach == {*LEDGERS, "approvals"}


def test_services_from_our_image_never_run_as_root() -> None:
    for name in OUR_IMAGE:
        user = str(SERVICES[name].get("user", ""))
        assert user, f"{name} runs as the image's user"
        assert not user.startswith(("0:", "root")) and user != "0", name
    users = [
        line.split()[1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("USER")
    ]
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_the_image_is_python_311_slim_and_never_holds_generated_files() -> None:
    lines = [line.strip() for line in DOCKERFILE.read_text(encoding="utf-8").splitlines()]
    assert "FROM python:3.11-slim" in lines
    assert any(re.match(r"RUN pip install \.(\s|$)", line) for line in lines)
    for line in lines:
        words = line.split()
        if words[:1] in (["COPY"], ["ADD"]):
            # `COPY . .` would bake deploy/generated (seeds, passwords) into a layer.
            assert "." not in words[1:-1] and "deploy" not in " ".join(words[1:-1]), line


# ----------------------------------------------------------------- entry points


@pytest.mark.parametrize("name", OUR_IMAGE)
def test_python_entry_point_exists(name: str) -> None:
    command = SERVICES[name]["command"]
    assert command[:2] == ["python", "-m"], command
    spec = importlib.util.find_spec(command[2])
    assert spec is not None, f"{name}: no module {command[2]}"
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        assert importlib.util.find_spec(f"{command[2]}.__main__") is not None, command[2]


@pytest.mark.parametrize("name", LEDGERS)
def test_ledger_service_flags_are_accepted(name: str) -> None:
    args = ledger_args(name)
    assert args.creds == Path("/run/opledger/creds/ledger-ledger.nk")
    assert mount_at(SERVICES[name], str(args.creds)).generated == "creds/ledger-ledger.nk"
    assert nats_servers(args.nats_url) == [f"nats://{n}:{gen.CLIENT_PORT}" for n in NATS_NODES]
    # The declared consumers are exactly the executors' tools: an executor binds to
    # its tool's consumer and cannot create one.
    assert set(args.tools.split(",")) == set(SAMPLE_TOOLS)
    assert in_repo(str(args.contracts)).is_dir()
    module, _, factory = args.plugins.partition(":")
    assert callable(getattr(importlib.import_module(module), factory))
    assert args.metrics_port == gen.LEDGER_METRICS_PORT
    assert args.metrics_addr == "0.0.0.0"  # Prometheus scrapes from another container


def test_streams_are_replicated_three_times() -> None:
    for name in LEDGERS:
        assert ledger_args(name).replicas == 3 == len(NATS_NODES)


def test_two_ledger_instances_share_one_database() -> None:
    assert len(LEDGERS) == 2
    dsns = {ledger_args(name).database for name in LEDGERS}
    assert len(dsns) == 1
    (dsn,) = dsns
    parts = urlsplit(dsn)
    assert parts.scheme == "postgresql"
    assert parts.password is None, "the password belongs in the pgpass file, not the command"
    postgres = SERVICES["postgres"]["environment"]
    assert parts.hostname == gen.DATABASE_HOST and parts.hostname in SERVICES
    assert parts.username == postgres["POSTGRES_USER"] == gen.DATABASE_USER
    assert parts.path.lstrip("/") == postgres["POSTGRES_DB"] == gen.DATABASE_NAME
    for name in LEDGERS:
        environment = SERVICES[name]["environment"]
        assert environment["OPLEDGER_DATABASE"] == dsn  # what `opledger ...` inside reads
        assert mount_at(SERVICES[name], environment["PGPASSFILE"]).generated == "postgres/pgpass"


def test_pgpass_matches_the_database_and_its_password(generated: Any) -> None:
    parts = urlsplit(ledger_args(LEDGERS[0]).database)
    password = (generated.directory / "postgres" / "password").read_text().strip()
    line = (generated.directory / "postgres" / "pgpass").read_text().strip()
    port = parts.port or 5432
    assert line == f"{parts.hostname}:{port}:{parts.path.lstrip('/')}:{parts.username}:{password}"
    postgres = SERVICES["postgres"]
    assert mount_at(postgres, postgres["environment"]["POSTGRES_PASSWORD_FILE"]).generated == (
        "postgres/password"
    )


@pytest.mark.parametrize("name", EXECUTORS)
def test_executor_flags_are_accepted_and_name_a_tool(name: str, generated: Any) -> None:
    args = executor_args(name)
    assert args.command == "run"
    tool = load_tool(args.tool)
    assert isinstance(tool, Tool)
    assert SAMPLE_TOOLS[tool.name] == args.tool
    assert name == gen.executor_service(tool.name)
    # Its own identity: the seed generate_credentials wrote for this tool.
    seed = generated.credentials.executor(tool.name).seed_path.name
    assert args.creds == Path(f"/run/opledger/creds/{seed}")
    assert mount_at(SERVICES[name], str(args.creds)).generated == f"creds/{seed}"
    assert args.nats_url == ledger_args(LEDGERS[0]).nats_url
    # The contract version the tool implements is in the image's contract directory.
    assert load_contract(in_repo(str(args.contracts)), tool.name, tool.version).name == tool.name
    if tool.required_secrets:
        secrets_file = mount_at(SERVICES[name], str(args.secrets)).generated
        assert secrets_file == f"secrets/{tool.name}.json"
        loaded = load_secrets(generated.directory / secrets_file, environ={})
        assert set(tool.required_secrets) <= set(loaded)
    else:
        assert args.secrets is None
    assert args.metrics_port == gen.EXECUTOR_METRICS_PORT
    assert args.metrics_addr == "0.0.0.0"


def test_every_sample_tool_has_its_executor() -> None:
    tools = {load_tool(executor_args(name).tool).name for name in EXECUTORS}
    assert tools == set(SAMPLE_TOOLS)


def test_ledger_service_connects_to_every_listed_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run the real `run_service_main` up to the connect; nats-py must parse every node."""

    class StubLedger:
        def close(self) -> None:
            pass

    captured: dict[str, Any] = {}

    async def fake_connect(**kwargs: Any) -> Any:
        captured.update(kwargs)
        raise ConnectionRefusedError("stopped by the test before connecting")

    async def connect_only(service: Any) -> None:
        await service.broker.connect()

    monkeypatch.setattr(ledger_main, "build_ledger", lambda *a, **k: StubLedger())
    # The container's seed file is not on this machine; the seal key is not under test.
    monkeypatch.setattr(
        cast(Any, ledger_main).SealKey,
        "from_seed_file",
        classmethod(lambda cls, path: cls.generate()),
    )
    monkeypatch.setattr(ledger_main, "_serve", connect_only)
    monkeypatch.setattr(nats, "connect", fake_connect)
    argv = list(SERVICES[LEDGERS[0]]["command"][3:])
    # The settings check the contract directory exists: use the one the image copies in.
    contracts = argv.index("--contracts") + 1
    argv[contracts] = str(in_repo(argv[contracts]))
    assert ledger_main.run_service_main(argv) != 0
    client = nats.aio.client.Client()
    # What nats.connect does with `servers` first: one pool entry per node.
    client._setup_server_pool(captured["servers"])
    assert [server.uri.hostname for server in client._server_pool] == NATS_NODES


# ------------------------------------------------------ mounts and generated files


def test_mounted_files_are_the_generated_ones(generated: Any) -> None:
    written = {str(path) for path in generated.files}
    mounted: set[str] = set()
    for name, service in SERVICES.items():
        for mount in mounts(service):
            if mount.is_bind:
                assert mount.read_only, f"{name} mounts {mount.source} writable"
                if mount.source.startswith(COMMITTED):
                    # Hand-written configuration: in the repository, without secrets.
                    assert (REPO / mount.source).exists(), mount.source
                    continue
                # Nothing else sneaks in beside the generated set.
                assert mount.generated is not None, f"{name} mounts {mount.source}"
                mounted.add(mount.generated)
    # Used outside compose: agent hosts', auditors', approvers' seeds, and the manifest.
    outside = {
        f
        for f in written
        if f in ("creds/identities.json", "postgres/create-role.sql", "web/signing-key.pem")
        or f.startswith(("creds/host-", "creds/auditor-", "creds/approver-"))
    }
    assert mounted == written - outside
    # Seeds of whoever connects from outside, the SQL for a PostgreSQL of one's own,
    # and the page's private signing key (`opledger --home deploy/generated web token`).
    assert outside == {
        "creds/identities.json",
        "creds/host-agent.nk",
        "creds/auditor-auditor.nk",
        "creds/approver-lead.nk",
        "postgres/create-role.sql",
        "web/signing-key.pem",
    }


def test_each_service_sees_only_its_own_generated_files() -> None:
    seen = {name: set(generated_mounts(service)) for name, service in SERVICES.items()}
    assert seen == expected_own_files()


@pytest.mark.parametrize("name", EXECUTORS)
def test_each_executor_mounts_only_its_own_seed(name: str) -> None:
    tool = load_tool(executor_args(name).tool).name
    seeds = {f for f in generated_mounts(SERVICES[name]) if f.startswith("creds/")}
    assert seeds == {f"creds/exec-{tool}.nk"}
    others = {f"secrets/{t}.json" for t in SAMPLE_TOOLS if t != tool}
    assert not others & set(generated_mounts(SERVICES[name]))


def test_generator_writes_private_files(generated: Any) -> None:
    out = generated.directory
    assert stat.S_IMODE((out / "creds").stat().st_mode) == 0o700
    for path in generated.files:
        mode = stat.S_IMODE((out / path).stat().st_mode)
        if path.name in ("identities.json", "signing-key.pub.pem"):
            continue  # public keys only, written with the process's umask
        if path.name == "prometheus.yml":
            assert mode == 0o644, oct(mode)  # no secret in it; Prometheus runs as nobody
        else:
            assert mode == 0o600, (path, oct(mode))


def test_generator_command_line_rotates_keys_but_keeps_the_database_password(
    tmp_path: Path,
) -> None:
    def run() -> str:
        done = subprocess.run(
            [sys.executable, str(GENERATOR), str(tmp_path / "out")],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    printed = run()
    assert str(tmp_path / "out" / "nats" / "nats-1.conf") in printed
    first = load_credentials(tmp_path / "out" / "creds")
    password = (tmp_path / "out" / "postgres" / "password").read_text()
    run()
    second = load_credentials(tmp_path / "out" / "creds")
    assert (tmp_path / "out" / "postgres" / "password").read_text() == password
    assert {i.public_key for i in first.identities}.isdisjoint(
        {i.public_key for i in second.identities}
    )
    config = (tmp_path / "out" / "nats" / "nats-1.conf").read_text()
    assert all(i.public_key in config for i in second.identities)


# ------------------------------------------------------------------------ NATS


def _setting(config: str, key: str) -> str:
    match = re.search(rf'^\s*{key}: "([^"]*)"', config, re.MULTILINE)
    assert match is not None, f"no {key} in config"
    return match.group(1)


def _cluster_block(config: str) -> str:
    match = re.search(r"^cluster \{\n(.*?)^\}", config, re.MULTILINE | re.DOTALL)
    assert match is not None, "no cluster block"
    return match.group(1)


@pytest.mark.parametrize("node", ["nats-1", "nats-2", "nats-3"])
def test_nats_node_runs_its_generated_config(node: str, generated: Any) -> None:
    service = SERVICES[node]
    command = service["command"]
    assert command[0] == "nats-server" and command[1] in ("-c", "--config"), command
    assert mount_at(service, command[2]).generated == f"nats/{node}.conf"
    config = (generated.directory / "nats" / f"{node}.conf").read_text()
    assert _setting(config, "server_name") == node
    assert _setting(config, "listen") == f"0.0.0.0:{gen.CLIENT_PORT}"
    # Monitoring answers inside the container only, which is where the health check asks.
    # It needs no credentials and lists every connection's NKey and subscriptions,
    # so: loopback, in the container's own network namespace (host networking
    # would make that the host's loopback), and no published port.
    assert _setting(config, "http") == f"127.0.0.1:{gen.MONITOR_PORT}"
    assert f":{gen.MONITOR_PORT}/healthz" in " ".join(service["healthcheck"]["test"])
    assert "network_mode" not in service and "expose" not in service
    assert not [p for p in service.get("ports", []) if str(gen.MONITOR_PORT) in str(p)]
    # JetStream's store lies on the node's own named volume.
    store = PurePosixPath(_setting(config, "store_dir"))
    volumes = [m for m in mounts(service) if not m.is_bind]
    assert any(PurePosixPath(m.target) in (store, *store.parents) for m in volumes), volumes
    assert all(m.target != "/" for m in volumes)
    cluster = _cluster_block(config)
    assert _setting(cluster, "name") == gen.CLUSTER_NAME
    assert _setting(cluster, "listen") == f"0.0.0.0:{gen.CLUSTER_PORT}"
    # Routes authenticate: a container that can reach port 6222 is not a cluster node.
    user, password = _setting(cluster, "user"), _setting(cluster, "password")
    assert user == gen.ROUTE_USER and len(password) >= 32
    routes = re.findall(r'"(nats-route://[^"]+)"', cluster)
    assert routes == [
        f"nats-route://{user}:{password}@{peer}:{gen.CLUSTER_PORT}"
        for peer in NATS_NODES
        if peer != node
    ]
    # The authorization block is exactly the generated identities'.
    assert generated.credentials.authorization_config in config


def test_generated_nats_configs_pass_nats_server_check(generated: Any, tmp_path: Path) -> None:
    binary = str(find_nats_server())

    def check(path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [binary, "-t", "-c", str(path)], capture_output=True, text=True, timeout=10, check=False
        )

    for node in gen.NATS_NODES:
        # `-t` parses and validates without resolving route host names (nats-2 etc.
        # resolve only inside compose), so the files are checked exactly as mounted.
        checked = check(generated.directory / "nats" / f"{node}.conf")
        assert checked.returncode == 0, checked.stdout + checked.stderr
    # The check has teeth: a copy with a field the server does not know is refused.
    broken = tmp_path / "broken.conf"
    text = (generated.directory / "nats" / "nats-1.conf").read_text()
    broken.write_text(text.replace("jetstream {", "no_such_field: true\njetstream {", 1))
    refused = check(broken)
    assert refused.returncode != 0
    assert "no_such_field" in refused.stdout + refused.stderr


def test_prometheus_scrapes_every_metrics_endpoint(generated: Any) -> None:
    config = yaml.safe_load((generated.directory / "prometheus" / "prometheus.yml").read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    expected = {f"{name}:{ledger_args(name).metrics_port}" for name in LEDGERS}
    expected |= {f"{name}:{executor_args(name).metrics_port}" for name in EXECUTORS}
    assert targets == expected
    prometheus = networks(SERVICES["prometheus"])
    for target in targets:
        service = target.split(":")[0]
        assert networks(SERVICES[service]) & prometheus, f"Prometheus cannot reach {service}"


# --------------------------------------------- the generated cluster, for real


@dataclass
class _Node:
    name: str
    client: int
    monitor: int
    cluster: int
    process: subprocess.Popen[bytes] | None = None


def _localised(config: str, node: _Node, nodes: list[_Node], store: Path) -> str:
    """The generated config with container addresses swapped for free loopback ports."""
    swaps = [
        (f'listen: "0.0.0.0:{gen.CLIENT_PORT}"', f'listen: "127.0.0.1:{node.client}"'),
        (f'http: "127.0.0.1:{gen.MONITOR_PORT}"', f'http: "127.0.0.1:{node.monitor}"'),
        (f'listen: "0.0.0.0:{gen.CLUSTER_PORT}"', f'listen: "127.0.0.1:{node.cluster}"'),
        (f'store_dir: "{gen.JETSTREAM_STORE_DIR}"', f'store_dir: "{store}"'),
    ]
    swaps += [
        (f'@{peer.name}:{gen.CLUSTER_PORT}"', f'@127.0.0.1:{peer.cluster}"')
        for peer in nodes
        if peer is not node
    ]
    for old, new in swaps:
        assert config.count(old) == 1, f"{old} not found once in {node.name}'s config"
        config = config.replace(old, new)
    return config


def _wait_healthy(node: _Node, deadline: float) -> None:
    url = f"http://127.0.0.1:{node.monitor}/healthz"
    while time.monotonic() < deadline:
        assert node.process is not None and node.process.poll() is None, f"{node.name} exited"
        try:
            with urllib.request.urlopen(url, timeout=0.5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{node.name} did not become healthy")


def _wait_meta_leader(nodes: list[_Node], deadline: float) -> None:
    """Until one node leads the JetStream meta group and sees every other peer current
    (only the leader tracks its followers: a follower reports the others as not current)."""
    meta: dict[str, Any] = {}
    while time.monotonic() < deadline:
        for node in nodes:
            try:
                url = f"http://127.0.0.1:{node.monitor}/jsz"
                with urllib.request.urlopen(url, timeout=0.5) as response:
                    meta = json.loads(response.read()).get("meta_cluster") or {}
            except (urllib.error.URLError, OSError, ValueError):
                continue
            current = [r for r in meta.get("replicas") or [] if r.get("current")]
            if meta.get("leader") == node.name and len(current) >= len(nodes) - 1:
                return
        time.sleep(0.2)
    raise AssertionError(f"no JetStream meta leader with every peer current: {meta}")


@pytest.fixture
def generated_cluster(generated: Any, tmp_path: Path) -> Iterator[list[_Node]]:
    """The three generated nats configs, running on loopback ports."""
    nodes = [_Node(name, free_port(), free_port(), free_port()) for name in gen.NATS_NODES]
    binary = str(find_nats_server())
    try:
        for node in nodes:
            text = (generated.directory / "nats" / f"{node.name}.conf").read_text()
            path = tmp_path / f"{node.name}.conf"
            path.write_text(_localised(text, node, nodes, tmp_path / node.name / "jetstream"))
            log = (tmp_path / f"{node.name}.log").open("wb")
            node.process = subprocess.Popen(
                [binary, "-c", str(path)], stdout=log, stderr=subprocess.STDOUT
            )
            log.close()
        deadline = time.monotonic() + 30
        for node in nodes:
            _wait_healthy(node, deadline)
        # Healthy is not yet ready: a replicated stream needs the JetStream meta
        # leader elected and every peer known, or its creation can outlast a timeout.
        _wait_meta_leader(nodes, deadline + 30)
        yield nodes
    finally:
        for node in nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.terminate()
        for node in nodes:
            if node.process is not None:
                try:
                    node.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.process.kill()
                    node.process.wait(timeout=5)


@pytest.mark.nats
def test_generated_cluster_takes_the_ledger_topology_with_three_replicas(
    generated: Any, generated_cluster: list[_Node]
) -> None:
    """The ledger identity declares the topology the compose command asks for; an
    executor identity then binds its tool's consumer, with no permission error."""
    args = ledger_args(LEDGERS[0])
    tools = args.tools.split(",")
    urls = [f"nats://127.0.0.1:{node.client}" for node in generated_cluster]
    credentials = load_credentials(generated.directory / "creds")
    errors: list[Exception] = []

    async def on_error(error: Exception) -> None:
        errors.append(error)

    async def scenario() -> None:
        ledger = await connect_as(urls, credentials.ledger, allow_reconnect=False)
        try:
            js = ledger.jetstream(timeout=10)
            await declare_topology(
                js,
                tools,
                ack_wait_s=args.ack_wait,
                max_deliver=args.max_deliver,
                replicas=args.replicas,
            )
            for stream in (WORK_STREAM, RESULTS_STREAM, FEED_STREAM):
                info = await js.stream_info(stream)
                assert info.config.num_replicas == 3, stream
            consumer = await js.consumer_info(WORK_STREAM, work_consumer(tools[0]))
            assert consumer.config.num_replicas == 3
        finally:
            await ledger.close()
        executor = await connect_as(
            urls, credentials.executor(tools[0]), allow_reconnect=False, error_cb=on_error
        )
        try:
            subscription = await executor.jetstream(timeout=5).pull_subscribe_bind(
                consumer=work_consumer(tools[0]), stream=WORK_STREAM
            )
            with pytest.raises(nats.errors.TimeoutError):
                await subscription.fetch(1, timeout=1)
        finally:
            await executor.close()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert not [e for e in errors if "permissions violation" in str(e).lower()], errors


# ------------------------------------------------- the docs say what the code does

DOCS = REPO / "docs"


def _doc(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


@pytest.mark.parametrize("role", list(Role))
def test_architecture_lists_each_roles_exact_permissions(role: Role) -> None:
    rows = [line for line in _doc("architecture.md").splitlines() if line.startswith("| `")]
    (row,) = [r for r in rows if r.split("|")[1].strip() == f"`{role.value}`"]
    _, _, publish, subscribe, responses, _ = row.split("|")
    permissions = permissions_for(role, "NAME")

    def listed(cell: str) -> list[str]:
        return [s.replace("<name>", "NAME") for s in _backticked(cell)]

    assert listed(publish) == list(permissions.publish)
    assert listed(subscribe) == list(permissions.subscribe)
    if permissions.allow_responses is None:
        assert responses.strip() == "none"
    else:
        rp = permissions.allow_responses
        assert f"max: {rp.max}" in responses and f'expires: "{rp.expires}"' in responses


def test_architecture_state_diagram_follows_allowed() -> None:
    text = _doc("architecture.md")
    diagram = text.split("```mermaid\nstateDiagram-v2\n", 1)[1].split("```", 1)[0]
    edges = re.findall(r"^\s*(\S+) --> (\S+?)(?::\s*(.*))?$", diagram, re.MULTILINE)
    states = {state.value for state in OperationState}
    nodes = {node for edge in edges for node in edge[:2]} - {"[*]"}
    assert nodes == states
    for source, target, label in edges:
        if source == "[*]" or target == "[*]":
            continue
        # "command[ or command][, a note] (Events it appends)"
        commands = label.split("(")[0].split(",")[0].split(" or ")
        for command in (c.strip() for c in commands):
            assert command in ALLOWED, (source, label)
            assert OperationState(source) in ALLOWED[command], (source, command)
    for command in ALLOWED:
        assert f"{command} " in diagram or f"`{command}`" in text, command


def test_architecture_names_every_stream_and_consumer() -> None:
    text = _doc("architecture.md")
    for name in (WORK_STREAM, RESULTS_STREAM, FEED_STREAM, RESULTS_CONSUMER, FEED_AUDITOR_CONSUMER):
        assert f"`{name}`" in text, name
    assert f"`{work_consumer('TOOL').replace('TOOL', '<tool>')}`" in text


def _wire_examples() -> list[tuple[str, str]]:
    return re.findall(
        r"<!-- schema: ([a-z-]+) -->\n```json\n(.*?)```", _doc("wire-format.md"), re.S
    )


def test_wire_format_examples_match_their_schemas() -> None:
    examples = _wire_examples()
    assert len(examples) >= 15
    for schema_name, example in examples:
        schema = json.loads((SCHEMA_DIR / f"{schema_name}.schema.json").read_text())
        errors = [e.message for e in Draft202012Validator(schema).iter_errors(json.loads(example))]
        assert not errors, (schema_name, errors)


def test_wire_format_covers_every_published_schema() -> None:
    text = _doc("wire-format.md")
    for name in WIRE_MODELS:
        assert f"{name}.schema.json" in text or f"[`{name}`]" in text, name
    illustrated = {schema for schema, _ in _wire_examples()}
    top_level = set(WIRE_MODELS) - {
        "proposal", "runtime-context", "decision", "validation-issue", "plan-proposal"
    }
    assert top_level <= illustrated


def test_operations_lists_every_setting_flag_and_metric() -> None:
    text = _doc("operations.md")
    for field in Settings.model_fields:
        assert f"`{ENV_PREFIX}{field.upper()}`" in text, field
    for parser in (ledger_main.build_parser(), _executor_run_parser()):
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert f"`{flag}`" in text, flag
    for metrics in (LedgerMetrics(), ExecutorMetrics()):
        for family in metrics.registry.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            assert f"`{name}`" in text, name


def _executor_run_parser() -> ArgumentParser:
    parser = executor_main.build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    run: ArgumentParser = cast("dict[str, ArgumentParser]", commands.choices)["run"]
    return run


@pytest.mark.nats
def test_generated_cluster_refuses_a_route_without_the_password(
    generated_cluster: list[_Node],
) -> None:
    """Anyone on the NATS network reaches port 6222; only the nodes may join as routes."""
    node = generated_cluster[0]
    with socket.create_connection(("127.0.0.1", node.cluster), timeout=5) as sock:
        sock.settimeout(5)
        reader = sock.makefile("rb")
        assert reader.readline().startswith(b"INFO ")
        hello = {"verbose": False, "pedantic": False, "name": "rogue", "cluster": "opledger"}
        sock.sendall(b"CONNECT " + json.dumps(hello).encode() + b"\r\nPING\r\n")
        answer = reader.readline()
    assert answer.startswith(b"-ERR") and b"authorization" in answer.lower(), answer


def test_wire_format_lists_every_event_type() -> None:
    text = _doc("wire-format.md")
    events = [
        name
        for name, value in vars(Operation).items()
        if isinstance(value, type) and issubclass(value, Operation.Event) and name != "Event"
    ]
    assert len(events) > 20
    for name in events:
        assert f"`{name}`" in text, name


@pytest.mark.parametrize("name", ["architecture.md", "wire-format.md", "operations.md"])
def test_docs_links_resolve(name: str) -> None:
    def anchor(heading: str) -> str:
        return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")

    for target in re.findall(r"\]\(([^)\s]+)\)", _doc(name)):
        if target.startswith(("http://", "https://")):
            continue
        path, _, fragment = target.partition("#")
        file = (DOCS / path).resolve() if path else DOCS / name
        assert file.exists(), f"{name}: {target}"
        if fragment and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.MULTILINE)
            assert fragment in {anchor(h) for h in headings}, f"{name}: {target}"


# ------------------------------------------------------------ the approval page

CADDYFILE = REPO / "deploy" / "proxy" / "Caddyfile"
PROXY_PORT = 8443
"""The proxy's published port on 127.0.0.1 (it listens on 443 in its container)."""


def approvals_args() -> Namespace:
    """The parsed arguments of the approval page service (`opledger web serve ...`)."""
    command = SERVICES["approvals"]["command"]
    assert command[:3] == ["python", "-m", "ledger.entrypoints"], command
    args = parse(opledger_cli.build_parser(), command[3:], "approvals")
    assert (args.group, args.action) == ("web", "serve"), command
    return args


def caddy_blocks(text: str) -> dict[str, list[str]]:
    """Top-level Caddyfile blocks (`""` for the global options) → their directives.

    Enough of the format for this file: one block per address line, directives
    one per line, `#` comments; nested blocks are kept as their opening line.
    """
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    depth = 0
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if depth == 0:
            assert line.endswith("{"), f"not a block: {line}"
            current = blocks.setdefault(line[:-1].strip(), [])
            depth = 1
            continue
        if line == "}":
            depth -= 1
            continue
        if depth == 1:
            assert current is not None
            current.append(line)
        if line.endswith("{"):
            depth += 1
    assert depth == 0, "unbalanced braces"
    return blocks


def catalog_approver_roles(contracts: Path) -> set[str]:
    """Every approver role a contract of the catalog asks for."""
    registry = ContractRegistry.from_directory(contracts)
    roles: set[str] = set()
    for name in registry.names():
        for version in registry.versions(name):
            contract = registry.get(name, version)
            assert contract is not None
            if contract.approval.mode not in (ApprovalMode.NEVER, ApprovalMode.FORBIDDEN):
                roles |= set(contract.approval.approver_roles)
    return roles


def test_the_approval_page_publishes_no_port_and_only_the_proxy_reaches_it() -> None:
    page = SERVICES["approvals"]
    assert "ports" not in page and "expose" not in page and "network_mode" not in page
    # Internal networks only: the database, and the one it shares with the proxy.
    for network in networks(page):
        assert COMPOSE["networks"][network].get("internal") is True, network
    page_side = networks(page) - networks(SERVICES["postgres"])
    assert page_side == {"approvals"}
    neighbours = {n for n, s in SERVICES.items() if networks(s) & page_side}
    assert neighbours == {"approvals", "proxy"}
    # The proxy is the one with a door to the outside.
    proxy = SERVICES["proxy"]
    assert [str(p) for p in proxy["ports"]] == [f"127.0.0.1:{PROXY_PORT}:443"]
    assert any(not COMPOSE["networks"][n].get("internal") for n in networks(proxy))


def test_the_proxy_forwards_to_the_page_with_the_origin_it_checks() -> None:
    proxy = SERVICES["proxy"]
    # The image's default command reads /etc/caddy/Caddyfile.
    assert "command" not in proxy and "entrypoint" not in proxy
    assert mount_at(proxy, "/etc/caddy/Caddyfile").source == "./deploy/proxy/Caddyfile"
    blocks = caddy_blocks(CADDYFILE.read_text(encoding="utf-8"))
    assert "admin off" in blocks.pop("")  # nobody on the network reconfigures it
    ((site, directives),) = blocks.items()
    assert not site.startswith("http://") and ":" not in site  # HTTPS on its port 443
    assert any(d.startswith("tls ") for d in directives), directives
    args = approvals_args()
    host, _, port = args.listen.rpartition(":")
    assert host == "0.0.0.0"  # in its own container, on the internal network only
    assert f"reverse_proxy approvals:{port}" in directives
    # What a browser's Origin is: the proxy's name and published port, over HTTPS,
    # and the cookie follows suit.
    assert args.public_origin == f"https://{site}:{PROXY_PORT}"
    assert args.secure_cookies is True


def test_the_approval_page_opens_the_production_ledger() -> None:
    args = approvals_args()
    page = SERVICES["approvals"]
    assert args.database == ledger_args(LEDGERS[0]).database
    environment = page["environment"]
    assert mount_at(page, environment["PGPASSFILE"]).generated == "postgres/pgpass"
    assert in_repo(environment["OPLEDGER_CONTRACTS_DIR"]) == in_repo(
        str(ledger_args(LEDGERS[0]).contracts)
    )
    # It opens an existing ledger: the ledger service creates the tables.
    assert set(page["depends_on"]) >= {"postgres", LEDGERS[0]}


def test_the_approval_page_accepts_a_token_from_the_generated_key(generated: Any) -> None:
    args = approvals_args()
    page = SERVICES["approvals"]
    assert mount_at(page, str(args.public_key)).generated == "web/signing-key.pub.pem"
    assert args.jwks is None and args.jwks_url is None
    # The generated pair is the one `opledger --home deploy/generated web token` signs with.
    assert (args.issuer, args.audience) == (LOCAL_ISSUER, LOCAL_AUDIENCE)
    role_map: dict[str, frozenset[str]] = {}
    for flag in args.groups:
        group, _, roles = flag.partition("=")
        role_map[group] = frozenset(roles.split(","))
    settings = TokenSettings(
        issuer=args.issuer,
        audience=args.audience,
        public_key_pem=(generated.directory / "web" / "signing-key.pub.pem").read_text(),
        user_claim=args.user_claim,
        roles_claim=args.roles_claim,
        role_map=role_map,
    )
    verifier = TokenVerifier(settings)
    signer = LocalSigner(generated.directory / "web")
    approver = verifier.verify(signer.token("lead-ana", ["support_lead"]))
    assert approver.name == "lead-ana" and approver.roles == {"support_lead"}
    # Every role a contract asks for can be held on the page, and nothing else is handed out.
    mapped = {role for roles in role_map.values() for role in roles}
    assert mapped == catalog_approver_roles(in_repo(str(ledger_args(LEDGERS[0]).contracts)))
    # A token from another key is refused.
    stranger = LocalSigner(generated.directory / "stranger")
    with pytest.raises(NotAuthenticated):
        verifier.verify(stranger.token("lead-ana", ["support_lead"]))


# --------------------------------------------------------------------- Grafana

GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "opledger.json"
SYNTHETIC_SERIES = frozenset({"up"})
"""Series Prometheus itself writes for every target: in no client registry."""
PROMQL_WORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
    }
)


def _grafana_yaml(kind: str) -> tuple[Mount, dict[str, Any]]:
    """The provisioning file of `kind` (datasources, dashboards) Grafana mounts, parsed."""
    (mount,) = [
        m
        for m in mounts(SERVICES["grafana"])
        if PurePosixPath(m.target).parent == PurePosixPath(f"/etc/grafana/provisioning/{kind}")
    ]
    assert mount.target.endswith((".yml", ".yaml")), mount.target
    parsed: dict[str, Any] = yaml.safe_load((REPO / mount.source).read_text(encoding="utf-8"))
    return mount, parsed


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard() -> None:
    grafana = SERVICES["grafana"]
    # The datasource: the prometheus service, on a network both join.
    _, datasources = _grafana_yaml("datasources")
    (source,) = datasources["datasources"]
    url = urlsplit(source["url"])
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    assert url.hostname == "prometheus" and networks(grafana) & networks(SERVICES["prometheus"])
    prometheus_port = str(SERVICES["prometheus"]["ports"][0]).rsplit(":", 1)[1]
    assert str(url.port) == prometheus_port
    # The dashboards: the provider reads the directory the dashboard JSON is mounted at.
    _, providers = _grafana_yaml("dashboards")
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    (directory,) = [m for m in mounts(grafana) if m.target == provider["options"]["path"]]
    assert directory.read_only and (REPO / directory.source).resolve() == DASHBOARD.parent
    # Every panel and query asks the provisioned datasource.
    uids = {
        target["datasource"]["uid"]
        for panel in _panels()
        for target in [panel, *panel.get("targets", [])]
        if "datasource" in target
    }
    assert uids == {source["uid"]}
    # Its admin password is generated, never the image's admin/admin.
    password = grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"]
    assert mount_at(grafana, password).generated == "grafana/admin-password"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in grafana["environment"]
    assert not str(grafana["user"]).startswith(("0:", "root"))


def _panels() -> list[dict[str, Any]]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        panels += [panel, *panel.get("panels", [])]
    return panels


@dataclass(frozen=True)
class Selector:
    """One series selector of a PromQL expression: `name{label="value", ...}`."""

    name: str
    matchers: dict[str, str]


def promql_parts(expr: str) -> tuple[list[Selector], set[str]]:
    """The series selectors of `expr` and the labels its `by (...)` clauses name.

    Enough PromQL for the dashboard's queries: selectors, label matchers, range
    brackets (whose `$__rate_interval` is no series), function calls and grouping.
    """
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    grouping: set[str] = set()
    for clause in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        grouping |= {label.strip() for label in clause.split(",") if label.strip()}
    # Grouping and vector-matching clauses list labels, not series.
    rest = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)
    selectors = []
    for match in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?\s*(\()?", rest):
        name, braces, call = match.groups()
        if call or name in PROMQL_WORDS:
            continue  # a function or an aggregation, not a series
        matchers = {
            label: value
            for label, _, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', braces or "")
        }
        selectors.append(Selector(name, matchers))
    return selectors, grouping


def exposed_series(metrics: LedgerMetrics | ExecutorMetrics) -> dict[str, frozenset[str]]:
    """Every series name the registry exposes (`_total`, `_bucket`, ...) → its labels.

    A labelled metric exposes nothing until a child exists: one is made per metric,
    so the names and labels are exactly what prometheus-client writes.
    """
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase) and value._labelnames:
            value.labels(*["x"] * len(value._labelnames))
    return {
        sample.name: frozenset(sample.labels)
        for family in metrics.registry.collect()
        for sample in family.samples
    }


def test_dashboard_queries_name_metrics_and_labels_the_registries_expose(
    generated: Any,
) -> None:
    config = yaml.safe_load((generated.directory / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    by_job = {
        "opledger-ledger": exposed_series(LedgerMetrics()),
        "opledger-executors": exposed_series(ExecutorMetrics()),
    }
    assert set(by_job) == jobs
    used: dict[str, set[str]] = {job: set() for job in jobs}
    queries = [t for panel in _panels() for t in panel.get("targets", [])]
    assert len(queries) >= 20
    for target in queries:
        expr = target["expr"]
        selectors, grouping = promql_parts(expr)
        assert selectors, expr
        labels: set[str] = set()
        for selector in selectors:
            if selector.name in SYNTHETIC_SERIES:
                assert set(re.findall(r'"([^"]*)"', str(selector.matchers))) <= {"opledger-.*"}
                labels |= {"job", "instance"}
                continue
            # The ledger and the executors share names from different vantage points:
            # every query says whose series it means.
            job = selector.matchers.get("job")
            assert job in by_job, f'{expr}: name job="opledger-ledger" or the executors'
            series = by_job[job]
            assert selector.name in series, f"{selector.name} is not exposed by {job}"
            known = series[selector.name] | {"job", "instance"}
            assert set(selector.matchers) <= known, (expr, selector.matchers)
            labels |= known
            used[job].add(selector.name)
        assert grouping <= labels, (expr, grouping - labels)
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        assert legend <= (grouping or labels), (expr, legend)
    # Every metric of both processes is on the dashboard somewhere.
    for job, series in by_job.items():
        families = {re.sub(r"_(total|bucket|count|sum|created)$", "", name) for name in series}
        shown = {re.sub(r"_(total|bucket|count|sum|created)$", "", name) for name in used[job]}
        assert families == shown, (job, families - shown)


def test_promql_parts_finds_series_and_grouping() -> None:
    """The parser the dashboard test relies on, on a query with every construct."""
    selectors, grouping = promql_parts(
        'histogram_quantile(0.99, sum by (le, tool) (rate(x_bucket{job="j", tool=~"a|b"}'
        "[$__rate_interval]))) / on (tool) sum by (tool) (y_total)"
    )
    assert selectors == [Selector("x_bucket", {"job": "j", "tool": "a|b"}), Selector("y_total", {})]
    assert grouping == {"le", "tool"}


def test_dashboard_panels_have_unique_ids_and_titles() -> None:
    panels = _panels()
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    titles = [panel["title"] for panel in panels]
    assert len(titles) == len(set(titles))
