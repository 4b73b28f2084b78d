"""Audit: verification of every stored byte, and the export for auditors."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import IO

from ledger.adapters.event_tables import EventTableReader, StoredRow
from ledger.audit.export import export_jsonl
from ledger.audit.parallel import verify_stored
from ledger.audit.seal import SignedHead
from ledger.audit.verify import VerificationReport
from policy import ToolContract

__all__ = ["Audit"]

_log = logging.getLogger(__name__)


class Audit:
    """Verification of every stored byte, and the export for auditors."""

    def __init__(
        self,
        tables: EventTableReader,
        catalog: Mapping[str, ToolContract],
        *,
        clock: Callable[[], datetime],
        own_key: str | None,
        seal_grace: timedelta,
    ) -> None:
        self._tables = tables
        self._catalog = catalog
        self._clock = clock
        self._own_key = own_key
        self.seal_grace = seal_grace

    def verify(
        self,
        *,
        expected_head: str | None = None,
        workers: int | None = None,
        chunk_size: int | None = None,
        trusted_keys: Sequence[str] | None = None,
        seal_grace: timedelta | None = None,
        anchor: SignedHead | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> VerificationReport:
        """Check every event's hash chain, the seal and its signatures, the view and
        the kept results.

        `trusted_keys`: the public keys whose seal signatures count (None:
        this ledger's own seal key, if it has one); events past the last head
        they signed that are older than `seal_grace` (None: the ledger's) are
        findings. `anchor`: a signed head kept earlier (`audit head`).

        The tables are read straight from SQL, `chunk_size` positions at a time
        (None: chosen for `workers`), by `workers` processes (None: one per CPU
        for a large ledger, else this one alone; 1: this one alone). The report
        does not depend on either: see `ledger.audit.parallel.verify_stored`.
        """
        if trusted_keys is None:
            trusted_keys = [self._own_key] if self._own_key is not None else []
        return verify_stored(
            self._tables.tables,
            expected_head=expected_head,
            workers=workers,
            chunk_size=chunk_size,
            trusted=trusted_keys,
            now=self._clock(),
            grace=self.seal_grace if seal_grace is None else seal_grace,
            anchor=anchor,
            progress=progress,
        )

    def stored_rows(self, page: int = 10_000) -> Iterator[StoredRow]:
        """Every row of the events table in position order, straight from SQL."""
        return self._tables.rows(page)

    def export(self, out: IO[bytes], progress: Callable[[int], None] | None = None) -> int:
        """Write the ledger as JSON Lines, sensitive argument values hashed (`progress`
        is told the count now and then)."""
        return export_jsonl(self._tables.rows(), self._catalog, out, progress)
