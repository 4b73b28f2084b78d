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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import orjson

from ledger.domain.hashing import GENESIS_HASH, chain_digest, stored_event_hash

__all__ = ["Finding", "FindingKind", "StoredRow", "VerificationReport", "verify_ledger"]


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
        return f"{self.kind.value}: {where}{self.operation_id}{version}: {self.detail}"


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


def verify_ledger(
    rows: Iterable[StoredRow],
    seal: Sequence[tuple[int, str, int, str, str]],
    *,
    expected_head: str | None = None,
) -> VerificationReport:
    """Verify every stored event against its chain and the sealed digest.

    `rows` are every row of the events table in position order, read directly
    rather than through the library's notification log: a row slipped in at a
    position the log never shows (zero or negative) would still be replayed
    into its operation, so it must be seen here too.
    """
    report = VerificationReport()
    sealed = {row[0]: row for row in seal}
    sealed_position_of_hash = {row[3]: row[0] for row in seal}
    last_hash: dict[str, str] = {}
    last_version: dict[str, int] = {}
    seen_ids: set[int] = set()
    digest = GENESIS_HASH
    findings = report.findings
    last_sealed = seal[-1][0] if seal else 0

    loads, hash_of = orjson.loads, stored_event_hash
    for position, operation, version, topic, stored in rows:
        seen_ids.add(position)
        try:
            state = loads(stored)
        except orjson.JSONDecodeError:
            findings.append(
                Finding(
                    FindingKind.MODIFIED, position, operation, version, "stored state is not JSON"
                )
            )
            continue
        if state.get("originator_id") != operation or state.get("originator_version") != version:
            findings.append(
                Finding(
                    FindingKind.MISLABELED,
                    position,
                    operation,
                    version,
                    "row and stored event disagree on operation or version",
                )
            )
        event_hash = hash_of(topic, stored)
        previous_version = last_version.get(operation, 0)
        if version != previous_version + 1:
            findings.append(
                Finding(
                    FindingKind.VERSION_GAP,
                    position,
                    operation,
                    version,
                    f"expected version {previous_version + 1} after {previous_version}",
                )
            )
        elif state.get("prev_hash") != last_hash.get(operation, GENESIS_HASH):
            findings.append(
                Finding(
                    FindingKind.CHAIN_BROKEN,
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
                        FindingKind.INSERTED,
                        position,
                        operation,
                        version,
                        "a stored event is outside the notification order",
                    )
                )
            elif position <= last_sealed:
                findings.append(
                    Finding(
                        FindingKind.INSERTED,
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
                        FindingKind.REORDERED,
                        position,
                        operation,
                        version,
                        f"this event was sealed at #{elsewhere}",
                    )
                )
            else:
                findings.append(
                    Finding(
                        FindingKind.MODIFIED,
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
        - sum(1 for f in findings if f.kind is FindingKind.INSERTED)
    )

    for notification_id, operation, version, sealed_hash, running in seal:
        if notification_id not in seen_ids:
            findings.append(
                Finding(
                    FindingKind.DELETED,
                    notification_id,
                    operation,
                    version,
                    "a sealed event is missing",
                )
            )
        # The seal must be a chain of itself, or someone rewrote it.
        digest = chain_digest(digest, sealed_hash)
        if running != digest:
            findings.append(
                Finding(
                    FindingKind.MODIFIED,
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
                FindingKind.HEAD_MISMATCH,
                None,
                "",
                None,
                "the sealed head digest is not the one expected",
            )
        )
    findings.sort(key=lambda f: (f.notification_id is None, f.notification_id or 0))
    return report
