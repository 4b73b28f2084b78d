"""Verifying the ledger: every operation's hash chain and the global digest.

The verifier reads stored rows only (no domain classes), recomputes each
event's hash from its stored JSON, and checks three things:

1. each row's JSON names the same operation and version as the row itself;
2. each operation's events have versions 1..n and each `prev_hash` is the
   hash of the event before it;
3. the global order matches the digest chain the projector sealed: the same
   event hash at every notification ID, and the same running digest.

A modified event breaks (3) at its position (and (2) at its successor); a
deleted one leaves a sealed position without an event and a version gap; an
inserted one takes a position the seal does not know; a reordering puts a
sealed hash at another position. `expected_head` lets an auditor compare the
final digest with one they recorded earlier, which also catches a forger who
rewrote the seal itself.

The work splits by position: `verify_chunk` checks one contiguous range of
positions (its rows and its seal rows) on its own, and `stitch` joins the
chunks in position order, deciding the few checks that cross a boundary: the
first event of each operation in a chunk against the last one before it, the
first seal row's running digest against the previous chunk's, and whether a
hash that differs from the seal was sealed elsewhere. Chunks can therefore be
verified in parallel (`ledger.audit.parallel`) with exactly the findings of
one sequential pass, which `verify_ledger` is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import islice
from typing import Any

import orjson

from ledger.domain.hashing import GENESIS_HASH, chain_digest

__all__ = [
    "ChunkSummary",
    "Finding",
    "FindingKind",
    "HashLocator",
    "SealRow",
    "StoredRow",
    "VerificationReport",
    "locate_in",
    "stitch",
    "verify_chunk",
    "verify_ledger",
]


class FindingKind(StrEnum):
    """What kind of fault verification found."""

    MODIFIED = "modified"
    DELETED = "deleted"
    INSERTED = "inserted"
    REORDERED = "reordered"
    CHAIN_BROKEN = "chain_broken"
    VERSION_GAP = "version_gap"
    MISLABELED = "mislabeled"
    HEAD_MISMATCH = "head_mismatch"


@dataclass(frozen=True, slots=True)
class Finding:
    """One fault, and where: a notification ID and the operation and version there."""

    kind: FindingKind
    notification_id: int | None
    operation_id: str
    version: int | None
    detail: str

    def describe(self) -> str:
        """One line for people."""
        where = f"#{self.notification_id} " if self.notification_id is not None else ""
        version = f" v{self.version}" if self.version is not None else ""
        subject = f"{where}{self.operation_id}{version}".strip()
        return f"{self.kind.value}: {subject + ': ' if subject else ''}{self.detail}"


@dataclass(slots=True)
class VerificationReport:
    """The result of one verification run."""

    events_checked: int = 0
    operations_checked: int = 0
    sealed_events: int = 0
    unsealed_events: int = 0
    head_digest: str = GENESIS_HASH
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return not self.findings


StoredRow = tuple[int, str, int, str, bytes]
"""(position in the global order, operation ID, version, topic, stored state)."""

SealRow = tuple[int, str, int, str, str]
"""(notification ID, operation ID, version, event hash, running digest)."""

HashLocator = Callable[[Collection[str]], Mapping[str, int]]
"""Given event hashes, the last sealed notification ID of each one that is sealed."""

# Several findings can share a position. These ranks order them as one pass
# over the rows and then over the seal finds them, so that chunks verified
# apart and sorted by (position, rank) report exactly what one pass reports.
_ROW, _CHAIN, _SEAL, _DELETED, _RUNNING = range(5)

_PositionedFinding = tuple[int, int, Finding]
"""(position, rank, finding)."""


@dataclass(slots=True)
class ChunkSummary:
    """What verifying one range of positions found, and what only the whole can decide.

    Compact on purpose: it crosses a process boundary. Its size grows with
    the operations and faults in the range, not with the events.
    """

    events: int = 0
    """Rows read in the range."""
    unsealed: int = 0
    """Rows after the last sealed position (not yet projected)."""
    inserted: int = 0
    """Rows found INSERTED."""
    findings: list[_PositionedFinding] = field(default_factory=list)
    """Faults decided inside the range, as (position, rank, finding)."""
    firsts: dict[str, tuple[int, int, Any]] = field(default_factory=dict)
    """Per operation, its first decodable row here: (position, version, prev_hash)."""
    lasts: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Per operation, its last decodable row here: (version, event hash)."""
    mismatches: list[tuple[int, str, int, str]] = field(default_factory=list)
    """Rows whose hash is not the one sealed at their position: (position,
    operation, version, event hash); REORDERED or MODIFIED, by where else that
    hash was sealed."""
    first_seal: SealRow | None = None
    """The range's first seal row, whose running digest continues the previous range's."""
    last_running: str | None = None
    """The range's last sealed running digest (None without seal rows)."""


