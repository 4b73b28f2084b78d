"""Chunked and parallel verification report exactly what one sequential pass reports.

Every tampered ledger is verified three ways: by `verify_ledger` over the
whole table, the whole seal and every signature at once, plus the view and
result check over whole tables (the reference), and by `Ledger.verify` in
this process and with a worker process, at chunk sizes small enough that
every fault sits on or next to a chunk boundary. Runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest

from ledger import FindingKind, Ledger, StorageConfig
from ledger.audit import parallel
from ledger.audit.model import verify_model
from ledger.audit.seal import SealKey
from ledger.audit.verify import SignatureRow, VerificationReport, verify_ledger
from ledger.domain.hashing import stored_event_hash
from ledger.projections.operations_view import ROW_COLUMNS, VIEW_NAME
from tests.ledger.helpers import ALICE, NO_HITS, SEAL_KEY, make_ledger, result, search

SUCCEEDED = "ledger.domain.operation:Operation.Succeeded"
CHUNK_SIZES = (1, 2, 3, 7, 16)


@pytest.fixture
def ledger(storage: StorageConfig) -> Ledger:
    """Ten operations whose events interleave: each chain crosses many positions."""
    ledger = make_ledger(storage)
    for n in range(10):
        ledger.submit(search(f"op-{n}"), ALICE)
        if n % 3 == 0:
            ledger.refresh()  # sealed in several batches: several signed heads
    for n in range(0, 10, 2):  # the even ones run and succeed: five events, the others three
        grant = ledger.lease(f"op-{n}", executor="exec-1")
        ledger.record_result(result(f"op-{n}", grant.fencing_token, data=NO_HITS))
    ledger.refresh()
    report = ledger.verify(workers=1)
    assert report.ok, [f.describe() for f in report.findings]
    assert report.events_checked == report.sealed_events == 40
    return ledger


def _column(ledger: Ledger) -> str:
    return "notification_id" if ledger.db.is_postgres else "rowid"


def _position(ledger: Ledger, operation_id: str, version: int) -> int:
    rows = ledger.db.query(
        f"SELECT {_column(ledger)} FROM {ledger.events_table}"
        " WHERE originator_id = ? AND originator_version = ?",
        (operation_id, version),
    )
    return int(rows[0][0])


def _state(ledger: Ledger, operation_id: str, version: int) -> bytes:
    rows = ledger.db.query(
        f"SELECT state FROM {ledger.events_table}"
        " WHERE originator_id = ? AND originator_version = ?",
        (operation_id, version),
    )
    return bytes(rows[0][0])


def _insert(ledger: Ledger, position: int, operation_id: str, version: int, state: bytes) -> None:
    ledger.db.execute(
        f"INSERT INTO {ledger.events_table}"
        f" (originator_id, originator_version, topic, state, {_column(ledger)})"
        " VALUES (?, ?, ?, ?, ?)",
        (operation_id, version, SUCCEEDED, state, position),
    )


def modify(ledger: Ledger) -> None:
    """Rewrite one event's arguments (its hash no longer matches the seal)."""
    state = orjson.loads(_state(ledger, "op-4", 2))
    state["arguments"]["query"] = "salaries of everyone"
    ledger.db.execute(
        f"UPDATE {ledger.events_table} SET state = ?"
        " WHERE originator_id = ? AND originator_version = ?",
        (orjson.dumps(state), "op-4", 2),
    )


def delete(ledger: Ledger) -> None:
    """Remove one sealed event from the middle of a chain."""
    ledger.db.execute(
        f"DELETE FROM {ledger.events_table} WHERE originator_id = ? AND originator_version = ?",
        ("op-6", 4),
    )


def delete_last(ledger: Ledger) -> None:
    """Remove the last event: its seal row lies past every remaining event."""
    ((last,),) = ledger.db.query(f"SELECT MAX({_column(ledger)}) FROM {ledger.events_table}")
    ledger.db.execute(f"DELETE FROM {ledger.events_table} WHERE {_column(ledger)} = ?", (last,))


