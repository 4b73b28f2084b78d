"""Generate the configuration `docker-compose.yml` mounts: `python deploy/generate.py OUTPUT_DIR`.

    python deploy/generate.py deploy/generated

writes, under OUTPUT_DIR (the compose file expects `deploy/generated`):

    creds/ledger-ledger.nk          the ledger services' NKey seed (both instances)
    creds/exec-<tool>.nk            one seed per tool, mounted into that tool's executor only
    creds/host-<host>.nk            agent hosts' seeds (used outside compose)
    creds/auditor-<auditor>.nk      auditors' seeds (used outside compose)
    creds/identities.json           role, name and public key of every identity (no secrets)
    nats/nats-1.conf .. nats-3.conf one nats-server config per cluster node: JetStream,
                                    routes to the other two nodes by compose service name
                                    (authenticated with a generated route password),
                                    monitoring on 127.0.0.1 only, and the accounts
                                    block of the generated identities
    secrets/<tool>.json             an executor's own secrets, for tools that need any
    postgres/password               the PostgreSQL password (kept when it already exists)
    postgres/pgpass                 the same password in libpq's password-file format
    prometheus/prometheus.yml       scrape targets: both ledger services and every executor

Seeds, secrets, passwords and the nats configs are written with mode 0600 (the
seed directory 0700). Running the generator again rotates every NKey and the
route password and rewrites the nats configs; the PostgreSQL password is kept,
because the database only reads it when its data directory is first initialised.

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
import secrets
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Run from a checkout (`python deploy/generate.py`), the script's own directory is
# first on sys.path, not the repository: make the checkout's packages importable,
# the same code the Docker image is built from.
_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

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

__all__ = [
    "CLIENT_PORT",
    "CLUSTER_NAME",
    "CLUSTER_PORT",
    "DATABASE_HOST",
    "DATABASE_NAME",
    "DATABASE_USER",
    "DEFAULT_APPROVERS",
    "DEFAULT_AUDITORS",
    "DEFAULT_HOSTS",
    "EXECUTOR_METRICS_PORT",
    "JETSTREAM_STORE_DIR",
    "LEDGER_METRICS_PORT",
    "LEDGER_SERVICES",
    "MONITOR_PORT",
    "NATS_NODES",
    "ROUTE_USER",
    "SECRET_VALUES",
    "Generated",
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
"""On 127.0.0.1 only: `/healthz` (JetStream ready, a meta leader known) is the health check."""
ROUTE_USER = "route"
"""The user nodes authenticate as on each other's cluster port (password generated)."""
JETSTREAM_STORE_DIR = "/data/jetstream"
"""Inside the nats container; a named volume per node is mounted at `/data`."""

LEDGER_SERVICES: tuple[str, ...] = ("ledger-1", "ledger-2")
LEDGER_METRICS_PORT = 9400
EXECUTOR_METRICS_PORT = 9300

DATABASE_HOST = "postgres"
DATABASE_PORT = 5432
DATABASE_NAME = "opledger"
DATABASE_USER = "opledger"

DEFAULT_HOSTS: tuple[str, ...] = ("agent",)
DEFAULT_AUDITORS: tuple[str, ...] = ("auditor",)
DEFAULT_APPROVERS: tuple[str, ...] = ("lead",)
"""Approver identities; the roles they hold are the ledger service's `--approver`
flags in docker-compose.yml (`lead`: `support_lead`), not part of any seed."""

SECRET_VALUES: Mapping[str, str] = {
    # The sample e-mail executor's fake provider: a SQLite file on the executor's
    # own volume. It is a path, not a credential: a real tool's API keys do not
    # belong in this script, but in its secrets file or in OPLEDGER_SECRET_<NAME>
    # variables of its executor service only.
    "email_provider_db": "/var/lib/opledger/email/provider.db",
}
"""Values of the secrets the sample tools declare (`Tool.required_secrets`)."""


def executor_service(tool: str) -> str:
    """The compose service (and host name) of `tool`'s executor: `executor-send-customer-email`.

    Hyphens, not underscores: the name is a DNS host name in Prometheus targets.
    """
    return "executor-" + tool.replace("_", "-")


@dataclass(frozen=True)
class Generated:
    """What one run wrote."""

    directory: Path
    credentials: CredentialSet
    files: tuple[Path, ...]
    """Every file written, relative to `directory`."""


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


def _cluster_block(node: str, route_password: str) -> list[str]:
    """The `cluster { ... }` block of `node`: routes to the other nodes by service name.

    Written here rather than through `ClusterOptions`, which cannot express
    route authorization: without it any container on the NATS network (an
    executor, say) could connect to port 6222 as a route, and messages that
    arrive over a route are not subject to any user's permissions.
    """
    routes = [
        f"nats-route://{ROUTE_USER}:{route_password}@{peer}:{CLUSTER_PORT}"
        for peer in NATS_NODES
        if peer != node
    ]
    return [
        "cluster {",
        f"  name: {quote(CLUSTER_NAME)}",
        f"  listen: {quote(f'0.0.0.0:{CLUSTER_PORT}')}",
        "  authorization {",
        f"    user: {quote(ROUTE_USER)}",
        f"    password: {quote(route_password)}",
        "  }",
        "  routes: [",
        *(f"    {quote(route)}" for route in routes),
        "  ]",
        "}",
    ]


