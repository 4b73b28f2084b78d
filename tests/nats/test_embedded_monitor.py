"""The embedded stack's nats-server listens on its client port only; the monitor is opt-in.

A behaviour test, not a config test: it starts the server exactly as
`EmbeddedStack.start` does and asks the kernel which TCP sockets that process
listens on (`/proc/net/tcp{,6}` for the listening sockets, `/proc/<pid>/fd`
for the ones that process holds).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
import urllib.request
from pathlib import Path
from typing import cast

import pytest

from ledger.embedded import EmbeddedStack
from ledger.nats import connect_as

pytestmark = pytest.mark.nats

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # IPv6: four 32-bit words, each in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """Every (address, port) process `pid` listens on, over IPv4 and IPv6."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and inode in inodes:
                address, port = local.split(":")
                found.add((_address(address), int(port, 16)))
    return found


def _jetstream_answers(stack: EmbeddedStack) -> bool:
    assert stack.server is not None and stack.credentials is not None

    async def ask() -> bool:
        # Narrowed again: the assertion above does not reach into this function.
        assert stack.server is not None and stack.credentials is not None
        nc = await connect_as(stack.server.url, stack.credentials.ledger, allow_reconnect=False)
        try:
            return (await nc.jetstream(timeout=2).account_info()) is not None
        finally:
            await nc.close()

    return asyncio.run(ask())


def _http_answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def test_the_embedded_server_has_no_http_monitor_by_default(tmp_path: Path) -> None:
    stack = EmbeddedStack(tmp_path / "home", metrics=False)
    try:
        server = stack.start_nats()
        assert server.pid is not None
        # Only the client port, on loopback: no monitor, no cluster port.
        assert listening_sockets(server.pid) == {("127.0.0.1", server.port)}
        assert not server.monitor_enabled
        # Started without /healthz, and yet ready: JetStream answers the ledger.
        assert _jetstream_answers(stack)
        assert server.monitor_url is None and stack.info().nats_monitor is None
        assert "http:" not in server.config_path.read_text()
    finally:
        stack.stop()


def test_the_monitor_opt_in_listens_on_loopback_only(tmp_path: Path) -> None:
    stack = EmbeddedStack(tmp_path / "home", metrics=False, monitor=True)
    try:
        server = stack.start_nats()
        assert server.pid is not None and server.monitor_url is not None
        monitor_port = int(server.monitor_url.rsplit(":", 1)[1])
        assert listening_sockets(server.pid) == {
            ("127.0.0.1", server.port),
            ("127.0.0.1", monitor_port),
        }
        assert _http_answers(monitor_port)
        with urllib.request.urlopen(f"{server.monitor_url}/healthz", timeout=1) as response:
            assert json.load(response)["status"] == "ok"
        assert stack.info().nats_monitor == server.monitor_url
        # Not reachable on another address of this machine (if it has one).
        others = {
            info[4][0]
            for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
            if not cast(str, info[4][0]).startswith("127.")
        }
        for address in others:
            with socket.socket() as probe:
                probe.settimeout(0.5)
                assert probe.connect_ex((address, monitor_port)) != 0
    finally:
        stack.stop()
