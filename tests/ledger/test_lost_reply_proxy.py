"""The lost-reply proxy itself (`tests.ledger.lost_reply`), on the real server: it reports
an answer lost only when the statement committed, so the attack tests that rely on it
cannot pass on a statement that failed."""

from __future__ import annotations

import psycopg
import pytest

from ledger import StorageConfig
from tests.ledger.lost_reply import LostReplyProxy


@pytest.mark.parametrize("commits", [True, False], ids=["committed", "failed"])
def test_a_loss_is_reported_only_for_a_committed_statement(
    postgres_storage: StorageConfig, commits: bool
) -> None:
    dsn, schema = postgres_storage.postgres_dsn or "", postgres_storage.postgres_schema
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        conn.execute(f'CREATE TABLE "{schema}".keys (k text PRIMARY KEY)')
        conn.execute(f"INSERT INTO \"{schema}\".keys VALUES ('taken')")
    proxy = LostReplyProxy(dsn)
    try:
        key = "fresh" if commits else "taken"
        with psycopg.connect(proxy.dsn, autocommit=True) as conn:
            proxy.lose_reply_to("marker-7f3a")
            with pytest.raises(psycopg.OperationalError):  # the connection is cut either way
                conn.execute(
                    f'INSERT INTO "{schema}".keys SELECT %s WHERE \'marker-7f3a\' <> \'\'',
                    (key,),
                )
        assert proxy.lost.is_set() is commits
    finally:
        proxy.close()
    with psycopg.connect(dsn) as conn:
        stored = sorted(k for (k,) in conn.execute(f'SELECT k FROM "{schema}".keys'))
    assert stored == (["fresh", "taken"] if commits else ["taken"])
