"""One `opledger` parser: every command a subcommand, one way to read the settings,
usage errors (64) told apart from refusals (2), help that says `opledger` and defaults."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger.adapters.storage import StorageConfig
from ledger.config import ConfigError, parse_database
from ledger.entrypoints import cli
from ledger.entrypoints.cli import build_parser, main
from ledger.entrypoints.parsing import EXIT_REFUSED, EXIT_USAGE, settings_from
from ledger.server import main as server_main

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_VARIABLES = (
    "OPLEDGER_HOME", "OPLEDGER_DATABASE", "OPLEDGER_POSTGRES_SCHEMA",
    "OPLEDGER_CONTRACTS_DIR", "OPLEDGER_NATS_URL", "OPLEDGER_CREDS_DIR",
)

# Every command, with the arguments it needs to parse (none of them runs here).
COMMANDS: dict[str, list[str]] = {
    "serve": ["serve", "--nats-url", "nats://127.0.0.1:1"],
    "up": ["up"],
    "demo": ["demo"],
    "creds": ["creds"],
    "executor run": ["executor", "run", "executors.samples.orders:query_orders"],
    "ops list": ["ops", "list"],
    "ops show": ["ops", "show", "op-1"],
    "approvals list": ["approvals", "list"],
    "audit verify": ["audit", "verify"],
    "audit export": ["audit", "export"],
}


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh `OPLEDGER_HOME`, with no other setting inherited from the environment."""
    for name in SETTINGS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPLEDGER_HOME", str(tmp_path))
    return tmp_path


# ------------------------------------------------------------- the database setting

DATABASES: list[tuple[str, StorageConfig | str]] = [
    ("ledger.db", StorageConfig.sqlite("ledger.db")),
    ("/srv/ledger.db", StorageConfig.sqlite("/srv/ledger.db")),
    # The first example: `serve` read this as the relative file `sqlite:/srv/ledger.db`.
    ("sqlite:///srv/ledger.db", StorageConfig.sqlite("/srv/ledger.db")),
    ("SQLite:///srv/ledger.db", StorageConfig.sqlite("/srv/ledger.db")),
    ("sqlite:relative/ledger.db", StorageConfig.sqlite("relative/ledger.db")),
    ("postgresql://ledger@db.internal/opledger",
     StorageConfig.postgres("postgresql://ledger@db.internal/opledger")),
    ("postgres://ledger@db.internal/opledger",
     StorageConfig.postgres("postgres://ledger@db.internal/opledger")),
    # The second example: `serve` read this as a SQLite file.
    ("POSTGRESQL://ledger@db.internal/opledger",
     StorageConfig.postgres("postgresql://ledger@db.internal/opledger")),
    ("mysql://db.internal/opledger", "database has the unknown scheme 'mysql://'"),
    ("host=db.internal dbname=opledger", "database looks like a key=value connection string"),
]


def _resolve(command: list[str], database: str, how: str, home: Path,
             monkeypatch: pytest.MonkeyPatch) -> StorageConfig | str:
    """What `command` takes the database setting to mean, given by flag, variable or file."""
    if how == "flag before":
        argv = ["--database", database, *command]
    elif how == "flag after":
        argv = [*command, "--database", database]
    else:
        argv = command
        if how == "environment":
            monkeypatch.setenv("OPLEDGER_DATABASE", database)
        else:
            (home / "opledger.toml").write_text(f"database = {database!r}\n")
    args = build_parser().parse_args(argv)
    try:
        return settings_from(args).storage()
    except ConfigError as error:
        return error.message


