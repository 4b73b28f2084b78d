"""Without a reachable PostgreSQL, its tests skip and say why; with
`OPLEDGER_REQUIRE_POSTGRES=1` (as `.ci/run` sets it) the same tests fail instead.
Run in a pytest of its own, pointed at a port where nothing listens."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
A_POSTGRES_TEST = (
    "tests/ledger/test_lost_answers.py::test_only_the_exact_events_sent_count_as_stored"
)


def _pytest(require: str | None) -> subprocess.CompletedProcess[str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("OPLEDGER_", "PYTEST_XDIST"))
    }
    if require is not None:
        env["OPLEDGER_REQUIRE_POSTGRES"] = require
    # A port bound here and never listened on, for the whole run: nothing else can take
    # it, and a connection to it is refused.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        env["OPLEDGER_TEST_POSTGRES_DSN"] = f"postgresql://postgres@127.0.0.1:{port}/test"
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider",
             A_POSTGRES_TEST],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )


@pytest.mark.parametrize("require", [None, "0", "false"])
def test_without_postgres_its_tests_skip_and_say_why(require: str | None) -> None:
    run = _pytest(require)
    assert run.returncode == 0, run.stdout[-2000:]
    assert "1 skipped" in run.stdout
    assert "SKIPPED" in run.stdout and "PostgreSQL not reachable at" in run.stdout


def test_when_postgres_is_required_its_absence_fails_the_run() -> None:
    run = _pytest("1")
    assert run.returncode == 1, run.stdout[-2000:]
    assert "1 error" in run.stdout  # failed in its fixture, before the test ran
    assert "OPLEDGER_REQUIRE_POSTGRES is set but PostgreSQL not reachable" in run.stdout
