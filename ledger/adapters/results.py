"""Where result envelopes are kept. The ledger's events hold only their hash and reference.

Tool output can hold personal data; keeping it out of the append-only event
stream means it can be access-controlled and deleted by retention rules
without breaking the hash chain. What is kept is the exact text whose SHA-256
the settling event records (`envelope_hash`): the ledger encodes an envelope
once, hashes that string and stores that same string, so a changed byte in
this table no longer matches its event (`Ledger.status` refuses to serve it,
`opledger audit verify` names it).
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from ledger.adapters.sql import SqlDatabase
from schemas import ResultEnvelope, sha256_hex

__all__ = ["RESULTS_TABLE", "ResultStore", "envelope_text_hash"]

RESULTS_TABLE = "opledger_results"


def envelope_text_hash(text: str) -> str:
    """The SHA-256 of a kept envelope's exact text (what `envelope_hash` records)."""
    return sha256_hex(text.encode())


class ResultStore:
    """Result envelopes keyed by reference (`result:<operation>:<attempt>`)."""

    def __init__(self, db: SqlDatabase, *, create: bool = True) -> None:
        self._db = db
        if create:
            with db.creating():
                db.execute(
                    f"CREATE TABLE IF NOT EXISTS {RESULTS_TABLE} ("
                    " result_ref TEXT PRIMARY KEY, operation_id TEXT NOT NULL,"
                    " envelope TEXT NOT NULL)"
                )

    @staticmethod
    def reference(operation_id: str, attempt: int) -> str:
        """The reference of one attempt's result."""
        return f"result:{operation_id}:{attempt}"

    @staticmethod
    def encode(envelope: ResultEnvelope) -> str:
        """The text an envelope is kept as (hash exactly this string)."""
        return envelope.model_dump_json()

    def get_text(self, reference: str) -> str | None:
        """The exact text kept under `reference`, if any."""
        return self.get_texts([reference]).get(reference)

    def get_texts(self, references: Sequence[str]) -> dict[str, str]:
        """The exact texts kept under `references` (those kept), in one query."""
        if not references:
            return {}
        marks = ", ".join("?" * len(references))
        rows = self._db.query(
            f"SELECT result_ref, envelope FROM {RESULTS_TABLE} WHERE result_ref IN ({marks})",
            tuple(references),
        )
        return {str(reference): str(text) for reference, text in rows}

    def get(self, reference: str) -> ResultEnvelope | None:
        """The envelope under `reference`, if kept (unchecked: see `Ledger.status`)."""
        text = self.get_text(reference)
        return ResultEnvelope.model_validate(orjson.loads(text)) if text is not None else None