@pytest.mark.parametrize("how", ["flag before", "flag after", "environment", "file"])
@pytest.mark.parametrize(("database", "expected"), DATABASES, ids=[d for d, _ in DATABASES])
def test_every_command_reads_the_database_setting_the_same_way(
    database: str, expected: StorageConfig | str, how: str, home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    readings = {
        name: _resolve(argv, database, how, home, monkeypatch)
        for name, argv in COMMANDS.items()
    }
    direct: StorageConfig | str
    try:
        direct = parse_database(database)
    except ConfigError as error:
        direct = error.message
    readings["parse_database"] = direct
    if isinstance(expected, str):
        assert all(isinstance(r, str) and r.startswith(expected) for r in readings.values()), (
            readings
        )
        assert len(set(readings.values())) == 1, readings
    else:
        assert readings == dict.fromkeys(readings, expected)


def test_serve_and_the_inspection_commands_open_the_storage_that_was_named(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Past the parser: what `serve` builds and what `ops list` opens, for the issue's
    two examples, through `opledger` and through the `python -m ledger.server` alias."""
    opened: list[StorageConfig] = []

    class Stop(Exception):
        pass

    def capture(storage: StorageConfig, *_: Any, **__: Any) -> Any:
        opened.append(storage)
        raise Stop

    monkeypatch.setattr(server_main, "build_ledger", capture)
    monkeypatch.setattr(cli, "open_ledger", capture)
    nats = ["--nats-url", "nats://127.0.0.1:1"]
    examples = ["sqlite:///srv/ledger.db", "POSTGRESQL://ledger@db.internal/opledger"]
    for database in examples:
        runs: list[Callable[[str], object]] = [
            lambda db: main(["--database", db, "serve", *nats]),
            lambda db: server_main.run_service_main(["--database", db, *nats]),
            lambda db: main(["--database", db, "ops", "list"]),
        ]
        for run in runs:
            with pytest.raises(Stop):
                run(database)
    assert opened == [parse_database(database) for database in examples for _ in range(3)]
    assert opened[0] == StorageConfig.sqlite("/srv/ledger.db")
    assert opened[3].is_postgres
    capsys.readouterr()


def test_a_database_of_another_scheme_is_one_line_for_every_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (["serve", "--nats-url", "nats://127.0.0.1:1"], ["ops", "list"],
                 ["executor", "run", "executors.nope:x"], ["up"], ["demo"]):
        assert main(["--database", "mysql://secret@db/x", *argv]) == EXIT_REFUSED, argv
        err = capsys.readouterr().err
        assert err.startswith("error: INVALID_CONFIG: database has the unknown scheme 'mysql://'")
        assert len(err.strip().splitlines()) == 1
        assert "secret" not in err


# ---------------------------------------------------------------------- the tree


@pytest.mark.parametrize("name", list(COMMANDS))
def test_global_options_work_before_and_after_every_command(name: str, tmp_path: Path) -> None:
    argv = COMMANDS[name]
    other = tmp_path / "other"
    before = build_parser().parse_args(["--home", str(other), *argv])
    after = build_parser().parse_args([*argv, "--home", str(other)])
    assert settings_from(before).home == settings_from(after).home == other


def test_the_process_commands_are_subcommands_not_first_words(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `opledger --home X serve` was "invalid choice": now it runs, and refuses in one line.
    assert main(["--home", str(home), "serve"]) == EXIT_REFUSED
    assert "no NATS URL" in capsys.readouterr().err
    assert main(["--home", str(home), "executor", "run", "executors.samples.orders:x"]) == 2
    assert "no NATS URL" in capsys.readouterr().err
    assert build_parser().parse_args(["--home", str(home), "up"]).run.__name__ == "_up"


def test_opledger_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = out.split("positional arguments:")[1].split("options:")[0]
    for command in ("up", "demo", "serve", "executor", "creds", "ops", "audit", "approvals"):
        assert f"\n    {command} " in listed, command


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def test_every_help_says_opledger_and_every_option_shows_its_default() -> None:
    parsers = list(_parsers(build_parser()))
    assert len(parsers) >= 20  # opledger, 8 commands, 11 actions
    for parser in parsers:
        assert parser.prog.startswith("opledger"), parser.prog
        text = parser.format_help()
        assert "python -m" not in text, parser.prog
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            where = f"{parser.prog} {action.option_strings[0]}"
            assert action.help, where
            shown = formatter._expand_help(action)  # what --help prints for it
            if not action.required:
                assert "default" in shown and "default: None" not in shown, (where, shown)


# -------------------------------------------------------------------- exit codes


@pytest.mark.parametrize(
    "argv",
    [
        ["no-such-command"],
        ["--no-such-flag", "ops", "list"],
        ["ops", "list", "--no-such-flag"],
        ["ops", "list", "--limit", "zero"],
        ["ops", "show"],
        ["serve", "--ack-wait", "soon"],
        ["executor", "run"],
        ["executor", "run", "m:t", "--batch", "many"],
        ["up", "--monitor=yes"],
        ["approvals", "approve", "op-1"],
        [],
    ],
)
def test_usage_errors_exit_64(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "error:" in err and "usage:" in err


def test_refusals_keep_exit_2(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ops", "list"]) == EXIT_REFUSED  # no ledger in a fresh home
    assert capsys.readouterr().err.startswith("error: NO_LEDGER: ")
    assert main(["--database", "mysql://db/x", "ops", "list"]) == EXIT_REFUSED
    assert "INVALID_CONFIG" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("module", "argv"),
    [("ledger.entrypoints", ["ops", "list", "--limit", "0"]),
     ("ledger.server", ["--ack-wait", "soon"]),
     ("executors", ["run"])],
)
def test_the_aliases_exit_64_on_usage_errors_too(module: str, argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == EXIT_USAGE, done.stderr
    if module == "executors":
        # Standalone (no settings: --nats-url and --contracts required), so its usage
        # names itself rather than `opledger executor run`, whose options differ.
        assert "usage: python -m executors run" in done.stderr
    else:
        assert "python -m" not in done.stderr  # the alias runs `opledger`'s own parser


def test_creds_runs_through_the_one_parser_and_writes_under_the_home(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = home / "elsewhere"
    assert main(["--home", str(other), "creds", "--tools", "search_documents"]) == 0
    out = capsys.readouterr().out
    assert f"server config: {other / 'creds' / 'nats-server.conf'}" in out
    assert (other / "creds" / "identities.json").is_file()
    assert (other / "creds" / "exec-search_documents.nk").is_file()
