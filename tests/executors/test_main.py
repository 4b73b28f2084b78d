"""Secrets loading, connect options, tool loading and the `python -m executors` entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from executors import (
    SecretsError,
    Tool,
    build_connect_options,
    load_contract,
    load_secrets,
    load_tool,
    run_executor_main,
)
from executors._main import build_parser
from executors.samples.email import send_customer_email
from policy.catalog import CATALOG_DIR

ROOT = Path(__file__).resolve().parents[2]


def test_secrets_from_a_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "secrets.json"
    path.write_text(json.dumps({"Email_Provider_DB": "/from/file", "api_key": "file-key"}))
    environ = {
        "OPLEDGER_SECRET_API_KEY": "env-key",
        "OPLEDGER_SECRET_": "ignored: no name",
        "OPLEDGER_HOME": "not a secret",
        "PATH": "/usr/bin",
    }
    secrets = load_secrets(path, environ)
    # The environment wins over the file; names are lower case.
    assert dict(secrets) == {"email_provider_db": "/from/file", "api_key": "env-key"}
    with pytest.raises(TypeError):
        secrets["x"] = "y"  # type: ignore[index]


def test_no_secrets_at_all(tmp_path: Path) -> None:
    assert dict(load_secrets(None, {})) == {}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"db": "hunter2-is-secret", ', "not valid JSON"),
        ('["a"]', "JSON object"),
        ('{"db": 5}', "must be a string"),
        ('{"bad name!": "x"}', "must match"),
    ],
)
def test_bad_secrets_files_are_refused_without_echoing_values(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "secrets.json"
    path.write_text(content)
    with pytest.raises(SecretsError, match=message) as caught:
        load_secrets(path, {})
    assert "hunter2" not in str(caught.value)


def test_a_missing_secrets_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SecretsError, match="cannot read"):
        load_secrets(tmp_path / "absent.json", {})


def test_connect_options_use_the_seed_and_a_private_inbox(tmp_path: Path) -> None:
    options = build_connect_options(
        nats_url="nats://a:4222, nats://b:4222",
        tool_name="send_customer_email",
        executor="email-1",
        creds=tmp_path / "exec_send_customer_email.nk",
    )
    assert options == {
        "servers": ["nats://a:4222", "nats://b:4222"],
        "name": "email-1",
        "inbox_prefix": "_INBOX_exec_send_customer_email",
        "nkeys_seed": str(tmp_path / "exec_send_customer_email.nk"),
    }
    jwt = build_connect_options(
        nats_url="nats://a:4222", tool_name="query_orders", executor="q", creds=Path("u.creds")
    )
    assert jwt["user_credentials"] == "u.creds"
    assert "nkeys_seed" not in jwt


def test_tools_are_loaded_by_module_and_attribute() -> None:
    assert load_tool("executors.samples.email:send_customer_email") is send_customer_email
    for bad in ("executors.samples.email", "executors.samples.email:count_sends"):
        with pytest.raises(ValueError, match=r"MODULE:TOOL|not an executors\.Tool"):
            load_tool(bad)
    with pytest.raises(ImportError):
        load_tool("executors.no_such_module:x")
    assert isinstance(load_tool("executors.samples.orders:query_orders"), Tool)


def test_contracts_are_pinned_by_version() -> None:
    assert load_contract(CATALOG_DIR, "query_orders", "1.3.0").version == "1.3.0"
    assert load_contract(CATALOG_DIR, "query_orders").version == "1.3.0"
    with pytest.raises(ValueError, match="not in"):
        load_contract(CATALOG_DIR, "query_orders", "9.0.0")
    with pytest.raises(ValueError, match="no contract"):
        load_contract(CATALOG_DIR, "no_such_tool")


def test_the_command_line_parses_the_documented_options() -> None:
    args = build_parser().parse_args(
        [
            "run",
            "executors.samples.email:send_customer_email",
            "--creds",
            "seed.nk",
            "--nats-url",
            "nats://127.0.0.1:4222",
            "--contracts",
            "policy/catalog",
            "--secrets",
            "s.json",
            "--name",
            "email-1",
            "--metrics-port",
            "9301",
        ]
    )
    assert args.tool == "executors.samples.email:send_customer_email"
    assert args.creds == Path("seed.nk")
    assert args.metrics_port == 9301
    assert args.secrets == Path("s.json")


def test_configuration_errors_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPLEDGER_SECRET_EMAIL_PROVIDER_DB", raising=False)
    base = ["--nats-url", "nats://127.0.0.1:1", "--contracts", str(CATALOG_DIR)]
    # The e-mail executor will not start without its provider secret.
    code = run_executor_main(["run", "executors.samples.email:send_customer_email", *base])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ")
    assert "email_provider_db" in err
    assert "Traceback" not in err
    assert run_executor_main(["run", "executors.nope:x", *base]) == 2
    contracts = tmp_path / "empty"
    contracts.mkdir()
    assert (
        run_executor_main(
            [
                "run",
                "executors.samples.orders:query_orders",
                "--nats-url",
                "nats://x:1",
                "--contracts",
                str(contracts),
            ]
        )
        == 2
    )


def test_python_dash_m_executors_runs_the_entry_point() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "executors",
            "run",
            "executors.nope:x",
            "--nats-url",
            "nats://x:1",
            "--contracts",
            str(CATALOG_DIR),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: ")
