"""Where result envelopes are kept. The ledger's events hold only their hash and reference.

Tool output can hold personal data; keeping it out of the append-only event
stream means it can be access-controlled and deleted by retention rules
without breaking the hash chain.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from ledger.adapters.sql import SqlDatabase
from schemas import ResultEnvelope

__all__ = ["ResultStore"]


class ResultStore:
    """Result envelopes keyed by reference (`result:<operation>:<attempt>`)."""

    def __init__(self, db: SqlDatabase) -> None:
        self._db = db
        db.execute(
            "CREATE TABLE IF NOT EXISTS opledger_results ("
            " result_ref TEXT PRIMARY KEY, operation_id TEXT NOT NULL, envelope TEXT NOT NULL)"
        )

    @staticmethod
    def reference(operation_id: str, attempt: int) -> str:
        """The reference of one attempt's result."""
        return f"result:{operation_id}:{attempt}"

    def put(self, reference: str, envelope: ResultEnvelope) -> None:
        """Keep an envelope; the first one for a reference wins."""
        self.put_many([(reference, envelope)])

    def put_many(self, items: Sequence[tuple[str, ResultEnvelope]]) -> None:
        """Keep many envelopes in one transaction; the first one for a reference wins."""
        if not items:
            return
        with self._db.transaction():
            self._db.executemany(
                "INSERT INTO opledger_results (result_ref, operation_id, envelope)"
                " VALUES (?, ?, ?) ON CONFLICT (result_ref) DO NOTHING",
                [(ref, env.operation_id, env.model_dump_json()) for ref, env in items],
            )

    def get(self, reference: str) -> ResultEnvelope | None:
        """The envelope under `reference`, if kept."""
        rows = self._db.query(
            "SELECT envelope FROM opledger_results WHERE result_ref = ?", (reference,)
        )
        return ResultEnvelope.model_validate(orjson.loads(rows[0][0])) if rows else None
