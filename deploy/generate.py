"""Generate the configuration of a production topology: `python deploy/generate.py OUTPUT_DIR`.

    python deploy/generate.py deploy/generated

writes what `docker-compose.yml` mounts (it expects `deploy/generated`). With
options it writes the same set for plain processes on hosts instead of
containers: where each nats-server node runs and on which ports, where its
JetStream store lies, where the seeds, the secrets and the e-mail provider's
file go, which PostgreSQL role and database the ledger uses, and what
Prometheus scrapes (docs/operations.md, "Plain processes"):

    python deploy/generate.py /etc/opledger \\
        --nats-node n1=10.0.0.11 --nats-node n2=10.0.0.12 --nats-node n3=10.0.0.13 \\
        --jetstream-dir /var/lib/nats/jetstream \\
        --database-url postgresql://opledger@db.internal:5432/opledger

Every option and its default: `python deploy/generate.py --help`. Under
OUTPUT_DIR (the seeds and secrets under `--creds-dir` and `--secrets-dir`,
which default to OUTPUT_DIR/creds and OUTPUT_DIR/secrets):

    creds/ledger-ledger.nk          the ledger services' NKey seed (both instances)
    creds/exec-<tool>.nk            one seed per tool, for that tool's executor only
    creds/host-<host>.nk            agent hosts' seeds (used outside compose)
    creds/auditor-<auditor>.nk      auditors' seeds (used outside compose)
    creds/approver-<approver>.nk    approvers' seeds (used outside compose)
    creds/system-<name>.nk          with --system-user: a user of the system account,
                                    for `nats server report jetstream` and the like
    creds/identities.json           role, name and public key of every identity (no secrets)
    nats/<node>.conf                one nats-server config per cluster node: JetStream,
                                    routes to the other nodes (authenticated with a
                                    generated route password), monitoring on 127.0.0.1
                                    only, and the accounts block of the generated identities
    secrets/<tool>.json             an executor's own secrets, for tools that need any
    postgres/password               the PostgreSQL password (kept when it already exists)
    postgres/pgpass                 the same password in libpq's password-file format,
                                    for the role and database of --database-url
    postgres/create-role.sql        creates that role and database (plain processes; in
                                    compose the postgres service creates them itself)
    prometheus/prometheus.yml       scrape targets: the ledger services and every executor
    grafana/admin-password          Grafana's admin password (kept when it already exists)
    web/signing-key.pem             the approval page's token-signing key (kept; used
    web/signing-key.pub.pem         outside compose by `opledger --home OUTPUT_DIR web
                                    token`); the page checks tokens against the public half

Seeds, secrets, passwords, the private key and the nats configs are written
with mode 0600 (the seed directory 0700). Running the generator again rotates
every NKey and the route password and rewrites the nats configs; the
PostgreSQL and Grafana passwords and the page's signing key are kept, because
the database and Grafana read their passwords only when their data is first
initialised, and tokens already handed out should stay valid.

The nats configs are rendered with `ledger.nats.render_server_config`
(what `write_server_config` uses), with the cluster block written here:
`ClusterOptions` has no route authorization, and `write_server_config` binds
monitoring to the client listen address.

Nothing here is committed: the directory holds secrets.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

# Run from a checkout (`python deploy/generate.py`), the script's own directory is
# first on sys.path, not the repository: make the checkout's packages importable,
# the same code the Docker image is built from.
_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import nkeys  # type: ignore[import-untyped]  # noqa: E402  # nkeys ships no type information
import yaml  # noqa: E402

from executors import Tool, load_tool  # noqa: E402
from executors.samples import SAMPLE_TOOLS  # noqa: E402
from ledger.nats import (  # noqa: E402
    CredentialSet,
    ServerSettings,
    generate_credentials,
    quote,
    render_server_config,
)
from ledger.nats.security import new_user_seed  # noqa: E402
from ledger.web import LocalSigner  # noqa: E402

__all__ = [
    "CLIENT_PORT",
    "CLUSTER_NAME",
    "CLUSTER_PORT",
    "DATABASE_HOST",
    "DATABASE_NAME",
    "DATABASE_URL",
    "DATABASE_USER",
    "DEFAULT_APPROVERS",
    "DEFAULT_AUDITORS",
    "DEFAULT_HOSTS",
    "EMAIL_PROVIDER_DB",
    "EXECUTOR_METRICS_PORT",
    "JETSTREAM_STORE_DIR",
    "LEDGER_METRICS_PORT",
    "LEDGER_SERVICES",
    "MONITOR_HOST",
    "MONITOR_PORT",
    "NATS_LISTEN",
    "NATS_NODES",
    "ROUTE_USER",
    "SECRET_VALUES",
    "SYSTEM_ACCOUNT",
    "Database",
    "Generated",
    "NatsNode",
    "Topology",
    "executor_service",
    "generate",
    "main",
]

NATS_NODES: tuple[str, ...] = ("nats-1", "nats-2", "nats-3")
"""The cluster's nodes, by compose service name (also their `server_name`)."""
CLUSTER_NAME = "opledger"
CLIENT_PORT = 4222
CLUSTER_PORT = 6222
MONITOR_PORT = 8222
"""`/healthz` (JetStream ready, a meta leader known) is the health check."""
MONITOR_HOST = "127.0.0.1"
"""Where every node's monitor listens, whatever the options: it answers anyone
without credentials (docs/operations.md, "nats-server monitoring")."""
NATS_LISTEN = "0.0.0.0"
"""The address the client and cluster listeners bind by default (`--nats-listen`)."""
ROUTE_USER = "route"
"""The user nodes authenticate as on each other's cluster port (password generated)."""
JETSTREAM_STORE_DIR = "/data/jetstream"
"""Inside the nats container; a named volume per node is mounted at `/data`."""
SYSTEM_ACCOUNT = "SYS"
"""The system account `--system-user` adds (server-wide reports and health)."""

