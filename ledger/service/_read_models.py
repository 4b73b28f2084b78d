"""Read models: keep the operations view current and, with the seal key, sealed."""

from __future__ import annotations

import logging
import time

from ledger.adapters.sql import SqlDatabase
from ledger.audit.seal import Sealer, SealRefused
from ledger.projections.operations_view import OperationsProjector

__all__ = ["ReadModels"]

_log = logging.getLogger(__name__)


class ReadModels:
    """Brings the operations view up to date and, holding the seal key, seals."""

    def __init__(self, view: OperationsProjector, sealer: Sealer | None) -> None:
        self._view = view
        # Only a ledger holding the seal key seals (the service): readers
        # never write the seal, and a ledger without the key seals nothing.
        self._sealer = sealer
        self._seal_refused_logged = float("-inf")

    def refresh(self) -> int:
        """Bring the read models up to date with the event log, and seal it if these
        read models hold the sealer (a ledger with the seal key, unless it moved them
        to a thread: `moved_to`); returns how many events the view took in."""
        projected = self._view.catch_up()
        if self._sealer is None:
            return projected
        # Its own transaction: one around the view's and the seal's together was
        # measured slower end to end (bench/e2e_bench.py, 2 x 16: 967-1,217
        # against 1,182-1,232 operations/s).
        try:
            self._sealer.seal(self._view.projected)
        except SealRefused as refused:
            # Loud but not fatal: the feed, work and outcomes must go on (the
            # feed is the auditors' witness of what happened meanwhile).
            now = time.monotonic()
            if now - self._seal_refused_logged >= 60:
                self._seal_refused_logged = now
                _log.error("not sealing: %s", refused.message)
        return projected

    def moved_to(self, db: SqlDatabase) -> ReadModels:
        """These read models over another connection (for a thread of their own), taking
        the sealer with them: from now on this object brings the view up to date but
        never seals. One sealer at a time: its memory of what it signed is what lets it
        refuse a seal someone cut back or erased (`Sealer.head`), and two copies would
        each remember only part of it."""
        moved = ReadModels(OperationsProjector(db, self._view.recorder, create=False), None)
        moved.take_sealer_from(self)
        return moved

    def take_sealer_from(self, other: ReadModels) -> None:
        """Take `other`'s sealer (it seals no more), writing over this one's connection:
        how read models moved to a thread give it back when the thread stops."""
        sealer, other._sealer = other._sealer, None
        if sealer is not None:
            self._sealer = sealer.on(self._view.database)

    def seal_now(self) -> int:
        """Bring the view up to date and seal everything now (a service that stops)."""
        projected = self._view.catch_up()
        if self._sealer is not None:
            try:
                self._sealer.seal(self._view.projected, now=True)
            except SealRefused as refused:
                _log.error("not sealing: %s", refused.message)
        return projected
