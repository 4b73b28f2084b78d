"""deploy/generate.py for plain processes: its options, what it writes, and the cluster it makes.

The compose defaults are checked in test_compose.py. Here the generator runs
as an operator would run it for three nats-server processes on one host
(distinct ports, a store per node, seeds and secrets outside the output
directory, a PostgreSQL of one's own), and:

- every option is in `--help` with its default, and in docs/operations.md;
- a topology that cannot work is refused in one line before anything is written;
- the generated configs pass the bundled `nats-server -t`, name distinct
  ports, route to each other and put the paths given where they belong;
- the three nodes, started as they are generated, form a cluster that takes
  the ledger's streams with three replicas, and the checks of the runbook
  "Checking R3 health after a node loss" say what it says they say;
- the role and database the pgpass line names are the ones create-role.sql
  creates (against the test PostgreSQL, skipped when there is none).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.errors
import psycopg
import pytest
import yaml

from ledger.nats import connect_as, declare_topology, find_nats_server, load_credentials
from schemas import RESULTS_STREAM, WORK_STREAM, Subjects
from tests.conftest import POSTGRES_DSN, REQUIRE_POSTGRES
from tests.deploy.generator import GENERATOR, gen
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
OPERATIONS = REPO / "docs" / "operations.md"
TOOL = "search_documents"
ADMIN_INBOX_PREFIX = "_INBOX_ledger_ledger"
"""What the runbook tells an admin client (the ledger identity) to use."""




def run_generator(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python deploy/generate.py ARGV`, as an operator runs it."""
    return subprocess.run(
        [sys.executable, str(GENERATOR), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def setting(config: str, key: str) -> str:
    """The first `key: "value"` of a nats-server config."""
    match = re.search(rf'^\s*{key}: "([^"]*)"', config, re.MULTILINE)
    assert match is not None, f"no {key} in config"
    return match.group(1)


# ---------------------------------------------------------------- the options


def test_every_option_has_its_default_in_help() -> None:
    parser = gen.build_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 13
    for action in options:
        assert action.help and "default" in action.help, action.option_strings
    shown = run_generator("--help")
    assert shown.returncode == 0
    for action in options:
        assert action.option_strings[0] in shown.stdout


def test_every_option_is_in_the_operations_doc() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    for action in gen.build_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert f"`{flag}" in text, flag


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("n1=10.0.0.11", ("n1", "10.0.0.11", 4222, 6222, 8222)),
        ("n1=db.internal:4300", ("n1", "db.internal", 4300, 6222, 8222)),
        ("n-2=127.0.0.1:4223:6223:8223", ("n-2", "127.0.0.1", 4223, 6223, 8223)),
        ("n3=[::1]:4224:6224", ("n3", "::1", 4224, 6224, 8222)),
    ],
)
def test_nats_node_specs(spec: str, expected: tuple[Any, ...]) -> None:
    node = gen.NatsNode.parse(spec)
    assert (node.name, node.host, *node.ports) == expected


def test_a_node_url_brackets_an_ipv6_address() -> None:
    assert gen.NatsNode.parse("n=[::1]:4300").client_url == "nats://[::1]:4300"
    assert gen.NatsNode.parse("n=h").client_url == "nats://h:4222"


@pytest.mark.parametrize(
    "spec", ["n1", "n1=", "=h", "n1=h:x", "n1=h:1:2:3:4", "n1=h:70000", "n1=[::1", "n1=h;4222"]
)
def test_bad_node_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="--nats-node"):
        gen.Topology(nats_nodes=(gen.NatsNode.parse(spec),)).check()


