"""Free loopback ports for tests that choose a port now and bind it later.

`ledger.nats.free_port` asks the kernel for any free port, closes the probe and
returns the number: right for the product, whose `NatsServer` retries when the
port was taken meanwhile. A test that writes ports into a cluster's routes or a
generated configuration, or restarts a server on the same port, cannot retry,
and with two test processes (pytest-xdist) the port it was given is free for
anyone until it is bound: the other worker's next probe, or any outgoing
connection, which takes its source port from the same ephemeral range.

So the tests take their ports from a range of their own, below the kernel's
ephemeral range (where the kernel never hands out a port by itself), split
between the workers so that no two ever pick the same one, and handed out in
turn so that one process does not get the same port twice while an earlier
pick may still be waiting to be bound.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

__all__ = ["free_port", "port_range"]

_LOWEST = 10_000
"""Above the well-known and the usual service ports (PostgreSQL's 5432, NATS's 4222)."""

_SHARES = 8
"""The range is cut in this many shares: the controller's, and one per worker up to seven."""


def _ephemeral_floor() -> int:
    """Where the kernel's own choice of ports starts (32768 on Linux by default)."""
    try:
        low = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]
        return max(int(low), _LOWEST + _SHARES * 100)
    except (OSError, ValueError, IndexError):
        return 32_768


def port_range(worker: str | None = None) -> range:
    """The ports this test process chooses from: its share of `[10000, ephemeral floor)`.

    `worker` is pytest-xdist's `PYTEST_XDIST_WORKER` (`gw0`, `gw1`, ...); without
    one (a single process, or the controller) the first share.
    """
    name = os.environ.get("PYTEST_XDIST_WORKER", "") if worker is None else worker
    match = re.fullmatch(r"gw(\d+)", name)
    share = 0 if match is None else 1 + int(match.group(1)) % (_SHARES - 1)
    size = (_ephemeral_floor() - _LOWEST) // _SHARES
    start = _LOWEST + share * size
    return range(start, start + size)


def _turn_from(ports: range, offset: int) -> Iterator[int]:
    """`ports` in turn from `offset` on, round and round."""
    start = offset % len(ports)
    return itertools.cycle([*ports[start:], *ports[:start]])


# From a place of this process's own: two test sessions on one machine (two checkouts,
# two users) have workers of the same names, and would otherwise walk the same ports in
# the same order. A port another process holds is passed over, as any held port is.
_turn = _turn_from(port_range(), os.getpid() * 7919)


def free_port(host: str = "127.0.0.1") -> int:
    """A port of this process's share that nothing holds now, never the last one given."""
    for _ in range(len(port_range())):
        port = next(_turn)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue  # held by a server of this machine, or still in use
            return port
    raise RuntimeError(f"no free port in {port_range()}")
