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

The seal is only worth what its writer is: it is signed, head by head, by the
ledger service's key (`ledger.audit.seal`). Given a `SealPolicy` (the keys the
auditor trusts, and the last head they signed, found first by
`find_signed_head`), each range also checks every signature in it against
the trusted keys and the seal row it signs, and names each event past the
signed head that is older than the seal grace (or dated ahead of it): nobody
who holds the key vouched for it. Without a policy only the chain is checked,
as before signatures existed.

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
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from functools import lru_cache
from itertools import islice
from typing import Any

import orjson

from ledger.adapters.event_tables import StoredRow
from ledger.audit.seal import SignedHead, TrustedKeys
from ledger.domain.hashing import GENESIS_HASH, chain_digest

__all__ = [
    "DEFAULT_SEAL_GRACE",
    "MAX_LISTED",
    "ChunkSummary",
    "Finding",
    "FindingKind",
    "HashLocator",
    "SealPolicy",
    "SealRow",
    "SignatureRow",
    "StoredRow",
    "VerificationReport",
    "check_anchor",
    "find_signed_head",
    "locate_in",
    "stitch",
    "verify_chunk",
    "verify_ledger",
]

DEFAULT_SEAL_GRACE = timedelta(seconds=60)
"""How long an event may stay unsealed before verification calls it a fault. The
service seals within a few seconds (its sweep runs every two); a minute leaves
room for a restart."""

MAX_LISTED = 100
"""Unsealed events named one by one; the rest are counted in one finding."""


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
    UNSEALED = "unsealed"
    """An event past the last signed head, older than the seal grace (or dated ahead)."""
    SEAL_UNSIGNED = "seal_unsigned"
    """Seal rows past the last signed head: nobody who holds the key wrote them."""
    SIGNATURE_INVALID = "signature_invalid"
    """A seal signature that does not verify, or signs a digest the seal does not have."""
    UNTRUSTED_KEY = "untrusted_key"
    """Seal signatures by a key the auditor did not give (or no key was given)."""
    RESULT_MISMATCH = "result_mismatch"
    """A kept result whose hash is not the one its event recorded."""
    RESULT_ORPHANED = "result_orphaned"
    """A kept result no event of its operation names."""
    VIEW_MISMATCH = "view_mismatch"
    """A read-model row that differs from the projection of its operation's events."""
    VIEW_MISSING = "view_missing"
    """An operation the view has taken in, without a read-model row."""
    VIEW_EXTRA = "view_extra"
    """A read-model row of no operation the view has taken in."""
    FEED_MISSING = "feed_missing"
    """A stored event the feed does not have."""
    FEED_EXTRA = "feed_extra"
    """A feed event the store does not have (deleted from the store?)."""
    FEED_DIFFERENT = "feed_different"
    """A stored event that differs from the feed's copy."""
    SET_ASIDE = "set_aside"
    """A notice, not a fault: an event the relay set aside instead of publishing."""


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
    signed_head: SignedHead | None = None
    """The last head signed by a trusted key and matching the seal (None: none)."""
    unsigned_events: int = 0
    """Events past the signed head (sealed or not): nobody who holds the key vouched for them."""
    view_rows_checked: int = 0
    results_checked: int = 0
    feed_events_checked: int | None = None
    """Feed messages compared with the store (None: the feed was not read)."""
    notices: list[Finding] = field(default_factory=list)
    """Worth knowing, not faults (events set aside by the relay)."""

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return not self.findings


SealRow = tuple[int, str, int, str, str]
"""(notification ID, operation ID, version, event hash, running digest)."""

SignatureRow = tuple[int, str, str, str, str]
"""(position, running digest, sealed at, public key, signature): one signed head."""


@dataclass(frozen=True, slots=True)
class SealPolicy:
    """What decides whether the seal vouches for an event (given to every chunk).

    Plain values only: it crosses process boundaries.
    """

    trusted: tuple[str, ...]
    """The public keys the auditor trusts."""
    signed_head: int
    """The position of the last trusted signed head (`find_signed_head`); 0: none."""
    now: datetime
    grace: timedelta = DEFAULT_SEAL_GRACE


@lru_cache(maxsize=8)
def _trusted(keys: tuple[str, ...]) -> TrustedKeys:
    return TrustedKeys(keys)


def find_signed_head(
    signatures: Iterable[SignatureRow],
    sealed_digest: Callable[[int], str | None],
    trusted: TrustedKeys,
) -> SignedHead | None:
    """The first of `signatures` (give them newest first) that a trusted key signed
    and whose digest is the seal's at its position (`sealed_digest`)."""
    for row in signatures:
        head = SignedHead.from_row(row)
        if trusted.valid(head) and sealed_digest(head.position) == head.digest:
            return head
    return None