def _nodes(*specs: str) -> tuple[Any, ...]:
    return tuple(gen.NatsNode.parse(spec) for spec in specs)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # Three nodes on one host with the default ports would all bind 4222.
        ({"nats_nodes": _nodes("a=h", "b=h", "c=h")}, "distinct ports"),
        ({"nats_nodes": _nodes("a=h:1:2:3", "b=h:4:5:1")}, "distinct ports"),
        ({"nats_nodes": _nodes("a=h:1:1:3")}, "ports clash"),
        ({"nats_nodes": _nodes("a=h:1:2:3", "b=h:4:5:6")}, "share one store"),
        ({"nats_nodes": _nodes("a=h", "a=i")}, "same name"),
        ({"nats_nodes": _nodes("a.b=h")}, "not a node name"),
        ({"nats_nodes": ()}, "at least one"),
        ({"jetstream_dir": "data/{node}"}, "absolute"),
        ({"email_provider_db": "provider.db"}, "absolute"),
        ({"database_url": "mysql://opledger@db/opledger"}, "postgresql"),
        ({"database_url": "postgresql://db.internal/opledger"}, "name the role"),
        ({"database_url": "postgresql://opledger@db.internal/"}, "name the database"),
        ({"ledger_metrics": ("ledger-1",)}, "HOST:PORT"),
        ({"system_user": "a b"}, "not a name"),
    ],
)
def test_a_topology_that_cannot_work_is_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gen.Topology(**options).check()


def test_nodes_on_distinct_hosts_may_share_ports_and_a_store_path() -> None:
    gen.Topology(nats_nodes=_nodes("a=h1", "b=h2", "c=h3"), jetstream_dir="/srv/js").check()


def test_a_password_in_the_database_url_is_refused_without_echoing_it(tmp_path: Path) -> None:
    done = run_generator(
        str(tmp_path / "out"), "--database-url", "postgresql://opledger:hunter2@db/opledger"
    )
    assert done.returncode == 2
    assert "--database-url" in done.stderr and "hunter2" not in done.stderr
    # Refused before anything is written.
    assert not (tmp_path / "out").exists()


def test_a_bad_option_is_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    done = run_generator(
        str(tmp_path / "out"), "--nats-node", "a=h", "--nats-node", "b=h", "--nats-node", "c=h"
    )
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines()[-1].startswith("python deploy/generate.py: error:")
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_runbook_names_the_admin_inbox_prefix() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    runbook = text.split("### Checking R3 health after a node loss", 1)[1].split("\n## ", 1)[0]
    assert f"`{ADMIN_INBOX_PREFIX}`" in runbook
    assert "--inbox-prefix" in runbook
    for endpoint in ("/jsz?streams=1&consumers=1", "/healthz?js-enabled-only=true", "/routez"):
        assert endpoint in runbook, endpoint


# ------------------------------------------------- three processes on one host


@dataclass(frozen=True)
class Plain:
    """One generator run for three nats-server processes on 127.0.0.1."""

    out: Path
    creds: Path
    secrets: Path
    store: Path
    nodes: tuple[Any, ...]
    printed: list[str]
    database_url: str
    email_db: str
    ledger_targets: tuple[str, ...]
    executor_targets: tuple[str, ...]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Plain:
    """The generator's command line with the process-style options, on free ports."""
    root = tmp_path_factory.mktemp("plain")
    nodes = tuple(
        gen.NatsNode(name, "127.0.0.1", free_port(), free_port(), free_port())
        for name in ("n1", "n2", "n3")
    )
    ledger_targets = ("127.0.0.1:9400", "127.0.0.1:9401")
    executor_targets = tuple(f"127.0.0.1:{9300 + i}" for i in range(8))
    run = Plain(
        out=root / "etc",
        creds=root / "creds",
        secrets=root / "secrets",
        store=root / "var",
        nodes=nodes,
        printed=[],
        database_url="postgresql://opl_ledger@db.internal:5433/ledger",
        email_db="/srv/opledger/email/provider.db",
        ledger_targets=ledger_targets,
        executor_targets=executor_targets,
    )
    argv = [str(run.out)]
    for node in nodes:
        argv += ["--nats-node", f"{node.name}=127.0.0.1:" + ":".join(map(str, node.ports))]
    argv += ["--nats-listen", "127.0.0.1", "--jetstream-dir", f"{run.store}/{{node}}/jetstream"]
    argv += ["--creds-dir", str(run.creds), "--secrets-dir", str(run.secrets)]
    argv += ["--email-provider-db", run.email_db, "--database-url", run.database_url]
    argv += ["--system-user", "admin"]
    for target in ledger_targets:
        argv += ["--ledger-metrics", target]
    for target in executor_targets:
        argv += ["--executor-metrics", target]
    done = run_generator(*argv)
    assert done.returncode == 0, done.stderr
    run.printed.extend(done.stdout.splitlines())
    return run


