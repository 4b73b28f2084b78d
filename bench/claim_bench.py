"""What a claim on the broker would cost: PubAck round trips of a compare-and-set publish.

`docs/dispatch-leases.md` weighs granting the first lease at dispatch, with the
executor's claim made as a JetStream publish that only the first writer of a subject
wins (`Nats-Expected-Last-Subject-Sequence: 0`). A claim must survive a host's crash,
which JetStream guarantees only with `sync_interval: always` (a server setting) or a
replicated stream. This prints, for a fresh single server with the default sync and
with `always`, the p50 / p99 PubAck round trip of a plain publish and of a claim on a
fresh subject, one at a time, each measured twice in turns:

    python bench/claim_bench.py [--count 2000] [--size 200]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import nats

from ledger.nats.supervisor import find_nats_server, free_port

__all__ = ["main"]


async def _round_trips(url: str, count: int, size: int) -> dict[str, list[tuple[float, float]]]:
    """(p50, p99) ms per kind and round: plain publishes and claims, in turns."""
    client = await nats.connect(url, allow_reconnect=False)
    stream = client.jetstream()
    await stream.add_stream(name="CLAIMS", subjects=["claims.>"], storage="file")
    await stream.add_stream(name="PLAIN", subjects=["plain.>"], storage="file")
    body = b"x" * size
    figures: dict[str, list[tuple[float, float]]] = {}
    for round_ in range(2):
        for kind in ("plain", "claim"):
            took = []
            for index in range(count):
                started = time.perf_counter()
                if kind == "claim":
                    await stream.publish(
                        f"claims.noop.op-{round_}-{index}.1",
                        body,
                        headers={"Nats-Expected-Last-Subject-Sequence": "0"},
                    )
                else:
                    await stream.publish("plain.noop", body)
                took.append((time.perf_counter() - started) * 1000)
            took.sort()
            figures.setdefault(kind, []).append(
                (took[len(took) // 2], took[min(len(took) - 1, int(len(took) * 0.99))])
            )
    await client.close()
    return figures


def _wait_listening(port: int, timeout_s: float = 10.0) -> None:
    # Before the client connects: nats-py prints every refused attempt as a traceback.
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _measure(sync_always: bool, count: int, size: int) -> dict[str, list[tuple[float, float]]]:
    home = Path(tempfile.mkdtemp(prefix="opledger-claim-bench-"))
    port = free_port()
    sync = "\n  sync_interval: always" if sync_always else ""
    config = home / "nats-server.conf"
    config.write_text(
        f'listen: "127.0.0.1:{port}"\njetstream {{\n  store_dir: "{home / "js"}"{sync}\n}}\n'
    )
    server = subprocess.Popen(
        [str(find_nats_server()), "-c", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(port)
        return asyncio.run(_round_trips(f"nats://127.0.0.1:{port}", count, size))
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    """Print both settings' figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000, help="publishes per kind and round")
    parser.add_argument("--size", type=int, default=200, help="bytes per message")
    args = parser.parse_args()
    for sync_always in (False, True):
        figures = _measure(sync_always, args.count, args.size)
        setting = "always" if sync_always else "default"
        for kind, rounds in figures.items():
            shown = ", ".join(f"{p50:.3f}/{p99:.3f}" for p50, p99 in rounds)
            print(f"sync_interval {setting:<7} {kind:<5} PubAck p50/p99 ms per round: {shown}")


if __name__ == "__main__":
    main()
