"""The README's tour and its short example, run as a reader would: its code blocks as
written, taken from README.md itself, in a fresh folder, through the `opledger`
command the package installs. A change to the README or to what it shows breaks this.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import interrupt, opledger_command

pytestmark = [pytest.mark.nats, pytest.mark.timeout(400)]

README = Path(__file__).resolve().parents[2] / "README.md"


def _block(language: str, holding: str, *, whole: bool = False) -> str:
    """The README's one fenced `language` block that holds `holding` (is it, `whole`)."""
    blocks = [
        body
        for lang, body in re.findall(r"```(\w+)\n(.*?)```", README.read_text(), re.S)
        if lang == language and (body.strip() == holding if whole else holding in body)
    ]
    assert len(blocks) == 1, f"{len(blocks)} {language} blocks hold {holding!r}"
    return str(blocks[0])


def _commands(block: str) -> list[list[str]]:
    """Each line of a shell block as argv, its comment dropped."""
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def _run(argv: list[str], cwd: Path) -> str:
    assert argv[0] == "opledger", argv
    done = subprocess.run(
        [*opledger_command(), *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


def test_the_short_example_prints_what_the_readme_says(tmp_path: Path) -> None:
    code = _block("python", 'StorageConfig.sqlite(".opledger/ledger.db")')
    (tmp_path / "example.py").write_text(code)
    done = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # The README's comments: `# rejected`, then `# /top_k maximum 20 50`.
    assert done.stdout.splitlines() == ["rejected", "/top_k maximum 20 50"]


def test_the_five_minute_tour_runs_as_written(tmp_path: Path) -> None:
    (up_argv,) = _commands(_block("sh", "opledger up", whole=True))
    assert up_argv == ["opledger", "up"]
    log = tmp_path / "up.log"
    with log.open("w") as out:
        up = subprocess.Popen(
            [*opledger_command(), *up_argv[1:]], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT
        )
    host: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 60
        while "Ctrl-C stops everything." not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)

        # The agent host's Python, in the same folder (it finds the stack from there).
        (tmp_path / "host.py").write_text(_block("python", 'AgentHostClient(nc, "demo")'))
        host = subprocess.Popen(
            [sys.executable, "host.py"], cwd=tmp_path, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        assert host.stdout is not None
        first = host.stdout.readline().split()
        assert first[:1] == ["awaiting_approval"], (first, host.stderr)

        # The approver's commands, with the hashes `approvals show` gives.
        approve = _commands(_block("sh", "opledger approvals approve demo/mail-1"))
        assert [argv[:3] for argv in approve] == [
            ["opledger", "approvals", "list"],
            ["opledger", "approvals", "show"],
            ["opledger", "approvals", "approve"],
        ]
        assert "demo/mail-1" in _run(approve[0], tmp_path)
        assert "send_customer_email" in _run(approve[1], tmp_path)
        shown: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while not shown.get("preview_hash"):  # the executor's preview, on its way
            assert time.monotonic() < deadline, "no preview within a minute"
            time.sleep(0.3)
            shown = json.loads(_run([*approve[1], "--json"], tmp_path))
        assert first[1] == shown["proposal_hash"]  # the hash the host was told
        hashes = iter([shown["proposal_hash"], shown["preview_hash"]])
        _run([next(hashes) if word == "<hash>" else word for word in approve[2]], tmp_path)

        # The host's `outcome()` returns once the approved e-mail was sent.
        assert host.wait(timeout=120) == 0, host.stderr.read() if host.stderr else ""
        assert host.stdout.read().split() == ["succeeded"]

        watch = _commands(_block("sh", "opledger ops show demo/mail-1"))
        shown_events = _run(watch[0], tmp_path)
        for event in ("Proposed", "Validated", "ApprovalGranted", "LeaseClaimed", "Succeeded"):
            assert event in shown_events, shown_events
        _run(watch[1], tmp_path)  # audit verify: exit 0 is a clean ledger
        _run(watch[2], tmp_path)
        exported = (tmp_path / "ledger.jsonl").read_text().splitlines()
        assert any("demo/mail-1" in line for line in exported)
    finally:
        if host is not None and host.poll() is None:
            host.kill()
        interrupt(up, timeout_s=60)
    assert up.returncode == 0, log.read_text()[-3000:]