def node_config(plain: Plain, name: str) -> str:
    return (plain.out / "nats" / f"{name}.conf").read_text(encoding="utf-8")


def test_three_nodes_on_one_host_get_distinct_ports_and_route_to_each_other(
    plain: Plain,
) -> None:
    ports: list[int] = []
    password = None
    for node in plain.nodes:
        config = node_config(plain, node.name)
        assert setting(config, "server_name") == node.name
        assert setting(config, "listen") == f"127.0.0.1:{node.client_port}"
        assert setting(config, "http") == f"127.0.0.1:{node.monitor_port}"
        cluster = config.split("cluster {", 1)[1].split("\n}", 1)[0]
        assert setting(cluster, "listen") == f"127.0.0.1:{node.cluster_port}"
        routes = re.findall(r'"nats-route://route:([^@"]+)@([^"]+)"', cluster)
        assert [address for _, address in routes] == [
            f"127.0.0.1:{peer.cluster_port}" for peer in plain.nodes if peer is not node
        ]
        passwords = {secret for secret, _ in routes} | {setting(cluster, "password")}
        assert len(passwords) == 1 and password in (None, *passwords)
        password = passwords.pop()
        ports += node.ports
    assert len(set(ports)) == 9


def test_the_paths_given_are_where_they_belong(plain: Plain) -> None:
    for node in plain.nodes:
        store = setting(node_config(plain, node.name), "store_dir")
        assert store == f"{plain.store}/{node.name}/jetstream"
    # Seeds and secrets where they were asked for, not under the output directory.
    credentials = load_credentials(plain.creds)
    assert credentials.ledger.seed_path.parent == plain.creds
    assert stat.S_IMODE(plain.creds.stat().st_mode) == 0o700
    assert not (plain.out / "creds").exists() and not (plain.out / "secrets").exists()
    secrets_file = plain.secrets / "send_customer_email.json"
    assert json.loads(secrets_file.read_text()) == {"email_provider_db": plain.email_db}
    assert stat.S_IMODE(secrets_file.stat().st_mode) == 0o600
    # Every file is printed with the path it has.
    assert str(secrets_file) in plain.printed
    assert str(credentials.ledger.seed_path) in plain.printed
    assert str(plain.out / "nats" / "n1.conf") in plain.printed
    for printed in plain.printed:
        assert Path(printed).is_file(), printed


def test_the_database_files_name_the_role_of_the_url(plain: Plain) -> None:
    password = (plain.out / "postgres" / "password").read_text().strip()
    pgpass = (plain.out / "postgres" / "pgpass").read_text().strip()
    assert pgpass == f"db.internal:5433:ledger:opl_ledger:{password}"
    sql = (plain.out / "postgres" / "create-role.sql").read_text()
    assert f"CREATE ROLE \"opl_ledger\" LOGIN PASSWORD '{password}';" in sql
    assert 'CREATE DATABASE "ledger" OWNER "opl_ledger";' in sql
    for name in ("password", "pgpass", "create-role.sql"):
        assert stat.S_IMODE((plain.out / "postgres" / name).stat().st_mode) == 0o600


