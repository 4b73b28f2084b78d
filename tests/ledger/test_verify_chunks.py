"""Verifying in chunks and stitching finds exactly what one sequential pass finds.

No database here: synthetic ledgers in memory, tampered at random (seeded),
verified by `verify_ledger`, by `verify_chunk` + `stitch` over random chunk
boundaries, and by `_one_pass`, the sequential algorithm as it was before
verification was split into chunks, kept here as the oracle.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import orjson
import pytest

from ledger.audit.verify import (
    Finding,
    FindingKind,
    SealRow,
    StoredRow,
    VerificationReport,
    locate_in,
    stitch,
    verify_chunk,
    verify_ledger,
)
from ledger.domain.hashing import GENESIS_HASH, chain_digest, stored_event_hash

K = FindingKind


def _one_pass(
    rows: Sequence[StoredRow], seal: Sequence[SealRow], expected_head: str | None = None
) -> VerificationReport:
    """The single-pass verifier, findings and all, before chunking existed."""
    report = VerificationReport()
    sealed = {row[0]: row for row in seal}
    sealed_position_of_hash = {row[3]: row[0] for row in seal}
    last_hash: dict[str, str] = {}
    last_version: dict[str, int] = {}
    seen_ids: set[int] = set()
    findings = report.findings
    last_sealed = seal[-1][0] if seal else 0
    for position, operation, version, topic, stored in rows:
        seen_ids.add(position)
        try:
            state = orjson.loads(stored)
        except orjson.JSONDecodeError:
            findings.append(
                Finding(K.MODIFIED, position, operation, version, "stored state is not JSON")
            )
            continue
        if not isinstance(state, dict):  # the old pass crashed here; now it is a finding
            findings.append(
                Finding(
                    K.MODIFIED, position, operation, version, "stored state is not a JSON object"
                )
            )
            continue
        if state.get("originator_id") != operation or state.get("originator_version") != version:
            findings.append(
                Finding(
                    K.MISLABELED,
                    position,
                    operation,
                    version,
                    "row and stored event disagree on operation or version",
                )
            )
        event_hash = stored_event_hash(topic, stored)
        previous_version = last_version.get(operation, 0)
        if version != previous_version + 1:
            findings.append(
                Finding(
                    K.VERSION_GAP,
                    position,
                    operation,
                    version,
                    f"expected version {previous_version + 1} after {previous_version}",
                )
            )
        elif state.get("prev_hash") != last_hash.get(operation, GENESIS_HASH):
            findings.append(
                Finding(
                    K.CHAIN_BROKEN,
                    position,
                    operation,
                    version,
                    "prev_hash is not the hash of the event before it",
                )
            )
        last_hash[operation] = event_hash
        last_version[operation] = version
        seal_row = sealed.get(position)
        if seal_row is None:
            if position <= 0:
                findings.append(
                    Finding(
                        K.INSERTED,
                        position,
                        operation,
                        version,
                        "a stored event is outside the notification order",
                    )
                )
            elif position <= last_sealed:
                findings.append(
                    Finding(
                        K.INSERTED,
                        position,
                        operation,
                        version,
                        "event is not in the sealed digest chain",
                    )
                )
            else:
                report.unsealed_events += 1
        elif seal_row[3] != event_hash:
            elsewhere = sealed_position_of_hash.get(event_hash)
            if elsewhere is not None and elsewhere != position:
                findings.append(
                    Finding(
                        K.REORDERED,
                        position,
                        operation,
                        version,
                        f"this event was sealed at #{elsewhere}",
                    )
                )
            else:
                findings.append(
                    Finding(
                        K.MODIFIED,
                        position,
                        operation,
                        version,
                        "event hash differs from the sealed hash",
                    )
                )
    report.events_checked = len(seen_ids)
    report.sealed_events = (
        report.events_checked
        - report.unsealed_events
        - sum(1 for f in findings if f.kind is K.INSERTED)
    )
    digest = GENESIS_HASH
    for notification_id, operation, version, sealed_hash, running in seal:
        if notification_id not in seen_ids:
            findings.append(
                Finding(K.DELETED, notification_id, operation, version, "a sealed event is missing")
            )
        digest = chain_digest(digest, sealed_hash)
        if running != digest:
            findings.append(
                Finding(
                    K.MODIFIED,
                    notification_id,
                    operation,
                    version,
                    "the sealed running digest does not recompute",
                )
            )
            digest = running
    report.operations_checked = len(last_version)
    report.head_digest = seal[-1][4] if seal else GENESIS_HASH
    if expected_head is not None and report.head_digest != expected_head:
        findings.append(
            Finding(
                K.HEAD_MISMATCH, None, "", None, "the sealed head digest is not the one expected"
            )
        )
    findings.sort(key=lambda f: (f.notification_id is None, f.notification_id or 0))
    return report


def _ledger(rng: random.Random, operations: int = 8) -> tuple[list[StoredRow], list[SealRow]]:
    """Interleaved operations of 1-6 events each, and their seal."""
    pending = {f"op-{n}": rng.randint(1, 6) for n in range(operations)}
    last = dict.fromkeys(pending, (0, GENESIS_HASH))
    rows: list[StoredRow] = []
    seal: list[SealRow] = []
    running = GENESIS_HASH
    while pending:
        operation = rng.choice(sorted(pending))
        version, prev_hash = last[operation][0] + 1, last[operation][1]
        topic = rng.choice(["t:Proposed", "t:Validated", "t:Succeeded"])
        stored = orjson.dumps(
            {
                "originator_id": operation,
                "originator_version": version,
                "prev_hash": prev_hash,
                "payload": rng.random(),
            }
        )
        position = len(rows) + 1
        event_hash = stored_event_hash(topic, stored)
        running = chain_digest(running, event_hash)
        rows.append((position, operation, version, topic, stored))
        seal.append((position, operation, version, event_hash, running))
        last[operation] = (version, event_hash)
        pending[operation] -= 1
        if not pending[operation]:
            del pending[operation]
    return rows, seal


def _tamper(
    rng: random.Random, rows: list[StoredRow], seal: list[SealRow]
) -> tuple[list[StoredRow], list[SealRow]]:
    """Up to six random faults of every kind, in the rows and in the seal."""
    table: list[list[Any]] = [list(row) for row in rows]
    chain: list[list[Any]] = [list(row) for row in seal]
    for _ in range(rng.randint(1, 6)):
        fault = rng.randrange(12)
        if fault == 0 and table:  # modified
            row = rng.choice(table)
            state = orjson.loads(row[4])
            state["payload"] = "forged"
            row[4] = orjson.dumps(state)
        elif fault == 1 and table:  # deleted
            table.pop(rng.randrange(len(table)))
        elif fault == 2 and table:  # a copy inserted elsewhere
            row = list(rng.choice(table))
            row[0] = rng.choice([-1, 0, -(2**63), 2**63 - 1, rng.randint(1, len(rows) + 5)])
            if row[0] not in {other[0] for other in table}:
                table.append(row)
        elif fault == 3 and len(table) > 1:  # two positions swap their events
            a, b = rng.sample(range(len(table)), 2)
            for field in (1, 2, 3, 4):
                table[a][field], table[b][field] = table[b][field], table[a][field]
        elif fault == 4 and table:  # mislabeled
            rng.choice(table)[2] += rng.choice([1, -1])
        elif fault == 5 and table:  # not an event
            rng.choice(table)[4] = rng.choice([b"not json", b"[1, 2]", b"null", b"7"])
        elif fault == 6 and chain:  # a seal row takes another's hash
            rng.choice(chain)[3] = rng.choice(chain)[3]
        elif fault == 7 and chain:  # a running digest rewritten
            rng.choice(chain)[4] = "f" * 64
        elif fault == 8 and chain:  # a seal row removed
            chain.pop(rng.randrange(len(chain)))
        elif fault == 9 and chain:  # the seal cut short
            chain.pop()
        elif fault == 10 and table:  # a broken link
            row = rng.choice(table)
            state = orjson.loads(row[4])
            state["prev_hash"] = "a" * 64
            row[4] = orjson.dumps(state)
        elif fault == 11 and table:  # a row moved to another operation
            rng.choice(table)[1] = rng.choice(["op-x", table[0][1]])
    table.sort(key=lambda row: row[0])
    chain.sort(key=lambda row: row[0])
    return [tuple(row) for row in table], [tuple(row) for row in chain]


def _chunked(
    rows: Sequence[StoredRow], seal: Sequence[SealRow], bounds: Sequence[int], head: str | None
) -> VerificationReport:
    """Verify the ranges (-inf, b0], (b0, b1], ..., (bn, +inf) apart, then stitch them."""
    last_sealed = seal[-1][0] if seal else 0
    edges: list[int | None] = [None, *sorted(set(bounds)), None]
    summaries = []
    for low, high in pairwise(edges):

        def inside(position: int, low: int | None = low, high: int | None = high) -> bool:
            return (low is None or position > low) and (high is None or position <= high)

        summaries.append(
            verify_chunk(
                [row for row in rows if inside(row[0])],
                [row for row in seal if inside(row[0])],
                last_sealed,
            )
        )
    return stitch(summaries, lambda hashes: locate_in(seal, hashes), expected_head=head)


@pytest.mark.parametrize("seed", range(10))
def test_chunks_find_what_one_pass_finds(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        rows, seal = _tamper(rng, *_ledger(rng))
        head = rng.choice([None, seal[-1][4] if seal else GENESIS_HASH, "f" * 64])
        expected = _one_pass(rows, seal, head)
        assert verify_ledger(rows, seal, expected_head=head) == expected
        top = len(rows) + 6
        for bounds in (
            list(range(0, top)),  # a boundary at every position
            rng.sample(range(-2, top), k=min(5, top)),
            [rng.randint(0, top)],
        ):
            assert _chunked(rows, seal, bounds, head) == expected, (seed, bounds)


def test_an_untampered_ledger_has_no_findings_in_any_chunking() -> None:
    rows, seal = _ledger(random.Random(7), operations=20)
    expected = _one_pass(rows, seal)
    assert expected.ok
    assert verify_ledger(rows, seal) == expected
    for size in (1, 2, 5, 50):
        assert _chunked(rows, seal, list(range(0, len(rows), size)), None) == expected


def test_findings_at_one_position_come_in_the_order_one_pass_finds_them() -> None:
    rows, seal = _ledger(random.Random(3))
    position = seal[4][0]
    forged: list[Any] = list(seal[4])
    forged[3] = "e" * 64  # the sealed hash: the event no longer matches, nor the digest
    seal[4] = tuple(forged)
    row: list[Any] = list(rows[4])
    row[2] += 5  # and the row claims another version
    rows[4] = tuple(row)
    expected = [K.MISLABELED, K.VERSION_GAP, K.MODIFIED, K.MODIFIED]
    for report in (verify_ledger(rows, seal), _chunked(rows, seal, [position - 1], None)):
        at_position = [f for f in report.findings if f.notification_id == position]
        assert [f.kind for f in at_position] == expected
        assert at_position[2].detail == "event hash differs from the sealed hash"
        assert at_position[3].detail == "the sealed running digest does not recompute"
        assert report == _one_pass(rows, seal)
