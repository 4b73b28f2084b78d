"""Every benchmark in `bench/` runs and prints its figures (tiny sizes: this checks
that they work and what they print, never how fast anything is)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)  # the e2e bench alone may take a minute on a busy machine

REPO = Path(__file__).resolve().parent.parent
NUMBER = r"\d[\d,]*(?:\.\d+)?"


def _bench(script: str, *args: str, timeout_s: float = 240) -> str:
    """Run a benchmark in a process group of its own: whatever it started (nats-server,
    the service, executors) goes with it if it fails or runs out of time."""
    bench = subprocess.Popen(
        [sys.executable, f"bench/{script}", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        out, err = bench.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(bench.pid, signal.SIGKILL)
        out, err = bench.communicate()  # what it printed, for the failure's message
        printed = f"{out[-3000:]}{err[-3000:]}"
        raise AssertionError(f"{script} ran past {timeout_s:g} s:\n{printed}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)
        bench.wait()
    assert bench.returncode == 0, out[-3000:] + err[-3000:]
    return out


def _figures(text: str, label: str) -> list[float]:
    """The numbers on the lines that start with `label` (after indentation)."""
    lines = [line for line in text.splitlines() if line.strip().startswith(label)]
    assert lines, f"no {label!r} line in:\n{text[-2000:]}"
    return [float(n.replace(",", "")) for line in lines for n in re.findall(NUMBER, line)]


def test_check_bench_prints_each_case_and_the_ratio() -> None:
    out = _bench("check_bench.py", "--rounds", "1", "--n", "50")
    for case in ("check: valid proposal (object arguments)", "check: invalid proposal"):
        assert all(n > 0 for n in _figures(out, case))
    assert re.search(r"target < 100 µs for a valid proposal: (met|MISSED)", out)


@pytest.mark.usefixtures("postgres_storage")  # skips (or fails under CI) without PostgreSQL
def test_ledger_bench_prints_both_backends() -> None:
    out = _bench("ledger_bench.py", "--ops", "40", "--batch", "10")
    for backend in ("SQLite", "PostgreSQL"):
        assert f"{backend}: 40 operations in batches of 10" in out
    for figure in ("baseline, bare recorder", "full happy path", "verify in one process",
                   "aggregate replay"):
        assert len(_figures(out, figure)) >= 2


@pytest.mark.nats
@pytest.mark.usefixtures("postgres_storage")
def test_e2e_bench_prints_the_ledger_beside_the_raw_round_trip() -> None:
    out = _bench(
        "e2e_bench.py", "--ops", "60", "--warmup", "10", "--rate", "20", "--duration", "1",
        "--storage", "sqlite,postgres", "--executors", "1", "--batch", "4",
        "--host-modes", "watch",
    )
    summary = out.split("=== summary")[-1]
    for storage in ("sqlite", "postgres"):
        (line,) = [s for s in summary.splitlines() if s.strip().startswith(storage)]
        assert re.search(rf"watch:\s+{NUMBER} ops/s \(raw\s+{NUMBER}, ratio {NUMBER}\)", line)
    assert "CPU ms/op, ledger/watch throughput" in out
    assert "latency by stage p50/p99 ms, ledger/watch @20/s" in out
    # Issue 15's targets, each storage its own.
    assert re.search(r"target ledger/watch >= 1,500 ops/s: (met|MISSED)", out)
    assert re.search(r"target ledger/watch >= 1,000 ops/s: (met|MISSED)", out)


@pytest.mark.nats
def test_e2e_bench_ab_runs_both_sides_interleaved_and_prints_their_medians() -> None:
    out = _bench(
        "e2e_bench.py", "--ops", "40", "--warmup", "10", "--rate", "200", "--duration", "1",
        "--storage", "sqlite", "--executors", "1", "--batch", "4", "--host-modes", "watch",
        "--ab", "gc-pauses", "--ab-executors", "gc-pauses", "--pairs", "2",
    )
    assert re.search(rf"target ledger/watch >= 1,500 ops/s: (met|MISSED) \({NUMBER}\); p99 <="
                     rf" 10 ms at 200/s: (met|MISSED) \({NUMBER} ms\); p50 <= 3x raw at 200/s",
                     out)
    assert re.findall(r"^--- ([AB]) ", out, re.MULTILINE) == ["A", "B", "B", "A"]
    table = out.split("=== A/B")[1].split("=== summary")[0]
    assert "B adds gc-pauses (executors: gc-pauses); runs in the order A B B A" in table
    for row in ("raw JetStream ops/s", "watch ops/s", "watch p99 ms at 200/s",
                "watch service CPU ms/op, throughput"):
        (line,) = [s for s in table.splitlines() if s.strip().startswith(row)]
        assert re.search(rf"A +{NUMBER} +{NUMBER} \| B +{NUMBER} +{NUMBER} \| median B/A"
                         rf" {NUMBER}", line), line
    # B ran with the patches (its service and its executors), A without.
    summary = out.split("=== summary")[-1]
    assert sum("service-patches=gc-pauses executor-patches=gc-pauses" in s
               for s in summary.splitlines()) == 2
    assert sum("gc-pauses" not in s for s in summary.splitlines() if "watch:" in s) == 2


@pytest.mark.nats
def test_mcp_bench_prints_direct_and_through_the_ledger() -> None:
    out = _bench("mcp_bench.py", "--calls", "20", "--warmup", "5")
    assert _figures(out, "direct") and _figures(out, "ledger")
    assert re.search(rf"ratio of medians ledger/direct = {NUMBER}x", out)


@pytest.mark.nats
def test_plan_bench_prints_plans_beside_single_operations() -> None:
    out = _bench("plan_bench.py", "--rounds", "1")
    assert _figures(out, "plan fan") and _figures(out, "singles concurrent")
    assert re.search(rf"ratio plan fan / singles concurrent:\s+{NUMBER}", out)