def test_prometheus_scrapes_the_targets_given(plain: Plain) -> None:
    config = yaml.safe_load((plain.out / "prometheus" / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: [t for group in job["static_configs"] for t in group["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets == {
        "opledger-ledger": list(plain.ledger_targets),
        "opledger-executors": list(plain.executor_targets),
    }


def test_the_system_user_is_in_the_system_account(plain: Plain) -> None:
    seed = plain.creds / "system-admin.nk"
    assert stat.S_IMODE(seed.stat().st_mode) == 0o600
    assert str(seed) in plain.printed
    config = node_config(plain, "n1")
    assert setting(config, "system_account") == gen.SYSTEM_ACCOUNT
    system = config.split(f"  {gen.SYSTEM_ACCOUNT} {{", 1)[1]
    (key,) = re.findall(r'nkey: "(U[A-Z0-9]+)"', system)
    # Not one of the application identities'.
    assert key not in {i.public_key for i in load_credentials(plain.creds).identities}


def test_the_generated_configs_pass_nats_server_check(plain: Plain) -> None:
    binary = str(find_nats_server())
    for node in plain.nodes:
        checked = subprocess.run(
            [binary, "-t", "-c", str(plain.out / "nats" / f"{node.name}.conf")],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_single_node_gets_no_cluster_block(tmp_path: Path) -> None:
    done = run_generator(
        str(tmp_path),
        "--nats-node",
        f"solo=127.0.0.1:{free_port()}:{free_port()}:{free_port()}",
        "--jetstream-dir",
        str(tmp_path / "js"),
    )
    assert done.returncode == 0, done.stderr
    path = tmp_path / "nats" / "solo.conf"
    assert "cluster {" not in path.read_text()
    checked = subprocess.run(
        [str(find_nats_server()), "-t", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


# ------------------------------------------- the generated cluster, as generated


def monitor(node: Any, path: str) -> tuple[int, Any]:
    """`GET http://127.0.0.1:<monitor>/<path>`: status and parsed JSON (None if not JSON)."""
    url = f"http://127.0.0.1:{node.monitor_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def wait_for(what: str, check: Any, deadline: float) -> Any:
    """Poll `check()` until it returns something true, or fail naming `what`."""
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        # Unreachable monitors and, while the survivors elect a leader, JetStream
        # requests that time out or find none: keep asking until the deadline.
        except (TimeoutError, urllib.error.URLError, OSError, nats.errors.Error) as error:
            last = error
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"{what}: {last!r}")


def start(binary: str, plain: Plain, node: Any, logs: Path) -> subprocess.Popen[bytes]:
    with (logs / f"{node.name}.log").open("ab") as log:
        return subprocess.Popen(
            [binary, "-c", str(plain.out / "nats" / f"{node.name}.conf")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


def meta_leader_ready(plain: Plain, names: set[str]) -> bool:
    """Some node leads the meta group and sees every other node of `names` current
    (only the leader tracks its followers)."""
    for node in plain.nodes:
        if node.name not in names:
            continue
        _, jsz = monitor(node, "/jsz")
        meta = (jsz or {}).get("meta_cluster") or {}
        current = {r["name"] for r in meta.get("replicas") or [] if r.get("current")}
        if meta.get("leader") == node.name and names - {node.name} <= current:
            return True
    return False


@pytest.fixture
def processes(plain: Plain, tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The three nodes, started from their generated configs exactly as written."""
    binary = str(find_nats_server())
    running: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for node in plain.nodes:
            running[node.name] = start(binary, plain, node, tmp_path)
        deadline = time.monotonic() + 20
        for node in plain.nodes:
            wait_for(
                f"{node.name} healthy", lambda n=node: monitor(n, "/healthz")[0] == 200, deadline
            )
        names = {node.name for node in plain.nodes}
        wait_for("a meta leader", lambda: meta_leader_ready(plain, names), deadline + 20)
        yield running
    finally:
        for process in running.values():
            stop(process)


async def stream_cluster(urls: list[str], plain: Plain) -> Any:
    """`OPS_WORK`'s cluster information, asked of its leader as the ledger identity."""
    ledger = await connect_as(urls, load_credentials(plain.creds).ledger, allow_reconnect=False)
    try:
        return (await ledger.jetstream(timeout=5).stream_info(WORK_STREAM)).cluster
    finally:
        await ledger.close()


@pytest.mark.nats
def test_the_generated_nodes_form_a_cluster_that_survives_a_node_loss(
    plain: Plain, processes: dict[str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """The runbook, step by step: R3 streams, a node lost, what each check says, and
    the node back and current again."""
    credentials = load_credentials(plain.creds)
    urls = [node.client_url for node in plain.nodes]

    async def declare() -> None:
        ledger = await connect_as(urls, credentials.ledger, allow_reconnect=False)
        try:
            js = ledger.jetstream(timeout=10)
            await declare_topology(js, [TOOL], ack_wait_s=30, max_deliver=10, replicas=3)
            for stream in (WORK_STREAM, RESULTS_STREAM):
                assert (await js.stream_info(stream)).config.num_replicas == 3
        finally:
            await ledger.close()

    asyncio.run(asyncio.wait_for(declare(), timeout=30))
    cluster = asyncio.run(stream_cluster(urls, plain))
    assert cluster.leader in {n.name for n in plain.nodes}
    assert len(cluster.replicas) == 2 and all(r.current for r in cluster.replicas)
    # The node lost is the stream's leader: the survivors must elect another.
    (lost,) = [n for n in plain.nodes if n.name == cluster.leader]
    survivor, other = [n for n in plain.nodes if n is not lost]
    left = [n.client_url for n in (survivor, other)]

    # The admin client's inbox prefix: the ledger identity may subscribe to its own
    # prefix only, so a JetStream API request without it gets no answer.
    assert credentials.ledger.inbox_prefix == ADMIN_INBOX_PREFIX

    async def api(prefix: str | None) -> bool:
        options: dict[str, Any] = {"nkeys_seed": str(credentials.ledger.seed_path)}
        if prefix is not None:
            options["inbox_prefix"] = prefix

        async def quiet(error: Exception) -> None:
            pass

        nc = await nats.connect(urls, allow_reconnect=False, error_cb=quiet, **options)
        try:
            reply = await nc.request(f"$JS.API.STREAM.INFO.{WORK_STREAM}", b"", timeout=2)
            return bool(json.loads(reply.data).get("cluster"))
        except nats.errors.TimeoutError:
            return False
        finally:
            await nc.close()

    assert asyncio.run(api(ADMIN_INBOX_PREFIX)) is True
    assert asyncio.run(api(None)) is False

    # The system account's user hears from every server.
    async def jsz_servers() -> set[str]:
        nc = await nats.connect(urls, nkeys_seed=str(plain.creds / "system-admin.nk"))
        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish("$SYS.REQ.SERVER.PING.JSZ", b"{}", reply=inbox)
            names = set()
            try:
                while True:
                    names.add(json.loads((await sub.next_msg(timeout=1)).data)["server"]["name"])
            except nats.errors.TimeoutError:
                return names
        finally:
            await nc.close()

    assert asyncio.run(jsz_servers()) == {n.name for n in plain.nodes}

    # A node is lost.
    stop(processes[lost.name])
    deadline = time.monotonic() + 20
    for node in (survivor, other):
        status, _ = monitor(node, "/healthz?js-enabled-only=true")
        assert status == 200
        # Routes to the survivors only.
        peers = wait_for(
            "routes to the survivors only",
            lambda n=node: (
                {r["remote_name"] for r in monitor(n, "/routez")[1]["routes"]}
                == ({survivor.name, other.name} - {n.name})
            ),
            deadline,
        )
        assert peers

    # The stream's leader reports the lost replica offline; the other is current.
    def lost_offline() -> Any:
        cluster = asyncio.run(stream_cluster(left, plain))
        replicas = {r.name: r for r in cluster.replicas}
        return cluster if lost.name in replicas and replicas[lost.name].offline else None

    cluster = wait_for("a new leader, and the lost replica offline", lost_offline, deadline)
    assert cluster.leader in (survivor.name, other.name)
    (current,) = [r for r in cluster.replicas if r.name != lost.name]
    assert current.current and not current.offline

    # Two of three hold a quorum: the stream still takes work.
    async def publish() -> int:
        ledger = await connect_as(left, credentials.ledger, allow_reconnect=False)
        try:
            ack = await ledger.jetstream(timeout=5).publish(Subjects.work(TOOL), b"{}")
            return int(ack.seq)
        finally:
            await ledger.close()

    assert asyncio.run(publish()) >= 1
    # The same view in /jsz, from the node that leads the stream.
    (leader,) = [n for n in plain.nodes if n.name == cluster.leader]
    _, jsz = monitor(leader, "/jsz?streams=1&consumers=1")
    (stream,) = [
        s
        for account in jsz["account_details"]
        for s in account.get("stream_detail") or []
        if s["name"] == WORK_STREAM
    ]
    replicas = {r["name"]: r for r in stream["cluster"]["replicas"]}
    assert replicas[lost.name].get("offline") is True

    # The node comes back: /healthz answers 200 once its replicas are current.
    processes[lost.name] = start(str(find_nats_server()), plain, lost, tmp_path)
    deadline = time.monotonic() + 20
    wait_for("the returning node healthy", lambda: monitor(lost, "/healthz")[0] == 200, deadline)
    wait_for(
        "every replica current again",
        lambda: all(
            r.current and not r.offline for r in asyncio.run(stream_cluster(urls, plain)).replicas
        ),
        deadline,
    )


# ------------------------------------------------------ the role pgpass names


@pytest.mark.timeout(60)
def test_create_role_sql_creates_the_role_the_pgpass_line_logs_in_as(tmp_path: Path) -> None:
    try:
        admin = psycopg.connect(POSTGRES_DSN, connect_timeout=3, autocommit=True)
    except psycopg.Error as error:
        if REQUIRE_POSTGRES:
            pytest.fail(f"OPLEDGER_REQUIRE_POSTGRES is set but {error}")
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_DSN}")
    server = urlsplit(POSTGRES_DSN)
    name = f"opl_{uuid.uuid4().hex[:10]}"
    dsn = f"postgresql://{name}@{server.hostname}:{server.port or 5432}/{name}"
    done = run_generator(str(tmp_path), "--database-url", dsn)
    assert done.returncode == 0, done.stderr
    sql = (tmp_path / "postgres" / "create-role.sql").read_text()
    statements = [s.strip() for s in re.sub(r"(?m)^--[^\n]*", "", sql).split(";\n") if s.strip()]
    try:
        with admin:
            for statement in statements:
                admin.execute(statement.rstrip(";").encode())
            # libpq takes the password from the generated pgpass, as the ledger does.
            environment = {**os.environ, "PGPASSFILE": str(tmp_path / "postgres" / "pgpass")}
            probe = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import psycopg, sys\n"
                    "with psycopg.connect(sys.argv[1], connect_timeout=5) as c:\n"
                    "    print(c.execute('select current_user, current_database()').fetchone())",
                    dsn,
                ],
                capture_output=True,
                text=True,
                timeout=30,
                env=environment,
                check=False,
            )
            assert probe.returncode == 0, probe.stderr
            assert probe.stdout.strip() == repr((name, name))
    finally:
        with psycopg.connect(POSTGRES_DSN, connect_timeout=3, autocommit=True) as cleanup:
            cleanup.execute(f'DROP DATABASE IF EXISTS "{name}"'.encode())
            cleanup.execute(f'DROP ROLE IF EXISTS "{name}"'.encode())
