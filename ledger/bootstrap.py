"""The composition root: the one place that wires storage, policy and the ledger together.

`build_ledger` creates a ledger where there is none (the service, `opledger
up`, code); `open_ledger` opens one that exists, read-only or not, and refuses
a missing path or a database that holds no ledger rather than create one.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

from ledger.adapters.eventstore import EventStoreApp
from ledger.adapters.results import ResultStore
from ledger.adapters.sql import SqlDatabase
from ledger.adapters.storage import StorageConfig
from ledger.audit.seal import SCHEMA as SEAL_SCHEMA
from ledger.audit.seal import Sealer, SealKey
from ledger.audit.verify import DEFAULT_SEAL_GRACE
from ledger.budget import LedgerBudgetCounter
from ledger.projections.operations_view import OperationsProjector
from ledger.service import Ledger
from policy import ContractRegistry, ProposalChecker, SemanticRule, TargetResolver
from schemas import ErrorCategory, OpledgerError

__all__ = ["LEDGER_TABLES", "NoLedger", "build_ledger", "ledger_problem", "open_ledger"]

LEDGER_TABLES = ("opledger_operations", "opledger_positions")
"""Besides the events table: the tables every opledger ledger has."""


class NoLedger(OpledgerError):
    """There is no ledger where the settings point: a missing file, or a foreign database."""

    category = ErrorCategory.NOT_FOUND
    code = "NO_LEDGER"


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
    seal_key: SealKey | None = None,
    previous_seal_keys: Sequence[str] = (),
    seal_existing: bool = False,
    seal_every: timedelta = timedelta(0),
    seal_grace: timedelta = DEFAULT_SEAL_GRACE,
) -> Ledger:
    """A ready ledger over `storage`, checking proposals against pinned contracts.

    Contracts come from `registry`, else from `contracts_dir`, else from the
    sample catalog. Without `pins`, the newest version of every tool is pinned.
    A lease lasts the tool's timeout plus `lease_grace`.

    `seal_key`: the ledger service's key; with it, `Ledger.refresh` seals
    (extends and signs the digest chain), continuing only from a head signed
    with it or with one of `previous_seal_keys` (public keys it had before);
    a ledger with events but no signed head only with `seal_existing`; at
    most once per `seal_every` (the service: a quarter second).
    Without it the ledger seals nothing, and verification names the events
    nobody sealed once they are older than `seal_grace`. A read-only
    `storage` (`StorageConfig.reading`) gives a ledger that creates and
    writes nothing: open it with `open_ledger`, which first checks that
    there is a ledger at all.
    """
    if registry is None:
        if contracts_dir is None:
            from policy.catalog import CATALOG_DIR

            contracts_dir = CATALOG_DIR
        registry = ContractRegistry.from_directory(contracts_dir)
    catalog = registry.pin(pins) if pins is not None else registry.pin_latest()
    db = SqlDatabase(storage)  # first: it creates the PostgreSQL schema the events use
    events = EventStoreApp(storage)
    create = not storage.read_only
    if create:
        # The seal's tables exist in every ledger, sealed or not, so that
        # readers always find them (empty, for a ledger without a key).
        with db.creating():
            for statement in SEAL_SCHEMA:
                db.execute(statement)
    projector = OperationsProjector(db, events.recorder, create=create)
    sealer = (
        Sealer(
            db,
            events.recorder,
            seal_key,
            previous_keys=previous_seal_keys,
            seal_existing=seal_existing,
            every=seal_every,
            clock=clock,
        )
        if seal_key is not None
        else None
    )
    budget = LedgerBudgetCounter(projector, clock=clock)
    checker = ProposalChecker(catalog, resolver=resolver, rules=rules, budget=budget, clock=clock)
    return Ledger(
        events=events,
        db=db,
        checker=checker,
        projector=projector,
        budget=budget,
        clock=clock,
        lease_grace=lease_grace,
        results=ResultStore(db, create=create),
        sealer=sealer,
        seal_grace=seal_grace,
    )


def ledger_problem(storage: StorageConfig) -> str | None:
    """Why there is no ledger at `storage` (None: there is one). Creates and writes nothing."""
    if storage.sqlite_path is not None:
        path = storage.sqlite_path
        if not path.exists():
            return "no such file"
        if not path.is_file():
            return "not a file"
    try:
        db = SqlDatabase(storage.reading())
    except (sqlite3.Error, psycopg.Error) as error:
        return f"cannot be opened ({(str(error).splitlines() or [type(error).__name__])[0]})"
    try:
        tables = db.tables()
    except (sqlite3.Error, psycopg.Error):
        return "not a SQLite database" if storage.sqlite_path is not None else "cannot be read"
    finally:
        db.close()
    missing = [t for t in (storage.events_table, *LEDGER_TABLES) if t not in tables]
    if not missing:
        return None
    if len(missing) == len(LEDGER_TABLES) + 1:
        return "it holds no opledger ledger"
    return f"it is not a complete opledger ledger (no {', '.join(missing)})"


def open_ledger(
    storage: StorageConfig,
    *,
    read_only: bool = True,
    contracts_dir: Path | None = None,
    seal_grace: timedelta = DEFAULT_SEAL_GRACE,
) -> Ledger:
    """The ledger that exists at `storage`; `NoLedger` (and nothing created) if none does.

    `read_only`: open it so that nothing can be written (the commands that
    only look); otherwise open it for writing, as `build_ledger` does, but
    only once it is known to be a ledger.
    """
    problem = ledger_problem(storage)
    if problem is not None:
        raise NoLedger(
            f"no ledger at {storage.describe()}: {problem} (name another with --home or"
            " --database, or start one with `opledger up`)"
        )
    return build_ledger(
        storage.reading() if read_only else storage,
        contracts_dir=contracts_dir,
        seal_grace=seal_grace,
    )