def insert_before(ledger: Ledger) -> None:
    """A forged event at position -1, outside the notification order."""
    forged = orjson.loads(_state(ledger, "op-0", 5))
    forged["originator_version"] = 6
    _insert(ledger, -1, "op-0", 6, orjson.dumps(forged))


def insert_at_extremes(ledger: Ledger) -> None:
    """Forged events at the lowest and the highest 64-bit positions."""
    forged = orjson.loads(_state(ledger, "op-2", 5))
    forged["originator_version"] = 6
    _insert(ledger, -(2**63), "op-2", 6, orjson.dumps(forged))
    forged["originator_version"] = 7
    _insert(ledger, 2**63 - 1, "op-2", 7, orjson.dumps(forged))


def reorder(ledger: Ledger) -> None:
    """Swap the last events of two operations in the global order."""
    first, second = _state(ledger, "op-0", 5), _state(ledger, "op-4", 5)
    sealed = {row[1]: row[0] for row in ledger.projector.digest_rows() if row[2] == 5}
    ledger.db.execute(
        f"DELETE FROM {ledger.events_table} WHERE originator_version = 5"
        " AND originator_id IN ('op-0', 'op-4')"
    )
    for operation, other, body in (("op-0", "op-4", second), ("op-4", "op-0", first)):
        _insert(ledger, sealed[operation], other, 5, body)


def rewrite_seal_hash(ledger: Ledger) -> None:
    """Change one sealed event hash without recomputing the running digests."""
    position = _position(ledger, "op-3", 2)
    ledger.db.execute(
        "UPDATE opledger_digest SET event_hash = ? WHERE notification_id = ?", ("e" * 64, position)
    )


def rewrite_seal_digest(ledger: Ledger) -> None:
    """Change the running digests of the first and last seal rows."""
    ((first, last),) = ledger.db.query(
        "SELECT MIN(notification_id), MAX(notification_id) FROM opledger_digest"
    )
    for position in (first, last):
        ledger.db.execute(
            "UPDATE opledger_digest SET running_digest = ? WHERE notification_id = ?",
            ("d" * 64, position),
        )


def mislabel(ledger: Ledger) -> None:
    """A row whose columns name another version than its stored JSON."""
    ledger.db.execute(
        f"UPDATE {ledger.events_table} SET originator_version = 9"
        " WHERE originator_id = ? AND originator_version = ?",
        ("op-1", 3),
    )


def append_forged(ledger: Ledger) -> None:
    """A forged tail event with a correct prev_hash, dated an hour ago, left unsealed."""
    rows = list(ledger.stored_rows())
    last = max((r for r in rows if r[1] == "op-1"), key=lambda r: r[2])
    forged = orjson.loads(last[4])
    forged |= {
        "originator_version": last[2] + 1,
        "prev_hash": stored_event_hash(last[3], last[4]),
        "timestamp": (datetime.now(UTC) - timedelta(hours=1)).isoformat(),
    }
    top = max(r[0] for r in rows if r[0] < 2**62)  # not past a forged row at the very top
    _insert(ledger, top + 1, "op-1", last[2] + 1, orjson.dumps(forged))


def _signatures(ledger: Ledger) -> list[SignatureRow]:
    return [
        (int(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]))
        for r in ledger.db.query(
            "SELECT position, running_digest, sealed_at, public_key, signature"
            " FROM opledger_seal_signatures ORDER BY position"
        )
    ]


def forge_signature(ledger: Ledger) -> None:
    """One signature's bytes changed: it no longer verifies with the trusted key."""
    position, _, _, _, signature = _signatures(ledger)[0]
    flipped = ("A" if signature[0] != "A" else "B") + signature[1:]
    ledger.db.execute(
        "UPDATE opledger_seal_signatures SET signature = ? WHERE position = ?",
        (flipped, position),
    )


