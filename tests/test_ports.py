"""The tests' own port picker: its own share per worker, outside the kernel's range."""

from __future__ import annotations

import socket

from tests import ports


def test_each_worker_has_its_own_ports_below_the_kernels_range() -> None:
    shares = [ports.port_range(name) for name in ("", "gw0", "gw1", "gw2", "gw6")]
    for share in shares:
        assert len(share) >= 1000
        assert share.stop <= ports._ephemeral_floor()
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
