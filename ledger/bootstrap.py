"""The composition root: the one place that wires storage, policy and the ledger together."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ledger.adapters.eventstore import EventStoreApp
from ledger.adapters.sql import SqlDatabase
from ledger.adapters.storage import StorageConfig
from ledger.budget import LedgerBudgetCounter
from ledger.projections.operations_view import OperationsProjector
from ledger.service import Ledger
from policy import ContractRegistry, ProposalChecker, SemanticRule, TargetResolver

__all__ = ["build_ledger"]


def _utcnow() -> datetime:
    return datetime.now(UTC)


def build_ledger(
    storage: StorageConfig,
    *,
    contracts_dir: Path | None = None,
    registry: ContractRegistry | None = None,
    pins: Mapping[str, str] | None = None,
    resolver: TargetResolver | None = None,
    rules: Mapping[str, Sequence[SemanticRule]] | None = None,
    clock: Callable[[], datetime] = _utcnow,
    lease_grace: timedelta = timedelta(seconds=30),
) -> Ledger:
    """A ready ledger over `storage`, checking proposals against pinned contracts.

    Contracts come from `registry`, else from `contracts_dir`, else from the
    sample catalog. Without `pins`, the newest version of every tool is pinned.
    A lease lasts the tool's timeout plus `lease_grace`.
    """
    if registry is None:
        if contracts_dir is None:
            from policy.catalog import CATALOG_DIR

            contracts_dir = CATALOG_DIR
        registry = ContractRegistry.from_directory(contracts_dir)
    catalog = registry.pin(pins) if pins is not None else registry.pin_latest()
    db = SqlDatabase(storage)  # first: it creates the PostgreSQL schema the events use
    events = EventStoreApp(storage)
    projector = OperationsProjector(db, events.recorder)
    budget = LedgerBudgetCounter(projector)
    checker = ProposalChecker(catalog, resolver=resolver, rules=rules, budget=budget, clock=clock)
    return Ledger(
        events=events,
        db=db,
        checker=checker,
        projector=projector,
        budget=budget,
        clock=clock,
        lease_ttl=lease_grace,
    )