def verify_chunk(
    rows: Iterable[StoredRow], seal: Sequence[SealRow], last_sealed: int
) -> ChunkSummary:
    """Verify the rows and the seal rows of one range of positions.

    `rows` and `seal` must be every event row and every seal row whose
    position lies in the same range, each in position order; `last_sealed`
    is the highest sealed position of the whole ledger (0 without a seal).
    """
    summary = ChunkSummary()
    findings, firsts, lasts = summary.findings, summary.firsts, summary.lasts
    mismatches = summary.mismatches
    # Seal rows not yet matched by an event; what is left at the end was deleted.
    unmatched = {row[0]: row[3] for row in seal}
    events = unsealed = inserted = 0
    loads, sha256 = orjson.loads, hashlib.sha256
    # stored_event_hash(topic, state) is SHA-256 over topic, newline, state:
    # copying a hasher that has taken the (few distinct) topic prefixes saves
    # encoding the topic and one update per event.
    prefixes: dict[str, Any] = {}

    for position, operation, version, topic, stored in rows:
        events += 1
        try:
            state = loads(stored)
            detail = "" if type(state) is dict else "stored state is not a JSON object"
        except orjson.JSONDecodeError:
            detail = "stored state is not JSON"
        if detail:
            # Not an event at all: nothing in it can be checked or chained.
            findings.append(
                (
                    position,
                    _ROW,
                    Finding(FindingKind.MODIFIED, position, operation, version, detail),
                )
            )
            unmatched.pop(position, None)
            continue
        if state.get("originator_id") != operation or state.get("originator_version") != version:
            findings.append(
                (
                    position,
                    _ROW,
                    Finding(
                        FindingKind.MISLABELED,
                        position,
                        operation,
                        version,
                        "row and stored event disagree on operation or version",
                    ),
                )
            )
        prefix = prefixes.get(topic)
        if prefix is None:
            prefix = prefixes[topic] = sha256(topic.encode())
            prefix.update(b"\n")
        hasher = prefix.copy()
        hasher.update(stored)
        event_hash: str = hasher.hexdigest()

        last = lasts.get(operation)
        if last is None:
            # Its predecessor, if any, is in an earlier range: `stitch` checks it.
            firsts[operation] = (position, version, state.get("prev_hash"))
        else:
            previous_version, previous_hash = last
            if version != previous_version + 1:
                findings.append(
                    (position, _CHAIN, _version_gap(position, operation, version, previous_version))
                )
            elif state.get("prev_hash") != previous_hash:
                findings.append((position, _CHAIN, _chain_broken(position, operation, version)))
        lasts[operation] = (version, event_hash)

        sealed_hash = unmatched.pop(position, None)
        if sealed_hash is None:
            if position <= 0:
                inserted += 1
                findings.append(
                    (
                        position,
                        _SEAL,
                        Finding(
                            FindingKind.INSERTED,
                            position,
                            operation,
                            version,
                            "a stored event is outside the notification order",
                        ),
                    )
                )
            elif position <= last_sealed:
                inserted += 1
                findings.append(
                    (
                        position,
                        _SEAL,
                        Finding(
                            FindingKind.INSERTED,
                            position,
                            operation,
                            version,
                            "event is not in the sealed digest chain",
                        ),
                    )
                )
            else:
                unsealed += 1
        elif sealed_hash != event_hash:
            mismatches.append((position, operation, version, event_hash))

    summary.events, summary.unsealed, summary.inserted = events, unsealed, inserted
    if not seal:
        return summary
    summary.first_seal = first = seal[0]
    if unmatched:
        for notification_id, operation, version, _, _ in seal:
            if notification_id in unmatched:
                findings.append(
                    (
                        notification_id,
                        _DELETED,
                        Finding(
                            FindingKind.DELETED,
                            notification_id,
                            operation,
                            version,
                            "a sealed event is missing",
                        ),
                    )
                )
    # The seal must be a chain of itself, or someone rewrote it. Each row's
    # digest depends only on the row before it, so the range checks all but
    # its first row, which `stitch` checks against the previous range.
    previous = first[4]
    for notification_id, operation, version, sealed_hash, running in islice(seal, 1, None):
        try:  # chain_digest(previous, sealed_hash), inlined: it runs once per event
            digest = sha256((previous + ":" + sealed_hash).encode()).hexdigest()
        except TypeError:  # a value that is not text, in a tampered seal
            digest = chain_digest(previous, sealed_hash)
        if digest != running:
            findings.append(
                (notification_id, _RUNNING, _rewritten_seal(notification_id, operation, version))
            )
        previous = running
    summary.last_running = previous
    return summary