LEDGER_SERVICES: tuple[str, ...] = ("ledger-1", "ledger-2")
LEDGER_METRICS_PORT = 9400
EXECUTOR_METRICS_PORT = 9300

DATABASE_HOST = "postgres"
DATABASE_PORT = 5432
DATABASE_NAME = "opledger"
DATABASE_USER = "opledger"
DATABASE_URL = f"postgresql://{DATABASE_USER}@{DATABASE_HOST}:{DATABASE_PORT}/{DATABASE_NAME}"
"""What the ledger services connect to in compose; the password is in pgpass, not here."""

DEFAULT_HOSTS: tuple[str, ...] = ("agent",)
DEFAULT_AUDITORS: tuple[str, ...] = ("auditor",)
DEFAULT_APPROVERS: tuple[str, ...] = ("lead",)
"""Approver identities; the roles they hold are the ledger service's `--approver`
flags in docker-compose.yml (`lead`: `support_lead`), not part of any seed."""

EMAIL_PROVIDER_DB = "/var/lib/opledger/email/provider.db"
"""The sample e-mail provider's file inside its executor's container (on a volume)."""

SECRET_VALUES: Mapping[str, str] = {
    # The sample e-mail executor's fake provider: a SQLite file on the executor's
    # own volume. It is a path, not a credential: a real tool's API keys do not
    # belong in this script, but in its secrets file or in OPLEDGER_SECRET_<NAME>
    # variables of its executor service only.
    "email_provider_db": EMAIL_PROVIDER_DB,
}
"""Default values of the secrets the sample tools declare (`Tool.required_secrets`)."""

_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
"""A node name: also a file name and the `{node}` of `--jetstream-dir`."""
_PORT_NAMES = ("client", "cluster", "monitor")
_HOST = re.compile(r"^[A-Za-z0-9._%:-]+$")
"""A DNS name, an IPv4 address, or (from inside brackets) an IPv6 one: it goes into
route URLs and Prometheus targets as it is."""


