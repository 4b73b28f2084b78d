"""`opledger serve` takes its configuration from flags, `OPLEDGER_*` and `opledger.toml`;
a misconfiguration is one clear line and exit code 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from ledger.server.main import run_service_main


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({}, [], "INVALID_CONFIG: no NATS URL: give --nats-url or set OPLEDGER_NATS_URL"),
        ({"OPLEDGER_DATABASE": "mysql://db/x"}, ["--nats-url", "nats://127.0.0.1:1"],
         "INVALID_CONFIG: database has the unknown scheme 'mysql://'"),
        ({"OPLEDGER_CONTRACTS_DIR": "/nonexistent/contracts"},
         ["--nats-url", "nats://127.0.0.1:1"], "INVALID_CONFIG"),
    ],
)
def test_misconfiguration_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    env: dict[str, str], argv: list[str], message: str,
) -> None:
    monkeypatch.setenv("OPLEDGER_HOME", str(tmp_path))
    for name in ("OPLEDGER_DATABASE", "OPLEDGER_NATS_URL", "OPLEDGER_CONTRACTS_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert run_service_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_settings_file_supplies_what_flags_leave_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPLEDGER_HOME", str(tmp_path))
    monkeypatch.delenv("OPLEDGER_NATS_URL", raising=False)
    (tmp_path / "opledger.toml").write_text('database = "mysql://from-the-file"\n')
    assert run_service_main(["--nats-url", "nats://127.0.0.1:1"]) == 2
    assert "unknown scheme 'mysql://'" in capsys.readouterr().err
