"""The durable-execution peer for `bench/e2e_bench.py`: DBOS Transact on the same PostgreSQL.

The same no-op as the bench's `noop` tool, as a DBOS workflow with one step, on a
fresh database of the PostgreSQL the tests use (DBOS keeps its system tables
there): sequential, then `--concurrency` in flight from a thread pool, then a
fixed `--rate` for latency. It prints one JSON line of figures, which the e2e
bench prints beside opledger's. Run in a process of its own: DBOS is a
singleton per process.

    python bench/dbos_peer.py --dsn postgresql://postgres@127.0.0.1:5432/test \\
        [--ops 2000] [--concurrency 16] [--rate 20] [--duration 5]

Needs the `bench` extra (`pip install '.[bench]'`, DBOS Transact).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

import psycopg


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _database(dsn: str) -> tuple[str, Callable[[], None]]:
    """A fresh database on the server of `dsn`, and how to drop it."""
    name = f"dbos_peer_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"'.encode())
    parts = urlsplit(dsn)
    url = urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))

    def drop() -> None:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())

    return url, drop


def _noop(n: int) -> int:
    return n


def run(dsn: str, ops: int, concurrency: int, rate: float, duration: float) -> dict[str, float]:
    """Measure the DBOS no-op workflow; its figures (ops/s, latencies in ms)."""
    from dbos import DBOS

    url, drop = _database(dsn)
    try:
        # Registered by call, not as decorators: the types of an optional extra are
        # not there for the type check when it is not installed.
        noop_step: Callable[[int], int] = DBOS.step()(_noop)

        def workflow(n: int) -> int:
            return noop_step(n)

        noop_workflow: Callable[[int], int] = DBOS.workflow()(workflow)
        DBOS(config={"name": "opledger-bench-peer", "system_database_url": url})
        DBOS.launch()
        try:
            for n in range(50):  # warm-up: connections, statements
                noop_workflow(n)
            started = time.perf_counter()
            for n in range(ops):
                noop_workflow(n)
            sequential = ops / (time.perf_counter() - started)

            started = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(noop_workflow, range(ops)))
            concurrent = ops / (time.perf_counter() - started)

            latencies: list[float] = []
            count = int(rate * duration)
            with ThreadPoolExecutor(concurrency) as pool:
                begin = time.perf_counter()

                def timed(n: int) -> None:
                    due = begin + n / rate
                    time.sleep(max(due - time.perf_counter(), 0))
                    noop_workflow(n)
                    # From the scheduled start: a stalled pool counts against it.
                    latencies.append(time.perf_counter() - due)

                list(pool.map(timed, range(count)))
        finally:
            DBOS.destroy()
    finally:
        drop()
    return {
        "sequential_ops_per_s": sequential,
        "concurrent_ops_per_s": concurrent,
        "rate": rate,
        "p50_ms": _percentile(latencies, 50) * 1000,
        "p99_ms": _percentile(latencies, 99) * 1000,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the peer phase and print its figures as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=5.0)
    args = parser.parse_args(argv)
    try:
        import dbos  # noqa: F401
    except ImportError:
        print(json.dumps({"skipped": "DBOS Transact is not installed (pip install '.[bench]')"}))
        return 0
    figures = run(args.dsn, args.ops, args.concurrency, args.rate, args.duration)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