def resign_with_another_key(ledger: Ledger) -> None:
    """The newest head signed again by a key of the forger's own, stored beside it."""
    position, digest, sealed_at, _, _ = _signatures(ledger)[-1]
    forged = SealKey.generate().sign(position, digest, sealed_at)
    ledger.db.execute(
        "UPDATE opledger_seal_signatures SET public_key = ?, signature = ? WHERE position = ?",
        (forged.public_key, forged.signature, position),
    )


def alter_result(ledger: Ledger) -> None:
    """A kept result's data changed by hand."""
    ((reference, text),) = ledger.db.query(
        "SELECT result_ref, envelope FROM opledger_results WHERE operation_id = 'op-2'"
    )
    ledger.db.execute(
        "UPDATE opledger_results SET envelope = ? WHERE result_ref = ?",
        (text.replace('"items":[]', '"items":[{"forged":true}]'), reference),
    )


def orphan_result(ledger: Ledger) -> None:
    """A result row no event names."""
    ledger.db.execute(
        "INSERT INTO opledger_results (result_ref, operation_id, envelope)"
        " VALUES ('result:op-3:1', 'op-3', '{}')"
    )


def alter_view(ledger: Ledger) -> None:
    """The read model alone changed: a row's state, a row deleted, a row added."""
    ledger.db.execute(
        "UPDATE opledger_operations SET state = 'succeeded' WHERE operation_id = 'op-5'"
    )
    ledger.db.execute("DELETE FROM opledger_operations WHERE operation_id = 'op-7'")
    ledger.db.execute(
        "INSERT INTO opledger_operations (operation_id, state, tool, actor, tenant, created_at,"
        " updated_at, last_version) VALUES ('op-ghost', 'succeeded', 't', 'a', 'x', '', '', 1)"
    )


def everything(ledger: Ledger) -> None:
    """All of the above at once."""
    for tamper in (
        modify,
        delete,
        delete_last,
        insert_before,
        insert_at_extremes,
        reorder,
        rewrite_seal_hash,
        rewrite_seal_digest,
        mislabel,
        append_forged,
        forge_signature,
        resign_with_another_key,
        alter_result,
        orphan_result,
        alter_view,
    ):
        tamper(ledger)


TAMPERING: dict[str, tuple[Callable[[Ledger], None], set[FindingKind]]] = {
    "modified": (modify, {FindingKind.MODIFIED, FindingKind.CHAIN_BROKEN}),
    "deleted": (delete, {FindingKind.DELETED, FindingKind.VERSION_GAP}),
    "deleted_last": (delete_last, {FindingKind.DELETED}),
    "inserted_at_minus_1": (insert_before, {FindingKind.INSERTED}),
    "inserted_at_extremes": (insert_at_extremes, {FindingKind.INSERTED}),
    "reordered": (reorder, {FindingKind.REORDERED}),
    "seal_hash_rewritten": (rewrite_seal_hash, {FindingKind.MODIFIED}),
    "seal_digest_rewritten": (rewrite_seal_digest, {FindingKind.MODIFIED}),
    "mislabeled": (mislabel, {FindingKind.MISLABELED, FindingKind.VERSION_GAP}),
    "forged_tail": (append_forged, {FindingKind.UNSEALED}),
    "signature_forged": (forge_signature, {FindingKind.SIGNATURE_INVALID}),
    "resigned_by_another_key": (
        resign_with_another_key,
        {FindingKind.UNTRUSTED_KEY, FindingKind.SEAL_UNSIGNED},
    ),
    "result_altered": (alter_result, {FindingKind.RESULT_MISMATCH}),
    "result_orphaned": (orphan_result, {FindingKind.RESULT_ORPHANED}),
    "view_altered": (
        alter_view,
        {FindingKind.VIEW_MISMATCH, FindingKind.VIEW_MISSING, FindingKind.VIEW_EXTRA},
    ),
    "everything": (
        everything,
        set(FindingKind)
        - {
            FindingKind.HEAD_MISMATCH,
            FindingKind.FEED_MISSING,
            FindingKind.FEED_EXTRA,
            FindingKind.FEED_DIFFERENT,
            FindingKind.SET_ASIDE,
        },
    ),
}