def check_anchor(
    anchor: SignedHead, sealed_digest: str | None, signed_head: SignedHead | None
) -> list[Finding]:
    """Findings for a head the auditor kept earlier (`audit head`) against the ledger now."""
    where = f"the head anchored at #{anchor.position}"
    if sealed_digest is None:
        return [
            Finding(
                FindingKind.HEAD_MISMATCH,
                anchor.position,
                "",
                None,
                f"{where} is not in the seal any more (sealed events were removed)",
            )
        ]
    if sealed_digest != anchor.digest:
        return [
            Finding(
                FindingKind.HEAD_MISMATCH,
                anchor.position,
                "",
                None,
                f"the seal's digest at #{anchor.position} is not the anchored one",
            )
        ]
    if signed_head is None or signed_head.position < anchor.position:
        return [
            Finding(
                FindingKind.HEAD_MISMATCH,
                anchor.position,
                "",
                None,
                f"{where} is past the last signed head (signatures were removed)",
            )
        ]
    return []

HashLocator = Callable[[Collection[str]], Mapping[str, int]]
"""Given event hashes, the last sealed notification ID of each one that is sealed."""

# Several findings can share a position. These ranks order them as one pass
# over the rows and then over the seal finds them, so that chunks verified
# apart and sorted by (position, rank) report exactly what one pass reports.
_ROW, _CHAIN, _SEAL, _DELETED, _RUNNING, _SIGNATURE, _UNSEALED = range(7)

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
    unsigned: int = 0
    """Rows past the signed head."""
    stale: list[_PositionedFinding] = field(default_factory=list)
    """The first `MAX_LISTED` UNSEALED findings of the range (position order)."""
    stale_count: int = 0
    """All UNSEALED rows of the range."""
    unsigned_seal: tuple[int, int, int] | None = None
    """Seal rows past the signed head: (count, first position, last position)."""
    untrusted: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """Per untrusted public key, its signatures here: (count, first position, last)."""
    signatures: int = 0
    """Signature rows read in the range."""


def verify_chunk(
    rows: Iterable[StoredRow],
    seal: Sequence[SealRow],
    last_sealed: int,
    *,
    signatures: Sequence[SignatureRow] = (),
    policy: SealPolicy | None = None,
) -> ChunkSummary:
    """Verify the rows, the seal rows and the seal signatures of one range of positions.

    `rows`, `seal` and `signatures` must be every event row, seal row and
    signature row whose position lies in the same range, each in position
    order; `last_sealed` is the highest sealed position of the whole ledger
    (0 without a seal). Without `policy` the signatures are not looked at
    (the digest chain alone, as before signatures existed).
    """
    summary = ChunkSummary()
    signed_head = policy.signed_head if policy is not None else None
    earliest = latest = datetime.min.replace(tzinfo=UTC)
    if policy is not None:
        earliest, latest = policy.now - policy.grace, policy.now + policy.grace
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
        if signed_head is not None and position > signed_head:
            summary.unsigned += 1
            stale = _stale(state.get("timestamp"), earliest, latest)
            if stale:
                summary.stale_count += 1
                if len(summary.stale) < MAX_LISTED:
                    summary.stale.append(
                        (
                            position,
                            _UNSEALED,
                            Finding(FindingKind.UNSEALED, position, operation, version, stale),
                        )
                    )

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
    if policy is not None:
        _check_signatures(summary, seal, signatures, policy)
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


def _stale(timestamp: Any, earliest: datetime, latest: datetime) -> str:
    """Why an event past the signed head is a fault ("" if it is young enough to wait)."""
    try:
        moment = datetime.fromisoformat(timestamp)
    except (TypeError, ValueError):
        return "not sealed, and its timestamp is not a time"
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    if moment < earliest:
        return "not sealed by a trusted key, though older than the seal grace"
    if moment > latest:
        return "not sealed, and dated in the future"
    return ""


def _check_signatures(
    summary: ChunkSummary,
    seal: Sequence[SealRow],
    signatures: Sequence[SignatureRow],
    policy: SealPolicy,
) -> None:
    """Every signature of the range against the trusted keys and the range's seal rows."""
    past = [row[0] for row in seal if row[0] > policy.signed_head]
    if past:
        summary.unsigned_seal = (len(past), past[0], past[-1])
    summary.signatures = len(signatures)
    if not signatures:
        return
    trusted = _trusted(policy.trusted)
    sealed = {row[0]: row[4] for row in seal}
    for row in signatures:
        head = SignedHead.from_row(row)
        if not trusted.trusts(head.public_key):
            count, first, _ = summary.untrusted.get(head.public_key, (0, head.position, 0))
            summary.untrusted[head.public_key] = (count + 1, first, head.position)
            continue
        if not trusted.valid(head):
            detail = "the seal signature does not verify"
        elif head.position not in sealed:
            detail = "a signed head at a position the seal does not have"
        elif sealed[head.position] != head.digest:
            detail = "the signed digest is not the seal's running digest here"
        else:
            continue
        summary.findings.append(
            (
                head.position,
                _SIGNATURE,
                Finding(FindingKind.SIGNATURE_INVALID, head.position, "", None, detail),
            )
        )


