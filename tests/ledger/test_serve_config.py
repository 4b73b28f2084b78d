"""`opledger serve` takes its configuration from flags, `OPLEDGER_*` and `opledger.toml`;
a misconfiguration is one clear line and exit code 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from ledger import StorageConfig
from ledger.config import Settings
from ledger.entrypoints.parsing import settings_from
from ledger.server.app import LedgerService, ServiceOptions
from ledger.server.gateway import LedgerGateway
from ledger.server.main import run_service_main
from schemas import ProposalEnvelope, RuntimeContext
from tests.ledger.helpers import ALICE, make_ledger, search

_OVERRIDES = ("OPLEDGER_DATABASE", "OPLEDGER_NATS_URL", "OPLEDGER_CONTRACTS_DIR",
              "OPLEDGER_HOST_TENANTS")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`OPLEDGER_HOME` in a fresh directory, with no setting inherited from the environment."""
    monkeypatch.setenv("OPLEDGER_HOME", str(tmp_path))
    for name in _OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _settings_file(home: Path, text: str) -> None:
    (home / "opledger.toml").write_text(text)


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
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    env: dict[str, str], argv: list[str], message: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert run_service_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_settings_file_supplies_what_flags_leave_unset(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _settings_file(home, 'database = "mysql://from-the-file"\n')
    assert run_service_main(["--nats-url", "nats://127.0.0.1:1"]) == 2
    assert "unknown scheme 'mysql://'" in capsys.readouterr().err


def test_a_host_name_that_is_not_a_subject_token_is_refused_in_one_line(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _settings_file(home, '[host_tenants]\n"h1.x" = ["acme"]\n')
    assert run_service_main(["--nats-url", "nats://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "INVALID_CONFIG: host_tenants names the host 'h1.x'" in err
    assert len(err.strip().splitlines()) == 1


def test_host_tenants_come_from_the_file_or_the_environment(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Settings().host_tenants is None  # unset: every host for every tenant
    _settings_file(home, '[host_tenants]\nh1 = ["acme", "globex"]\n')
    assert Settings().host_tenants == {"h1": frozenset({"acme", "globex"})}
    # Per host, the environment's list wins over the file's (the sources merge).
    monkeypatch.setenv("OPLEDGER_HOST_TENANTS", '{"h1": ["acme"], "h2": ["initech"]}')
    assert Settings().host_tenants == {"h1": frozenset({"acme"}), "h2": frozenset({"initech"})}


def test_approver_roles_come_from_the_file_and_the_flags(home: Path) -> None:
    from ledger.server.main import _approver_roles

    _settings_file(home, '[approver_roles]\nlead = ["support_lead"]\n')
    configured = Settings().approver_roles or {}
    assert configured == {"lead": frozenset({"support_lead"})}
    assert _approver_roles(configured, ["lead=finance", "fin-1=finance, audit"]) == {
        "lead": frozenset({"support_lead", "finance"}),
        "fin-1": frozenset({"finance", "audit"}),
    }


@pytest.mark.parametrize(
    ("table", "flags", "message"),
    [
        ('lead = [" support_lead "]', [], "a blank role or one with spaces"),
        ('lead = [""]', [], "a blank role or one with spaces"),
        ("lead = []", [], "gives 'lead' no role"),
        ('"a.b" = ["x"]', [], "not a valid identity name"),
        ("", ["lead"], "names no role"),
        ("", ["lead="], "names no role"),
        ("", ["a.b=x"], "not a valid identity name"),
    ],
)
def test_an_unusable_approver_role_is_refused_in_one_line(
    home: Path, capsys: pytest.CaptureFixture[str], table: str, flags: list[str], message: str
) -> None:
    _settings_file(home, f"[approver_roles]\n{table}\n")
    argv = ["--nats-url", "nats://127.0.0.1:1"]
    for flag in flags:
        argv += ["--approver", flag]
    assert run_service_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "INVALID_CONFIG" in err, err
    assert len(err.strip().splitlines()) == 1


def _plan_request(context: RuntimeContext, plan_id: str) -> bytes:
    step = {"step": "find", "operation_id": f"op-{plan_id}", "tool_name": "search_documents",
            "arguments": {"query": "refund policy"}}
    plan = {"plan_id": plan_id, "conversation_id": "c-1", "requested_by_user_id": "alice",
            "steps": [step]}
    return orjson.dumps(
        {"command": "propose", "plan": plan, "context": context.model_dump(mode="json")}
    )


@pytest.mark.anyio
async def test_the_service_refuses_a_tenant_its_host_may_not_act_for(tmp_path: Path) -> None:
    """Refused: a host with no tenants, and a host for a tenant not its own (a call and a
    plan each); nothing of theirs is stored. Its own tenant gets through."""
    ledger = make_ledger(StorageConfig.sqlite(tmp_path / "ledger.db"))
    service = LedgerService(
        ledger,
        ServiceOptions(
            nats_url="nats://127.0.0.1:1", allowed_tenants={"h1": frozenset({"acme"})}
        ),
    )
    service.gateway = LedgerGateway(ledger)
    service.gateway.start()
    globex = ALICE.model_copy(update={"tenant": "globex"})
    try:
        refused_calls = (
            ("h2", ProposalEnvelope(proposal=search("op-1"), context=ALICE)),  # tenant acme
            ("h1", ProposalEnvelope(proposal=search("op-2"), context=globex)),
        )
        for host, envelope in refused_calls:
            refused = await service._propose(envelope.model_dump_json().encode(), host)
            assert refused.error is not None, host
            assert refused.error.code == "TENANT_NOT_ALLOWED", host
        for host, context, plan_id in (("h2", ALICE, "plan-h2"), ("h1", globex, "plan-globex")):
            answer = orjson.loads(await service._on_plan(_plan_request(context, plan_id), host))
            assert answer.get("error", {}).get("code") == "TENANT_NOT_ALLOWED", (host, answer)
        body = ProposalEnvelope(proposal=search("op-1"), context=ALICE).model_dump_json()
        accepted = await service._propose(body.encode(), "h1")
        assert accepted.error is None and accepted.state == "ready"
        planned = orjson.loads(await service._on_plan(_plan_request(ALICE, "plan-acme"), "h1"))
        assert "error" not in planned, planned
        assert [row.operation_id for row in ledger.projector.rows()] == []  # not yet projected
        ledger.refresh()
        stored = {(row.host, row.tenant) for row in ledger.projector.rows()}
        assert stored == {("h1", "acme")}, stored  # only h1's, for acme, went in
    finally:
        await service.gateway.stop()
        ledger.close()


def test_serve_takes_host_tenants_from_the_settings(home: Path) -> None:
    from ledger.server import main

    _settings_file(home, '[host_tenants]\nh1 = ["acme"]\n')
    args = main.build_parser().parse_args(["--nats-url", "nats://127.0.0.1:1"])
    main._fill_from_settings(args, settings_from(args))
    assert args.host_tenants == {"h1": frozenset({"acme"})}
