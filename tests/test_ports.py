"""The tests' own port picker: its own share per worker, outside the kernel's range."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests import ports

REPO = Path(__file__).resolve().parent.parent


def _kernels_first_port() -> int:
    """Where the kernel's own choice of ports starts, read here, not from the helper."""
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_each_worker_has_its_own_ports_below_the_kernels_range() -> None:
    shares = [ports.port_range(name) for name in ("", "gw0", "gw1", "gw2", "gw6")]
    kernel = _kernels_first_port()
    for share in shares:
        assert len(share) >= 100  # however low the kernel's range starts
        if kernel >= 10_800:  # room below the kernel's range for every share
            assert share.stop <= kernel
    for i, one in enumerate(shares):
        for other in shares[i + 1 :]:
            assert set(one).isdisjoint(other)


def test_a_port_is_not_given_twice_in_a_row_and_a_held_one_is_skipped() -> None:
    first = ports.free_port()
    assert first in ports.port_range()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first + 1))
        holder.listen()
        second = ports.free_port()
    assert second not in (first, first + 1)
    assert second in ports.port_range()


def test_two_processes_of_the_same_worker_name_start_apart() -> None:
    """Two test sessions on one machine have workers of the same names: each process
    walks its share from a place of its own, so their first ports differ."""

    def first_port() -> int:
        done = subprocess.run(
            [sys.executable, "-c", "from tests.ports import free_port; print(free_port())"],
            cwd=REPO, env={**os.environ, "PYTEST_XDIST_WORKER": "gw0"},
            capture_output=True, text=True, timeout=60, check=True,
        )
        return int(done.stdout)

    one, other = first_port(), first_port()
    assert one != other
    assert {one, other} <= set(ports.port_range("gw0"))