def _seal_findings(chunks: Sequence[ChunkSummary], policy: SealPolicy) -> list[Finding]:
    """The findings about the seal as a whole, from every range's summary."""
    findings: list[Finding] = []
    if not policy.trusted and any(c.signatures or c.events for c in chunks):
        findings.append(
            Finding(
                FindingKind.UNTRUSTED_KEY,
                None,
                "",
                None,
                "no trusted public key was given: no seal signature could be checked",
            )
        )
    untrusted: dict[str, tuple[int, int, int]] = {}
    for chunk in chunks:
        for key, (count, first, last) in chunk.untrusted.items():
            known = untrusted.get(key)
            untrusted[key] = (
                (count, first, last) if known is None else (known[0] + count, known[1], last)
            )
    for key, (count, first, last) in untrusted.items():
        findings.append(
            Finding(
                FindingKind.UNTRUSTED_KEY,
                None,
                "",
                None,
                f"{count} seal signature(s) by {key}, a key not trusted (#{first}..#{last})",
            )
        )
    unsigned = [c.unsigned_seal for c in chunks if c.unsigned_seal is not None]
    if unsigned:
        count = sum(u[0] for u in unsigned)
        findings.append(
            Finding(
                FindingKind.SEAL_UNSIGNED,
                None,
                "",
                None,
                f"{count} seal row(s) past the last signed head (#{unsigned[0][1]}.."
                f"#{unsigned[-1][2]}) are signed by no trusted key",
            )
        )
    stale_count = sum(c.stale_count for c in chunks)
    if stale_count > MAX_LISTED:
        findings.append(
            Finding(
                FindingKind.UNSEALED,
                None,
                "",
                None,
                f"and {stale_count - MAX_LISTED} more unsealed event(s) past the signed head",
            )
        )
    return findings


def stitch(
    chunks: Iterable[ChunkSummary],
    locate: HashLocator,
    *,
    expected_head: str | None = None,
    policy: SealPolicy | None = None,
    signed_head: SignedHead | None = None,
) -> VerificationReport:
    """Join the summaries of consecutive ranges, in position order, into one report.

    `locate` finds where mismatched hashes were sealed (to tell a reordering
    from a modification); it is called once, only if some hash mismatched.
    `policy` and `signed_head`: what the chunks were verified with (see
    `verify_chunk`), and the head its `signed_head` position names.
    """
    report = VerificationReport()
    seen: list[ChunkSummary] = []
    stale: list[_PositionedFinding] = []
    found: list[_PositionedFinding] = []
    latest: dict[str, tuple[int, str]] = {}
    mismatches: list[tuple[int, str, int, str]] = []
    running = GENESIS_HASH
    events = unsealed = inserted = 0
    for chunk in chunks:
        if policy is not None:
            seen.append(_light(chunk))
            stale.extend(chunk.stale)
            report.unsigned_events += chunk.unsigned
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

    stale.sort(key=lambda item: item[0])
    found.extend(stale[:MAX_LISTED])
    found.sort(key=lambda item: (item[0], item[1]))
    report.findings = [finding for _, _, finding in found]
    if policy is not None:
        report.findings.extend(_seal_findings(seen, policy))
        report.signed_head = signed_head
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
    signatures: Sequence[SignatureRow] | None = None,
    trusted: Sequence[str] = (),
    now: datetime | None = None,
    grace: timedelta = DEFAULT_SEAL_GRACE,
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
    if signatures is None:
        return stitch(
            [verify_chunk(rows, seal, last_sealed)],
            lambda hashes: locate_in(seal, hashes),
            expected_head=expected_head,
        )
    # With `signatures` (all of them, in position order): the seal's signatures
    # are checked too, with `trusted` keys, as `ledger.audit.parallel` does.
    digests = {row[0]: row[4] for row in seal}
    head = find_signed_head(reversed(signatures), digests.get, _trusted(tuple(trusted)))
    policy = SealPolicy(
        tuple(trusted), head.position if head else 0, now or datetime.now(UTC), grace
    )
    return stitch(
        [verify_chunk(rows, seal, last_sealed, signatures=signatures, policy=policy)],
        lambda hashes: locate_in(seal, hashes),
        expected_head=expected_head,
        policy=policy,
        signed_head=head,
    )


def _light(chunk: ChunkSummary) -> ChunkSummary:
    """What `_seal_findings` needs of a chunk (so that stitching keeps no rows' data)."""
    return ChunkSummary(
        events=chunk.events,
        stale_count=chunk.stale_count,
        unsigned_seal=chunk.unsigned_seal,
        untrusted=chunk.untrusted,
        signatures=chunk.signatures,
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