def stitch(
    chunks: Iterable[ChunkSummary],
    locate: HashLocator,
    *,
    expected_head: str | None = None,
) -> VerificationReport:
    """Join the summaries of consecutive ranges, in position order, into one report.

    `locate` finds where mismatched hashes were sealed (to tell a reordering
    from a modification); it is called once, only if some hash mismatched.
    """
    report = VerificationReport()
    found: list[_PositionedFinding] = []
    latest: dict[str, tuple[int, str]] = {}
    mismatches: list[tuple[int, str, int, str]] = []
    running = GENESIS_HASH
    events = unsealed = inserted = 0
    for chunk in chunks:
        events += chunk.events
        unsealed += chunk.unsealed
        inserted += chunk.inserted
        found.extend(chunk.findings)
        mismatches.extend(chunk.mismatches)
        for operation, (position, version, prev_hash) in chunk.firsts.items():
            previous_version, previous_hash = latest.get(operation, (0, GENESIS_HASH))
            if version != previous_version + 1:
                found.append(
                    (position, _CHAIN, _version_gap(position, operation, version, previous_version))
                )
            elif prev_hash != previous_hash:
                found.append((position, _CHAIN, _chain_broken(position, operation, version)))
        latest.update(chunk.lasts)
        if chunk.first_seal is not None and chunk.last_running is not None:
            notification_id, operation, version, sealed_hash, first_running = chunk.first_seal
            if chain_digest(running, sealed_hash) != first_running:
                found.append(
                    (
                        notification_id,
                        _RUNNING,
                        _rewritten_seal(notification_id, operation, version),
                    )
                )
            running = chunk.last_running

    if mismatches:
        sealed_at = locate({event_hash for *_, event_hash in mismatches})
        for position, operation, version, event_hash in mismatches:
            elsewhere = sealed_at.get(event_hash)
            if elsewhere is not None and elsewhere != position:
                finding = Finding(
                    FindingKind.REORDERED,
                    position,
                    operation,
                    version,
                    f"this event was sealed at #{elsewhere}",
                )
            else:
                finding = Finding(
                    FindingKind.MODIFIED,
                    position,
                    operation,
                    version,
                    "event hash differs from the sealed hash",
                )
            found.append((position, _SEAL, finding))

    found.sort(key=lambda item: (item[0], item[1]))
    report.findings = [finding for _, _, finding in found]
    report.events_checked = events
    report.unsealed_events = unsealed
    report.sealed_events = events - unsealed - inserted
    report.operations_checked = len(latest)
    report.head_digest = running
    if expected_head is not None and running != expected_head:
        report.findings.append(
            Finding(
                FindingKind.HEAD_MISMATCH,
                None,
                "",
                None,
                "the sealed head digest is not the one expected",
            )
        )
    return report


def verify_ledger(
    rows: Iterable[StoredRow],
    seal: Sequence[SealRow],
    *,
    expected_head: str | None = None,
) -> VerificationReport:
    """Verify every stored event against its chain and the sealed digest.

    `rows` are every row of the events table in position order, read directly
    rather than through the library's notification log: a row slipped in at a
    position the log never shows (zero or negative) would still be replayed
    into its operation, so it must be seen here too. `seal` is the whole
    digest chain in notification order. One range, in this process; see
    `ledger.audit.parallel` for a ledger read range by range from storage.
    """
    last_sealed = seal[-1][0] if seal else 0
    return stitch(
        [verify_chunk(rows, seal, last_sealed)],
        lambda hashes: locate_in(seal, hashes),
        expected_head=expected_head,
    )


def locate_in(seal: Iterable[SealRow], hashes: Collection[str]) -> dict[str, int]:
    """The last notification ID at which each of `hashes` is sealed in `seal`."""
    return {row[3]: row[0] for row in seal if row[3] in hashes}


def _version_gap(position: int, operation: str, version: int, previous: int) -> Finding:
    return Finding(
        FindingKind.VERSION_GAP,
        position,
        operation,
        version,
        f"expected version {previous + 1} after {previous}",
    )


def _chain_broken(position: int, operation: str, version: int) -> Finding:
    return Finding(
        FindingKind.CHAIN_BROKEN,
        position,
        operation,
        version,
        "prev_hash is not the hash of the event before it",
    )


def _rewritten_seal(notification_id: int, operation: str, version: int) -> Finding:
    return Finding(
        FindingKind.MODIFIED,
        notification_id,
        operation,
        version,
        "the sealed running digest does not recompute",
    )