def _reference(ledger: Ledger, expected_head: str | None) -> VerificationReport:
    """One sequential pass over the whole table, the whole seal and every signature,
    then the view and the results against the events, from whole tables in memory."""
    rows = list(ledger.stored_rows())
    report = verify_ledger(
        rows,
        ledger.projector.digest_rows(),
        expected_head=expected_head,
        signatures=_signatures(ledger),
        trusted=[SEAL_KEY.public_key],
    )
    ((view_position,),) = ledger.db.query(
        "SELECT position FROM opledger_positions WHERE name = ?", (VIEW_NAME,)
    )
    view = sorted(
        ledger.db.query(f"SELECT {', '.join(ROW_COLUMNS)} FROM opledger_operations"),
        key=lambda row: row[0],
    )
    results = sorted(
        ledger.db.query("SELECT result_ref, operation_id, envelope FROM opledger_results"),
        key=lambda row: (row[1], row[0]),
    )
    model = verify_model(
        sorted(rows, key=lambda row: (row[1], row[2])), view, results, view_position=view_position
    )
    report.findings.extend(model.findings)
    report.view_rows_checked, report.results_checked = model.view_rows, model.results
    return report


@pytest.mark.parametrize("case", sorted(TAMPERING))
def test_chunked_and_parallel_verification_match_one_pass(ledger: Ledger, case: str) -> None:
    tamper, kinds = TAMPERING[case]
    head = ledger.verify(workers=1).head_digest
    tamper(ledger)
    reference = _reference(ledger, head)
    assert kinds <= {finding.kind for finding in reference.findings}, reference.findings

    for chunk_size in CHUNK_SIZES:
        alone = ledger.verify(workers=1, chunk_size=chunk_size, expected_head=head)
        assert alone == reference, (chunk_size, alone.findings, reference.findings)
    for chunk_size in (1, 3, 16):
        shared = ledger.verify(workers=2, chunk_size=chunk_size, expected_head=head)
        assert shared == reference, (chunk_size, shared.findings, reference.findings)


def test_an_untampered_ledger_verifies_the_same_every_way(ledger: Ledger) -> None:
    # Unsealed events too: appended after the last projection.
    ledger.submit(search("op-late"), ALICE)
    reference = _reference(ledger, None)
    assert reference.ok
    assert reference.unsealed_events == 3
    for workers, chunk_size in ((1, 1), (1, 10_000), (2, 1), (2, 5), (3, 4)):
        assert ledger.verify(workers=workers, chunk_size=chunk_size) == reference
    assert ledger.verify() == reference


def test_an_empty_ledger_verifies(storage: StorageConfig) -> None:
    ledger = make_ledger(storage)
    report = ledger.verify(workers=2, chunk_size=1)
    assert report == verify_ledger([], [])
    assert report.ok
    assert report.events_checked == 0


def test_workers_and_chunk_size_must_be_positive(ledger: Ledger) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        ledger.verify(chunk_size=0)
    with pytest.raises(ValueError, match="workers"):
        ledger.verify(workers=0)


def test_a_read_error_reaches_the_caller_and_stops_the_reader(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = parallel._read_range
    calls: list[tuple[Any, ...]] = []

    def failing(*args: Any) -> Any:
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError("the disk is on fire")
        return reads(*args)

    monkeypatch.setattr(parallel, "_read_range", failing)
    with pytest.raises(RuntimeError, match="on fire"):
        ledger.verify(workers=1, chunk_size=5)
    assert not [t for t in threading.enumerate() if t.name == "opledger-verify-reader"]


def test_workers_are_forked_only_from_a_single_thread() -> None:
    # A fork copies the locks other threads hold; with other threads, a fork server.
    if threading.active_count() == 1:
        assert parallel._start_method() == "fork"
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert parallel._start_method() == "forkserver"
    finally:
        stop.set()
        other.join()