def _nats_configs(out: Path, credentials: CredentialSet) -> list[Path]:
    # One route password per generation, shared by the three nodes; URL-safe.
    route_password = secrets.token_urlsafe(32)
    written = []
    for node in NATS_NODES:
        settings = ServerSettings(
            server_name=node,
            port=CLIENT_PORT,
            host="0.0.0.0",
            store_dir=Path(JETSTREAM_STORE_DIR),
            authorization=credentials.authorization_config,
            extra_lines=(
                # Monitoring inside the container only: the health check asks
                # /healthz there, and /connz or /subsz are nobody else's business.
                f"http: {quote(f'127.0.0.1:{MONITOR_PORT}')}",
                *_cluster_block(node, route_password),
            ),
        )
        path = out / "nats" / f"{node}.conf"
        _write_private(path, render_server_config(settings).encode())
        written.append(path)
    return written


def _secrets(out: Path, tools: Mapping[str, Tool]) -> list[Path]:
    written = []
    for name, tool in tools.items():
        if not tool.required_secrets:
            continue
        missing = [s for s in tool.required_secrets if s not in SECRET_VALUES]
        if missing:
            raise SystemExit(
                f"error: no value for secret(s) {', '.join(missing)} of {name}: this generator"
                " knows only the sample tools' secrets"
            )
        document = {s: SECRET_VALUES[s] for s in tool.required_secrets}
        path = out / "secrets" / f"{name}.json"
        _write_private(path, (json.dumps(document, indent=2) + "\n").encode())
        written.append(path)
    return written


def _postgres(out: Path) -> list[Path]:
    password_path = out / "postgres" / "password"
    if password_path.exists():
        password = password_path.read_text(encoding="utf-8").strip()
        if not password or ":" in password or "\\" in password:
            raise SystemExit(f"error: {password_path} must hold one password without ':' or '\\'")
    else:
        # URL-safe characters only: nothing that a pgpass line would need escaped.
        password = secrets.token_urlsafe(32)
        _write_private(password_path, f"{password}\n".encode())
    pgpass = out / "postgres" / "pgpass"
    line = f"{DATABASE_HOST}:{DATABASE_PORT}:{DATABASE_NAME}:{DATABASE_USER}:{password}\n"
    _write_private(pgpass, line.encode())
    return [password_path, pgpass]


def _prometheus(out: Path, tools: Sequence[str]) -> Path:
    config = {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "scrape_configs": [
            {
                "job_name": "opledger-ledger",
                "static_configs": [
                    {"targets": [f"{s}:{LEDGER_METRICS_PORT}" for s in LEDGER_SERVICES]}
                ],
            },
            {
                "job_name": "opledger-executors",
                "static_configs": [
                    {"targets": [f"{executor_service(t)}:{EXECUTOR_METRICS_PORT}" for t in tools]}
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


def generate(
    directory: Path | str,
    *,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    auditors: Sequence[str] = DEFAULT_AUDITORS,
    approvers: Sequence[str] = DEFAULT_APPROVERS,
) -> Generated:
    """Write every file `docker-compose.yml` mounts (and the seeds used outside it)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tools = {name: load_tool(spec) for name, spec in SAMPLE_TOOLS.items()}
    postgres = _postgres(out)  # first: it refuses an unusable password file before any rotation
    credentials = generate_credentials(
        out / "creds", hosts=hosts, tools=list(tools), auditors=auditors, approvers=approvers
    )
    written = [identity.seed_path for identity in credentials.identities]
    written.append(out / "creds" / "identities.json")
    written += _nats_configs(out, credentials)
    written += _secrets(out, tools)
    written += postgres
    written.append(_prometheus(out, list(tools)))
    return Generated(
        directory=out,
        credentials=credentials,
        files=tuple(path.relative_to(out) for path in written),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; prints every file written."""
    parser = argparse.ArgumentParser(
        prog="python deploy/generate.py",
        description="Generate the NATS, PostgreSQL and Prometheus configuration and the"
        " credentials docker-compose.yml mounts.",
    )
    parser.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR", help="e.g. deploy/generated")
    parser.add_argument(
        "--hosts", default=",".join(DEFAULT_HOSTS), help="agent host identities, comma-separated"
    )
    parser.add_argument(
        "--auditors", default=",".join(DEFAULT_AUDITORS), help="auditor identities, comma-separated"
    )
    parser.add_argument(
        "--approvers",
        default=",".join(DEFAULT_APPROVERS),
        help="approver identities, comma-separated (their roles: --approver of the ledger)",
    )
    args = parser.parse_args(argv)
    generated = generate(
        args.output_dir,
        hosts=[h for h in args.hosts.split(",") if h],
        auditors=[a for a in args.auditors.split(",") if a],
        approvers=[a for a in args.approvers.split(",") if a],
    )
    for path in generated.files:
        print(generated.directory / path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