def executor_service(tool: str) -> str:
    """The compose service (and host name) of `tool`'s executor: `executor-send-customer-email`.

    Hyphens, not underscores: the name is a DNS host name in Prometheus targets.
    """
    return "executor-" + tool.replace("_", "-")


def _port(text: str, what: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{what}: {text!r} is not a port (1-65535)")
    return int(text)


def _host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_host(spec: str, what: str) -> tuple[str, str]:
    """`HOST` and the rest after it (`:...` or empty); an IPv6 host is bracketed."""
    if spec.startswith("["):
        host, bracket, rest = spec[1:].partition("]")
        if not bracket or not host:
            raise ValueError(f"{what}: {spec!r} has an unclosed '['")
    else:
        host, colon, rest = spec.partition(":")
        rest = colon + rest
    if not host:
        raise ValueError(f"{what}: {spec!r} names no host")
    if not _HOST.match(host):
        raise ValueError(f"{what}: {host!r} is not a host name or address")
    if rest and not rest.startswith(":"):
        raise ValueError(f"{what}: {spec!r}: write HOST[:PORT...]")
    return host, rest[1:] if rest else ""


def _target(spec: str, what: str) -> str:
    """A Prometheus target `HOST:PORT`, checked."""
    host, rest = _split_host(spec, what)
    if not rest:
        raise ValueError(f"{what}: {spec!r}: write HOST:PORT")
    return _host_port(host, _port(rest, what))


@dataclass(frozen=True)
class NatsNode:
    """One nats-server node: its name, where the others reach it, and its ports."""

    name: str
    host: str
    """The host name or address other nodes route to and clients connect to."""
    client_port: int = CLIENT_PORT
    cluster_port: int = CLUSTER_PORT
    monitor_port: int = MONITOR_PORT

    @classmethod
    def parse(cls, spec: str) -> NatsNode:
        """`NAME=HOST[:CLIENT_PORT[:CLUSTER_PORT[:MONITOR_PORT]]]`; unnamed ports keep
        their defaults (4222, 6222, 8222). An IPv6 address goes in brackets."""
        what = f"--nats-node {spec!r}"
        name, sep, rest = spec.partition("=")
        if not sep:
            raise ValueError(f"{what}: write NAME=HOST[:CLIENT_PORT[:CLUSTER_PORT[:MONITOR_PORT]]]")
        host, ports = _split_host(rest, what)
        numbers = ports.split(":") if ports else []
        if len(numbers) > len(_PORT_NAMES):
            raise ValueError(f"{what}: at most three ports (client, cluster, monitor)")
        defaults = [CLIENT_PORT, CLUSTER_PORT, MONITOR_PORT]
        for index, number in enumerate(numbers):
            defaults[index] = _port(number, f"{what}, {_PORT_NAMES[index]} port")
        return cls(name, host, *defaults)

    @property
    def client_url(self) -> str:
        """`nats://HOST:CLIENT_PORT`, one entry of the clients' `--nats-url`."""
        return f"nats://{_host_port(self.host, self.client_port)}"

    @property
    def ports(self) -> tuple[int, int, int]:
        """Client, cluster and monitor port."""
        return (self.client_port, self.cluster_port, self.monitor_port)


@dataclass(frozen=True)
class Database:
    """The PostgreSQL role and database of a DSN (`--database-url`), for pgpass and SQL."""

    host: str
    port: int
    name: str
    user: str

    @classmethod
    def parse(cls, dsn: str) -> Database:
        """`postgresql://USER@HOST[:PORT]/DBNAME`; no password (it goes to pgpass).

        Without a host (`postgresql://USER@/DBNAME`, a Unix socket) the pgpass line
        names `localhost`, which libpq matches for socket connections too.
        """
        parts = urlsplit(dsn)
        if parts.scheme not in ("postgresql", "postgres"):
            raise ValueError("--database-url: not a postgresql:// URL")
        if parts.password is not None:
            # The password belongs in pgpass; never echo the URL, it holds one.
            raise ValueError("--database-url: must not hold a password (it goes to pgpass)")
        if not parts.username:
            raise ValueError("--database-url: name the role, postgresql://ROLE@HOST/DBNAME")
        name = unquote(parts.path.lstrip("/"))
        if not name or "/" in name:
            raise ValueError("--database-url: name the database, postgresql://ROLE@HOST/DBNAME")
        try:
            port = parts.port or DATABASE_PORT
        except ValueError as error:
            raise ValueError(f"--database-url: {error}") from None
        return cls(parts.hostname or "localhost", port, name, unquote(parts.username))


@dataclass(frozen=True)
class Topology:
    """Where everything runs: the options of `generate`. The defaults are the compose
    topology's (container names, the same ports on every node, container paths)."""

    nats_nodes: tuple[NatsNode, ...] = tuple(NatsNode(name, name) for name in NATS_NODES)
    nats_listen: str = NATS_LISTEN
    """The address every node's client and cluster listeners bind."""
    jetstream_dir: str = JETSTREAM_STORE_DIR
    """Each node's JetStream store; `{node}` is replaced by the node's name."""
    creds_dir: Path | None = None
    """Where the seeds are written; None: OUTPUT_DIR/creds."""
    secrets_dir: Path | None = None
    """Where the executors' secrets files are written; None: OUTPUT_DIR/secrets."""
    email_provider_db: str = EMAIL_PROVIDER_DB
    """The sample e-mail provider's file, as its executor sees it."""
    database_url: str = DATABASE_URL
    ledger_metrics: tuple[str, ...] = tuple(
        f"{service}:{LEDGER_METRICS_PORT}" for service in LEDGER_SERVICES
    )
    """Prometheus targets of the ledger services."""
    executor_metrics: tuple[str, ...] | None = None
    """Prometheus targets of the executors; None: `executor-<tool>:9300` for every tool."""
    system_user: str | None = None
    """A system-account user to generate a seed for; None: no system account user."""

    def store_dir(self, node: NatsNode) -> str:
        """`node`'s JetStream store directory."""
        return self.jetstream_dir.replace("{node}", node.name)

    @property
    def database(self) -> Database:
        """The role and database of `database_url`."""
        return Database.parse(self.database_url)

    def check(self) -> None:
        """`ValueError` naming the option, for a topology that cannot work."""
        if not self.nats_nodes:
            raise ValueError("--nats-node: at least one node")
        names = [node.name for node in self.nats_nodes]
        for name in names:
            if not _NODE_NAME.match(name):
                raise ValueError(f"--nats-node: {name!r} is not a node name ([A-Za-z0-9_-])")
        if len(set(names)) != len(names):
            raise ValueError("--nats-node: two nodes have the same name")
        if not PurePosixPath(self.jetstream_dir).is_absolute():
            # Relative, it would depend on the directory each nats-server starts in.
            raise ValueError("--jetstream-dir: give an absolute path")
        if not PurePosixPath(self.email_provider_db).is_absolute():
            raise ValueError("--email-provider-db: give an absolute path")
        by_host: dict[str, list[NatsNode]] = {}
        for node in self.nats_nodes:
            if len(set(node.ports)) != len(node.ports):
                raise ValueError(f"--nats-node {node.name}: client, cluster, monitor ports clash")
            by_host.setdefault(node.host.lower(), []).append(node)
        for host, nodes in by_host.items():
            if len(nodes) < 2:
                continue
            # Nodes on one host share its ports and its file system.
            ports = [port for node in nodes for port in node.ports]
            if len(set(ports)) != len(ports):
                raise ValueError(
                    f"--nats-node: the nodes on {host} need distinct ports"
                    " (NAME=HOST:CLIENT_PORT:CLUSTER_PORT:MONITOR_PORT)"
                )
            if len({self.store_dir(node) for node in nodes}) != len(nodes):
                raise ValueError(
                    f"--jetstream-dir: the nodes on {host} would share one store;"
                    " put {node} in the path"
                )
        if self.system_user is not None and not _NODE_NAME.match(self.system_user):
            raise ValueError(f"--system-user: {self.system_user!r} is not a name")
        for target in (*self.ledger_metrics, *(self.executor_metrics or ())):
            _target(target, "metrics target")
        Database.parse(self.database_url)


@dataclass(frozen=True)
class Generated:
    """What one run wrote."""

    directory: Path
    credentials: CredentialSet
    files: tuple[Path, ...]
    """Every file written: relative to `directory` when under it (`directory / path`
    names it either way)."""
    topology: Topology = field(default_factory=Topology)


def _write_private(path: Path, data: bytes) -> None:
    """`data` to `path`, mode 0600 from creation on, replaced atomically (directory 0700)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _kept_password(path: Path) -> str:
    """The password in `path`, or a new one written there (0600) if there is none."""
    if path.exists():
        password = path.read_text(encoding="utf-8").strip()
        if not password or ":" in password or "\\" in password:
            raise SystemExit(f"error: {path} must hold one password without ':' or '\\'")
        return password
    # URL-safe characters only: nothing that a pgpass line or SQL literal needs escaped.
    password = secrets.token_urlsafe(32)
    _write_private(path, f"{password}\n".encode())
    return password


def _cluster_block(
    node: NatsNode, nodes: Sequence[NatsNode], listen: str, route_password: str
) -> list[str]:
    """The `cluster { ... }` block of `node`: routes to the other nodes.

    Written here rather than through `ClusterOptions`, which cannot express
    route authorization: without it anyone who reaches the cluster port (an
    executor's container, say) could connect as a route, and messages that
    arrive over a route are not subject to any user's permissions.
    """
    routes = [
        f"nats-route://{ROUTE_USER}:{route_password}@{_host_port(peer.host, peer.cluster_port)}"
        for peer in nodes
        if peer is not node
    ]
    return [
        "cluster {",
        f"  name: {quote(CLUSTER_NAME)}",
        f"  listen: {quote(_host_port(listen, node.cluster_port))}",
        "  authorization {",
        f"    user: {quote(ROUTE_USER)}",
        f"    password: {quote(route_password)}",
        "  }",
        "  routes: [",
        *(f"    {quote(route)}" for route in routes),
        "  ]",
        "}",
    ]


def _system_user(creds_dir: Path, name: str) -> tuple[Path, str]:
    """A fresh seed for system-account user `name`: its file and its public key."""
    seed = new_user_seed()
    keypair = nkeys.from_seed(bytearray(seed))
    try:
        public_key = str(keypair.public_key.decode())
    finally:
        keypair.wipe()
    path = creds_dir / f"system-{name}.nk"
    _write_private(path, seed + b"\n")
    return path, public_key


def _with_system_account(accounts: str, public_key: str) -> str:
    """The `accounts { ... }` block with a system account holding one user.

    The user has no permission list: the system account's subjects are the
    server's own (`$SYS.>`), and the account sees no application message. Who
    holds this seed can read every server's reports and connection lists, as
    the monitoring endpoint shows them.
    """
    if not accounts.endswith("}\n"):
        raise AssertionError("unexpected accounts block")  # pragma: no cover - our own renderer
    system = [
        f"  {SYSTEM_ACCOUNT} {{",
        "    users: [",
        f"      {{ nkey: {quote(public_key)} }}",
        "    ]",
        "  }",
    ]
    return accounts[: -len("}\n")] + "\n".join(system) + "\n}\n"


def _nats_configs(
    out: Path, credentials: CredentialSet, topology: Topology, system_key: str | None
) -> list[Path]:
    # One route password per generation, shared by the nodes; URL-safe.
    route_password = secrets.token_urlsafe(32)
    accounts = credentials.authorization_config
    extra: list[str] = []
    if system_key is not None:
        accounts = _with_system_account(accounts, system_key)
        extra.append(f"system_account: {quote(SYSTEM_ACCOUNT)}")
    nodes = topology.nats_nodes
    written = []
    for node in nodes:
        # A single node has no peers: a cluster block without routes would only
        # make it wait for some.
        cluster = (
            _cluster_block(node, nodes, topology.nats_listen, route_password)
            if len(nodes) > 1
            else []
        )
        settings = ServerSettings(
            server_name=node.name,
            port=node.client_port,
            host=topology.nats_listen,
            store_dir=Path(topology.store_dir(node)),
            authorization=accounts,
            extra_lines=(
                # Monitoring on loopback only: the health check asks /healthz there,
                # and /connz or /subsz are nobody else's business.
                f"http: {quote(_host_port(MONITOR_HOST, node.monitor_port))}",
                *cluster,
                *extra,
            ),
        )
        path = out / "nats" / f"{node.name}.conf"
        _write_private(path, render_server_config(settings).encode())
        written.append(path)
    return written


def _secrets(directory: Path, tools: Mapping[str, Tool], topology: Topology) -> list[Path]:
    values = {**SECRET_VALUES, "email_provider_db": topology.email_provider_db}
    written = []
    for name, tool in tools.items():
        if not tool.required_secrets:
            continue
        missing = [s for s in tool.required_secrets if s not in values]
        if missing:
            raise SystemExit(
                f"error: no value for secret(s) {', '.join(missing)} of {name}: this generator"
                " knows only the sample tools' secrets"
            )
        document = {s: values[s] for s in tool.required_secrets}
        path = directory / f"{name}.json"
        _write_private(path, (json.dumps(document, indent=2) + "\n").encode())
        written.append(path)
    return written


def _pgpass_field(value: str) -> str:
    """One field of a pgpass line: `:` and `\\` escaped, as libpq reads them."""
    return value.replace("\\", "\\\\").replace(":", "\\:")


def _sql_identifier(value: str) -> str:
    return '"' + value.replace('"', '""') + '"'


def _postgres(out: Path, database: Database) -> list[Path]:
    password_path = out / "postgres" / "password"
    password = _kept_password(password_path)
    pgpass = out / "postgres" / "pgpass"
    fields = (database.host, str(database.port), database.name, database.user, password)
    _write_private(pgpass, (":".join(_pgpass_field(f) for f in fields) + "\n").encode())
    # The role the pgpass line names must exist: compose's postgres service creates
    # it from POSTGRES_USER; on a server of your own, this file does (once).
    role, name = _sql_identifier(database.user), _sql_identifier(database.name)
    literal = "'" + password.replace("'", "''") + "'"
    sql = out / "postgres" / "create-role.sql"
    _write_private(
        sql,
        (
            "-- Generated by deploy/generate.py. Run once, as a PostgreSQL superuser, for\n"
            "-- the plain-process topology (compose's postgres service creates the role\n"
            "-- itself): psql -v ON_ERROR_STOP=1 -U postgres -f create-role.sql\n"
            f"CREATE ROLE {role} LOGIN PASSWORD {literal};\n"
            f"CREATE DATABASE {name} OWNER {role};\n"
        ).encode(),
    )
    return [password_path, pgpass, sql]


def _prometheus(out: Path, tools: Sequence[str], topology: Topology) -> Path:
    executors = topology.executor_metrics
    if executors is None:
        executors = tuple(f"{executor_service(t)}:{EXECUTOR_METRICS_PORT}" for t in tools)
    config = {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "scrape_configs": [
            {
                "job_name": "opledger-ledger",
                "static_configs": [
                    {"targets": [_target(t, "--ledger-metrics") for t in topology.ledger_metrics]}
                ],
            },
            {
                "job_name": "opledger-executors",
                "static_configs": [
                    {"targets": [_target(t, "--executor-metrics") for t in executors]}
                ],
            },
        ],
    }
    path = out / "prometheus" / "prometheus.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Generated by deploy/generate.py: regenerate rather than edit.\n"
    # Prometheus runs as `nobody` and names no secret: readable by all.
    path.write_text(header + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    path.chmod(0o644)
    return path


def _grafana(out: Path) -> Path:
    # Grafana reads it only when its database is first created (then it lives there):
    # kept, like the PostgreSQL password. Grafana runs as the generator's user.
    path = out / "grafana" / "admin-password"
    _kept_password(path)
    return path


def _web(out: Path) -> list[Path]:
    # The approval page's token issuer when no identity provider is configured:
    # the same key pair `opledger --home OUT web token` signs with. Created once,
    # kept afterwards, so tokens already handed out stay valid.
    signer = LocalSigner(out / "web")
    signer.public_key_pem()
    return [signer.private_path, signer.public_path]


def generate(
    directory: Path | str,
    *,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    auditors: Sequence[str] = DEFAULT_AUDITORS,
    approvers: Sequence[str] = DEFAULT_APPROVERS,
    topology: Topology | None = None,
) -> Generated:
    """Write every file `docker-compose.yml` mounts (and the seeds used outside it),
    or with a `topology`, the same set for plain processes on hosts.

    `ValueError` for a topology that cannot work (`Topology.check`), before anything
    is written.
    """
    topology = topology or Topology()
    topology.check()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    creds_dir = topology.creds_dir or out / "creds"
    secrets_dir = topology.secrets_dir or out / "secrets"
    tools = {name: load_tool(spec) for name, spec in SAMPLE_TOOLS.items()}
    # First: they refuse an unusable password file before any rotation.
    postgres = _postgres(out, topology.database)
    grafana = _grafana(out)
    credentials = generate_credentials(
        creds_dir, hosts=hosts, tools=list(tools), auditors=auditors, approvers=approvers
    )
    written = [identity.seed_path for identity in credentials.identities]
    written.append(creds_dir / "identities.json")
    system_key = None
    if topology.system_user is not None:
        system_path, system_key = _system_user(creds_dir, topology.system_user)
        written.append(system_path)
    written += _nats_configs(out, credentials, topology, system_key)
    written += _secrets(secrets_dir, tools, topology)
    written += postgres
    written.append(_prometheus(out, list(tools), topology))
    written.append(grafana)
    written += _web(out)
    return Generated(
        directory=out,
        credentials=credentials,
        files=tuple(
            path.relative_to(out) if path.is_relative_to(out) else path for path in written
        ),
        topology=topology,
    )


def _names(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (every option with its default in `--help`)."""
    parser = argparse.ArgumentParser(
        prog="python deploy/generate.py",
        description="Generate the NATS, PostgreSQL, Prometheus and Grafana configuration and"
        " the credentials of the production topology: for docker-compose.yml by default, for"
        " plain processes on hosts with the options below (docs/operations.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR", help="e.g. deploy/generated")
    identities = parser.add_argument_group("identities")
    identities.add_argument(
        "--hosts",
        default=",".join(DEFAULT_HOSTS),
        help="agent host identities, comma-separated (default: %(default)s)",
    )
    identities.add_argument(
        "--auditors",
        default=",".join(DEFAULT_AUDITORS),
        help="auditor identities, comma-separated (default: %(default)s)",
    )
    identities.add_argument(
        "--approvers",
        default=",".join(DEFAULT_APPROVERS),
        help="approver identities, comma-separated; their roles are the ledger's --approver"
        " (default: %(default)s)",
    )
    identities.add_argument(
        "--system-user",
        metavar="NAME",
        help="also generate a user of the system account SYS (seed creds/system-NAME.nk), for"
        " `nats server report jetstream` and other server-wide reports (default: none)",
    )
    nats = parser.add_argument_group("nats-server")
    nats.add_argument(
        "--nats-node",
        dest="nats_nodes",
        action="append",
        default=[],
        metavar="NAME=HOST[:CLIENT_PORT[:CLUSTER_PORT[:MONITOR_PORT]]]",
        help="a cluster node (repeatable; the set replaces the default): its name (server_name,"
        " nats/NAME.conf), the host or address the other nodes and the clients reach it at, and"
        f" its ports, default {CLIENT_PORT}:{CLUSTER_PORT}:{MONITOR_PORT}; nodes on one host"
        " need distinct ports (default: "
        + " ".join(f"{n}={n}:{CLIENT_PORT}:{CLUSTER_PORT}:{MONITOR_PORT}" for n in NATS_NODES)
        + ", the compose services)",
    )
    nats.add_argument(
        "--nats-listen",
        default=NATS_LISTEN,
        metavar="ADDRESS",
        help="the address every node's client and cluster listeners bind; the monitor always"
        f" binds {MONITOR_HOST} (default: %(default)s)",
    )
    nats.add_argument(
        "--jetstream-dir",
        default=JETSTREAM_STORE_DIR,
        metavar="PATH",
        help="each node's JetStream store, absolute; {node} is replaced by the node's name,"
        " which nodes sharing a host need (default: %(default)s, on each container's volume)",
    )
    paths = parser.add_argument_group("files and paths")
    paths.add_argument(
        "--creds-dir",
        type=Path,
        metavar="DIR",
        help="where the NKey seeds and identities.json are written (default: OUTPUT_DIR/creds)",
    )
    paths.add_argument(
        "--secrets-dir",
        type=Path,
        metavar="DIR",
        help="where the executors' secrets files are written (default: OUTPUT_DIR/secrets)",
    )
    paths.add_argument(
        "--email-provider-db",
        default=EMAIL_PROVIDER_DB,
        metavar="PATH",
        help="the sample e-mail provider's SQLite file as its executor sees it, absolute"
        " (default: %(default)s, on the executor's volume)",
    )
    paths.add_argument(
        "--database-url",
        default=DATABASE_URL,
        metavar="DSN",
        help="the ledger's PostgreSQL DSN without a password: the pgpass line and"
        " create-role.sql are for its role and database (default: %(default)s)",
    )
    metrics = parser.add_argument_group("prometheus")
    metrics.add_argument(
        "--ledger-metrics",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a ledger service's metrics endpoint (repeatable; the set replaces the default;"
        " default: " + " ".join(f"{s}:{LEDGER_METRICS_PORT}" for s in LEDGER_SERVICES) + ")",
    )
    metrics.add_argument(
        "--executor-metrics",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="an executor's metrics endpoint (repeatable; the set replaces the default;"
        f" default: executor-<tool>:{EXECUTOR_METRICS_PORT} for every sample tool)",
    )
    return parser


def topology_from(args: argparse.Namespace) -> Topology:
    """The `Topology` the parsed command line asks for (`ValueError` for a bad option)."""
    default = Topology()
    return Topology(
        nats_nodes=tuple(NatsNode.parse(spec) for spec in args.nats_nodes) or default.nats_nodes,
        nats_listen=args.nats_listen,
        jetstream_dir=args.jetstream_dir,
        creds_dir=args.creds_dir,
        secrets_dir=args.secrets_dir,
        email_provider_db=args.email_provider_db,
        database_url=args.database_url,
        ledger_metrics=tuple(args.ledger_metrics) or default.ledger_metrics,
        executor_metrics=tuple(args.executor_metrics) or None,
        system_user=args.system_user,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; prints every file written. A bad option: one line, exit 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        generated = generate(
            args.output_dir,
            hosts=_names(args.hosts),
            auditors=_names(args.auditors),
            approvers=_names(args.approvers),
            topology=topology_from(args),
        )
    except ValueError as error:
        parser.error(str(error))
    for path in generated.files:
        print(generated.directory / path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
