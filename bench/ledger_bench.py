"""Ledger throughput and replay speed, on SQLite and PostgreSQL.

Full happy path per operation: proposed → validated → readied (one batched
append for the whole batch), lease claimed (one append), succeeded (one
append): five events, three transactions per batch. Beside it, in the same
run, the baseline: the bare event recorder inserting five pre-encoded events
per operation in one transaction per batch, i.e. the storage ceiling.

Replay: verification of every stored event (decode, re-hash, chain and seal
checks, the seal's signatures, the view and kept results against the events),
by default in as many processes as pay off and also in one process alone, and
full aggregate reconstruction, in events per second.

Seal: bringing the view up to date and sealing every event (one Ed25519
signature per sealed batch), in events per second, and what one signature
costs; the service seals about every 20 ms under load, so that cost is paid
about 50 times a second at most.

    python bench/ledger_bench.py [--ops 3000] [--batch 100] [--postgres DSN | --no-postgres]
                                 [--verify-workers N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import psycopg
from eventsourcing.persistence import StoredEvent

from ledger import Ledger, StorageConfig, Submission, build_ledger
from ledger.audit.seal import SealKey, seal_time
from policy import ContractRegistry, InMemoryTargetResolver
from policy.catalog import CATALOG_DIR, SAMPLE_RULES, sample_targets
from schemas import (
    LeaseDecision,
    LeaseReply,
    Provenance,
    ResultEnvelope,
    RuntimeContext,
    ToolProposal,
)

CONTEXT = RuntimeContext(
    principal="bench", tenant="acme", capabilities=frozenset({"documents:search"})
)


def _registry() -> ContractRegistry:
    # Budgets would (rightly) stop one actor after 30 calls a minute.
    registry = ContractRegistry()
    for contract in ContractRegistry.from_directory(CATALOG_DIR).pin_latest().values():
        limits = contract.limits.model_copy(update={"max_per_hour": None, "max_per_minute": None})
        registry.register(contract.model_copy(update={"limits": limits}))
    return registry


def _proposal(n: int) -> ToolProposal:
    return ToolProposal(
        proposal_id=f"p-{n}",
        conversation_id="c",
        requested_by_user_id="bench",
        tool_name="search_documents",
        arguments={"query": f"refund policy {n}", "source_types": ["policy"], "top_k": 5},
    )


def _happy_path(ledger: Ledger, ops: int, batch: int) -> float:
    start = time.perf_counter()
    for first in range(0, ops, batch):
        submissions = cast(
            "list[Submission]",
            ledger.submit_many(
                [(_proposal(n), CONTEXT) for n in range(first, min(first + batch, ops))]
            ),
        )
        grants = [
            grant
            for grant in ledger.lease_many(
                [(s.operation_id, "bench", "search_documents") for s in submissions]
            )
            if isinstance(grant, LeaseReply) and grant.decision is LeaseDecision.EXECUTE
        ]
        assert len(grants) == len(submissions)
        now = datetime.now(UTC)
        ledger.record_results(
            [
                ResultEnvelope(
                    operation_id=g.operation_id,
                    fencing_token=g.fencing_token,
                    ok=True,
                    data={"items": [], "truncated": False, "next_cursor": None},
                    provenance=Provenance(
                        tool=g.tool or "",
                        tool_version=g.tool_version or "",
                        executor="bench",
                        attempt=g.attempt,
                        latency_ms=0.1,
                        completed_at=now,
                    ),
                )
                for g in grants
            ]
        )
    return ops / (time.perf_counter() - start)


def _baseline(storage: StorageConfig, ops: int, batch: int) -> float:
    """The bare recorder: five small stored events per operation, one transaction per batch."""
    from ledger.adapters.eventstore import EventStoreApp
    from ledger.adapters.sql import SqlDatabase

    SqlDatabase(storage).close()  # creates the PostgreSQL schema
    app = EventStoreApp(storage)  # kept alive: it closes its pool when collected
    recorder = app.recorder
    state = b'{"prev_hash":"' + b"0" * 64 + b'","payload":"' + b"x" * 300 + b'"}'
    start = time.perf_counter()
    for first in range(0, ops, batch):
        events = [
            StoredEvent(
                originator_id=operation_id,
                originator_version=version,
                topic="bench:Raw",
                state=state,
            )
            for operation_id in (f"raw-{uuid.uuid4()}" for _ in range(min(batch, ops - first)))
            for version in range(1, 6)
        ]
        recorder.insert_events(events)
    rate = ops / (time.perf_counter() - start)
    app.close()
    return rate


VERIFY_RUNS = 3
"""Verification takes a fraction of a second: the best of a few runs is steadier."""


def _verify_rate(ledger: Ledger, workers: int | None) -> float:
    """Events verified per second, best of `VERIFY_RUNS` (None: the default, automatic)."""
    best = 0.0
    for _ in range(VERIFY_RUNS):
        start = time.perf_counter()
        report = ledger.verify(workers=workers)
        best = max(best, report.events_checked / (time.perf_counter() - start))
        assert report.ok, [f.describe() for f in report.findings[:5]]
    return best


SIGNATURES = 2_000


def _seal(ledger: Ledger) -> tuple[float, float, int]:
    """(events projected and sealed per second, µs per signature, signatures written)."""
    ((events,),) = ledger.db.query(f"SELECT COUNT(*) FROM {ledger.events_table}")
    start = time.perf_counter()
    ledger.refresh()
    rate = events / (time.perf_counter() - start)
    ((signatures,),) = ledger.db.query("SELECT COUNT(*) FROM opledger_seal_signatures")
    key = SealKey.generate()
    when = seal_time(datetime.now(UTC))
    start = time.perf_counter()
    for position in range(SIGNATURES):
        key.sign(position, "0" * 64, when)
    per_signature = (time.perf_counter() - start) / SIGNATURES * 1e6
    return rate, per_signature, int(signatures)


def _replay(ledger: Ledger, ops: int, workers: int | None) -> tuple[float, float, float]:
    """Verification (the default path, and one process alone) and aggregate rebuild rates."""
    ledger.refresh()
    verify_rate = _verify_rate(ledger, workers)
    alone_rate = _verify_rate(ledger, 1)
    ids = [row.operation_id for row in ledger.projector.rows(limit=ops)]
    start = time.perf_counter()
    for operation_id in ids:
        ledger.get(operation_id)
    rebuild_rate = len(ids) * 5 / (time.perf_counter() - start)
    return verify_rate, alone_rate, rebuild_rate


def run(
    name: str,
    storage: StorageConfig,
    baseline_storage: StorageConfig,
    ops: int,
    batch: int,
    verify_workers: int | None = None,
) -> None:
    """Benchmark one backend and print its figures."""
    baseline = _baseline(baseline_storage, ops, batch)
    ledger = build_ledger(
        storage,
        registry=_registry(),
        resolver=InMemoryTargetResolver(sample_targets()),
        rules=SAMPLE_RULES,
        seal_key=SealKey.generate(),
    )
    rate = _happy_path(ledger, ops, batch)
    seal_rate, per_signature, signatures = _seal(ledger)
    verify_rate, alone_rate, rebuild_rate = _replay(ledger, ops, verify_workers)
    print(f"{name}: {ops} operations in batches of {batch}")
    print(f"  baseline, bare recorder (5 events/op):  {baseline:9,.0f} ops/s")
    print(
        f"  full happy path (check + 5 events/op):  {rate:9,.0f} ops/s"
        f"   {rate / baseline:5.2f}x baseline"
    )
    print(
        f"  view + seal (fold, digest, sign):       {seal_rate:9,.0f} events/s"
        f"   {signatures} signed batches"
    )
    print(f"  one seal signature (Ed25519):           {per_signature:9,.1f} µs")
    workers = "auto" if verify_workers is None else str(verify_workers)
    print(
        f"  verify (chain, signed seal, view, results): {verify_rate:5,.0f} events/s"
        f"   workers={workers}, best of {VERIFY_RUNS}"
    )
    print(f"  verify in one process:                  {alone_rate:9,.0f} events/s")
    print(f"  aggregate replay (pydantic decode):     {rebuild_rate:9,.0f} events/s")
    ledger.close()


def main() -> None:
    """Run the benchmark on both backends."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument(
        "--postgres",
        default=os.environ.get(
            "OPLEDGER_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test"
        ),
    )
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument(
        "--verify-workers",
        type=int,
        default=None,
        metavar="N",
        help="processes that verify (default: automatic, one per CPU for large ledgers)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        run(
            "SQLite",
            StorageConfig.sqlite(Path(directory) / "bench.db"),
            StorageConfig.sqlite(Path(directory) / "baseline.db"),
            args.ops,
            args.batch,
            args.verify_workers,
        )
    if args.no_postgres:
        return
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    try:
        run(
            "PostgreSQL",
            StorageConfig.postgres(args.postgres, schema),
            StorageConfig.postgres(args.postgres, schema + "_raw"),
            args.ops,
            args.batch,
            args.verify_workers,
        )
    finally:
        with psycopg.connect(args.postgres, autocommit=True) as conn:
            for name in (schema, schema + "_raw"):
                conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


if __name__ == "__main__":
    main()
