"""`SqlDatabase.insert_rows` and `query_in`, which the operations view and the seal write
and read with: on PostgreSQL many rows (or values) per statement, in chunks under the
parameter limit, with numbered placeholders. Every row goes in exactly as given, on both
backends; an upsert updates; a chunk that fails inside a transaction leaves nothing of the
earlier chunks behind; `query_in` finds exactly the stored values."""

from __future__ import annotations

import sqlite3

import psycopg
import pytest

from ledger import StorageConfig
from ledger.adapters.sql import SqlDatabase

_AWKWARD = ["it's", 'a "quote"', "back\\slash", "percent %s and ? mark", "", "\u00e9\u4e2d"]


def _table(db: SqlDatabase, width: int) -> str:
    columns = ", ".join(f"c{i} TEXT" for i in range(1, width))
    db.execute(f"CREATE TABLE t_rows (k BIGINT PRIMARY KEY, {columns})")
    return "INSERT INTO t_rows (k, " + ", ".join(f"c{i}" for i in range(1, width)) + ")"


def test_every_row_goes_in_as_given_across_many_statements(storage: StorageConfig) -> None:
    db = SqlDatabase(storage)
    head = _table(db, 3)
    rows = [(k, _AWKWARD[k % len(_AWKWARD)], None if k % 7 == 0 else str(k)) for k in range(1234)]
    with db.transaction():
        db.insert_rows(head, rows)
    assert db.query("SELECT k, c1, c2 FROM t_rows ORDER BY k") == rows


def test_wide_rows_are_chunked_under_the_parameter_limit(storage: StorageConfig) -> None:
    # 200 columns: 327 rows per statement on PostgreSQL (65,535 parameters at most),
    # so 700 rows take three statements.
    db = SqlDatabase(storage)
    head = _table(db, 200)
    rows = [(k, *(f"{k}.{i}" for i in range(1, 200))) for k in range(700)]
    with db.transaction():
        db.insert_rows(head, rows)
    assert db.query("SELECT count(*), min(k), max(k) FROM t_rows") == [(700, 0, 699)]
    assert db.query("SELECT c199 FROM t_rows WHERE k = 654") == [("654.199",)]


def test_an_upsert_updates_the_stored_rows(storage: StorageConfig) -> None:
    db = SqlDatabase(storage)
    head = _table(db, 2)
    upsert = "ON CONFLICT (k) DO UPDATE SET c1 = excluded.c1"
    db.insert_rows(head, [(k, "old") for k in range(10)], upsert)
    db.insert_rows(head, [(k, "new") for k in range(5, 15)], upsert)
    assert db.query("SELECT k, c1 FROM t_rows ORDER BY k") == [
        (k, "old" if k < 5 else "new") for k in range(15)
    ]


def test_a_failing_chunk_leaves_nothing_of_its_transaction(storage: StorageConfig) -> None:
    db = SqlDatabase(storage)
    head = _table(db, 200)
    db.insert_rows(head, [(650, *("stored",) * 199)])
    # The third chunk (on PostgreSQL) meets the stored key; the first two were sent.
    rows = [(k, *("x",) * 199) for k in range(700) if k != 650] + [(650, *("x",) * 199)]
    with pytest.raises((sqlite3.IntegrityError, psycopg.errors.UniqueViolation)), db.transaction():
        db.insert_rows(head, rows)
    assert db.query("SELECT k, c1 FROM t_rows") == [(650, "stored")]
    # Nothing was given: no statement at all.
    db.insert_rows(head, [])
    assert db.query("SELECT count(*) FROM t_rows") == [(1,)]


def test_outside_a_transaction_a_failing_chunk_leaves_nothing_either(
    storage: StorageConfig,
) -> None:
    db = SqlDatabase(storage)
    head = _table(db, 200)
    db.insert_rows(head, [(650, *("stored",) * 199)])
    rows = [(k, *("x",) * 199) for k in range(700) if k != 650] + [(650, *("x",) * 199)]
    with pytest.raises((sqlite3.IntegrityError, psycopg.errors.UniqueViolation)):
        db.insert_rows(head, rows)
    assert db.query("SELECT k, c1 FROM t_rows") == [(650, "stored")]


def test_rows_of_different_widths_are_refused_before_anything_is_sent(
    storage: StorageConfig,
) -> None:
    # Flattened into one VALUES list, ("2", "a2") and a wider row after it would have
    # the same parameter count as three good rows, with values in the wrong columns.
    db = SqlDatabase(storage)
    head = _table(db, 3)
    with pytest.raises(ValueError, match="different widths"):
        db.insert_rows(head, [(1, "a1", "b1"), (2, "a2"), (3, "a3", "b3", "x")])
    assert db.query("SELECT count(*) FROM t_rows") == [(0,)]


def test_query_in_finds_exactly_the_stored_values_across_chunks(storage: StorageConfig) -> None:
    # Keys that look like placeholders of every dialect (`?`, `%s`, `$1`) are data:
    # on PostgreSQL the statement carries numbered placeholders and the values travel
    # apart from it, so none of them can shift or fill in another.
    db = SqlDatabase(storage)
    db.execute("CREATE TABLE t_keys (k TEXT PRIMARY KEY, n BIGINT)")
    awkward = [*_AWKWARD, "$1", "$2, $3", "%(name)s", "?)"]
    stored = [f"{awkward[n % len(awkward)]}#{n}" for n in range(1234)]
    db.insert_rows("INSERT INTO t_keys (k, n)", [(key, n) for n, key in enumerate(stored)])
    asked = stored[::3] + [f"missing {key}" for key in stored[:50]] + ["$1", "?"]
    found = db.query_in("SELECT k, n FROM t_keys WHERE k IN ({marks}) ORDER BY n", asked, chunk=97)
    assert found == [(key, n) for n, key in enumerate(stored) if n % 3 == 0]
    # A chunk of one, and nothing asked: no statement at all.
    assert db.query_in("SELECT n FROM t_keys WHERE k IN ({marks})", [stored[7]]) == [(7,)]
    assert db.query_in("SELECT n FROM t_keys WHERE k IN ({marks})", []) == []
