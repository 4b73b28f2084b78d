"""No command creates a ledger; the read-only ones open it read-only and write nothing."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest

from ledger import StorageConfig
from ledger.bootstrap import NoLedger, open_ledger
from tests.conftest import drop_schema, postgres_storage_or_skip
from tests.ledger.helpers import ALICE, NEXT_STEP, cli, make_ledger, search, use_storage

READ_COMMANDS = [
    ["ops", "list"],
    ["ops", "show", "op-1"],
    ["audit", "verify"],
    ["audit", "export"],
    ["audit", "head"],
    ["approvals", "list"],
    ["approvals", "show", "op-1"],
]
WRITE_COMMANDS = [
    ["ops", "rebuild"],
    ["approvals", "approve", "op-1", "--break-glass", "--as", "bob", "--role", "r",
     "--proposal-hash", "f" * 64],
    ["approvals", "deny", "op-1", "--break-glass", "--as", "bob", "--role", "r"],
]
ALL_COMMANDS = READ_COMMANDS + WRITE_COMMANDS


def _refused(capsys: Any, command: list[str], where: str, why: str) -> None:
    code, out, err = cli(capsys, *command)
    assert (code, out) == (2, ""), command
    assert err == f"error: NO_LEDGER: no ledger at {where}: {why}{NEXT_STEP}\n", command


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=" ".join)
def test_a_missing_path_is_refused_and_nothing_is_created(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    use_storage(monkeypatch, tmp_path / "home", StorageConfig.sqlite("typo/ledgr.db"))

    _refused(capsys, command, "sqlite:typo/ledgr.db", "no such file")

    assert not (tmp_path / "typo").exists()
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=" ".join)
def test_a_foreign_sqlite_file_is_refused_and_left_as_it_was(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    foreign = tmp_path / "notes.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
        conn.execute("INSERT INTO notes VALUES ('mine')")
    conn.close()
    before = foreign.read_bytes()
    use_storage(monkeypatch, tmp_path, StorageConfig.sqlite(foreign))

    _refused(capsys, command, f"sqlite:{foreign}", "it holds no opledger ledger")

    assert foreign.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.db"]


def test_a_file_that_is_not_a_database_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    text = tmp_path / "ledger.db"
    text.write_text("not a database\n")
    use_storage(monkeypatch, tmp_path, StorageConfig.sqlite(text))

    _refused(capsys, ["audit", "verify"], f"sqlite:{text}", "not a SQLite database")
    assert text.read_text() == "not a database\n"


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=" ".join)
def test_a_postgres_schema_without_a_ledger_stays_empty(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    storage = postgres_storage_or_skip()
    with psycopg.connect(storage.postgres_dsn or "", autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{storage.postgres_schema}"')
    try:
        use_storage(monkeypatch, tmp_path, storage)
        _refused(capsys, command, storage.describe(), "it holds no opledger ledger")
        with psycopg.connect(storage.postgres_dsn or "") as conn:
            tables = conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (storage.postgres_schema,),
            ).fetchall()
        assert tables == []
    finally:
        drop_schema(storage)


def test_a_missing_postgres_schema_is_not_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    storage = postgres_storage_or_skip()
    use_storage(monkeypatch, tmp_path, storage)

    _refused(capsys, ["ops", "list"], storage.describe(), "it holds no opledger ledger")
    with psycopg.connect(storage.postgres_dsn or "") as conn:
        schemas = conn.execute(
            "SELECT 1 FROM information_schema.schemata WHERE schema_name = %s",
            (storage.postgres_schema,),
        ).fetchall()
    assert schemas == []


def _digest(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.parent.iterdir())
        if p.name.startswith(path.name)
    }


def test_read_commands_write_not_a_byte_of_a_sqlite_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    storage = StorageConfig.sqlite(tmp_path / "ledger.db")
    ledger = make_ledger(storage)
    ledger.submit(search("op-1"), ALICE)
    ledger.refresh()
    ledger.submit(search("op-2"), ALICE)  # not yet projected nor sealed
    ledger.close()
    before = _digest(tmp_path / "ledger.db")
    use_storage(monkeypatch, tmp_path, storage)

    for command in READ_COMMANDS:
        code, _, err = cli(capsys, *command)
        assert code in (0, 1, 2) and "NO_LEDGER" not in err, (command, err)

    after = _digest(tmp_path / "ledger.db")
    assert after["ledger.db"] == before["ledger.db"]
    # A WAL database read by a read-only connection gets its shared-memory index
    # (SQLite's, no data in it) and an empty log, and nothing more.
    assert set(after) - set(before) <= {"ledger.db-shm", "ledger.db-wal"}
    assert (tmp_path / "ledger.db-wal").stat().st_size == 0


def test_a_read_only_ledger_cannot_write(storage: StorageConfig) -> None:
    make_ledger(storage).close()
    reader = open_ledger(storage)
    try:
        with pytest.raises((sqlite3.Error, psycopg.Error), match=r"(?i)read.?only"):
            reader.db.execute("DELETE FROM opledger_operations")
    finally:
        reader.close()


def test_open_ledger_for_writing_still_refuses_to_create(tmp_path: Path) -> None:
    with pytest.raises(NoLedger, match="no such file"):
        open_ledger(StorageConfig.sqlite(tmp_path / "none.db"), read_only=False)
    assert list(tmp_path.iterdir()) == []
