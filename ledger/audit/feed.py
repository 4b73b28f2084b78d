"""Comparing the event store with the feed: a witness the database's attacker does not hold.

The relay mirrors every stored event on the JetStream feed (`OPS_FEED`), as a
`FeedEvent` with the event's position, operation, version and hash. Someone
who can write the database can delete the newest events together with their
seal rows and signatures: the store then verifies, up to a head that is
simply older. The feed still has them. So an auditor reads the whole feed,
with the auditor identity's credentials only (`ledger.nats.feed_reader`), and
compares it with the store event by event, by (operation, version):

- a stored event the feed lacks: FEED_MISSING, unless the relay set it aside
  (`opledger_relay_set_aside`: then a SET_ASIDE notice with its reason), or
  it lies past the feed's last event and is younger than the grace (the
  relay has not got to it yet: counted, not reported);
- a feed event the store lacks: FEED_EXTRA (deleted from the store?);
- the same (operation, version) with another hash or position: FEED_DIFFERENT.

The same event published twice (the relay republishes after a failure; the
copies carry one hash) is no fault. `compare_feed` is a pure function over
stored rows and feed records; the memory it holds is the feed's records, a
few hundred bytes each.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from ledger.adapters.event_tables import StoredRow
from ledger.audit.verify import DEFAULT_SEAL_GRACE, Finding, FindingKind
from ledger.domain.hashing import stored_event_hash

__all__ = ["FeedComparison", "FeedRecord", "compare_feed", "feed_records"]


@dataclass(frozen=True, slots=True)
class FeedRecord:
    """What the feed says of one event: where it was stored and its hash."""

    seq: int
    """The feed message's stream sequence."""
    position: int
    operation_id: str
    version: int
    event_hash: str


@dataclass(slots=True)
class FeedComparison:
    """What comparing the store with the feed found."""

    feed_messages: int = 0
    stored_events: int = 0
    not_yet_relayed: int = 0
    """Stored events past the feed's end, younger than the grace."""
    findings: list[Finding] = field(default_factory=list)
    notices: list[Finding] = field(default_factory=list)


def feed_records(messages: Iterable[tuple[int, bytes]]) -> Iterable[FeedRecord | Finding]:
    """Each feed message (sequence, body) as a record, or a finding if it is none."""
    for seq, data in messages:
        try:
            body: Any = orjson.loads(data)
            yield FeedRecord(
                seq,
                int(body["position"]),
                str(body["operation_id"]),
                int(body["version"]),
                str(body["event_hash"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            yield Finding(
                FindingKind.FEED_DIFFERENT,
                None,
                "",
                None,
                f"feed message {seq} is not a ledger event",
            )


def compare_feed(
    rows: Iterable[StoredRow],
    feed: Iterable[FeedRecord | Finding],
    *,
    set_aside: Mapping[tuple[str, int], str] | None = None,
    now: datetime | None = None,
    grace: timedelta = DEFAULT_SEAL_GRACE,
) -> FeedComparison:
    """Compare every stored row (in position order) with every feed record (see the module).

    `set_aside`: (operation, version) → why the relay set the event aside.
    """
    result = FeedComparison()
    set_aside = set_aside or {}
    now = now or datetime.now(UTC)
    on_feed: dict[tuple[str, int], FeedRecord] = {}
    feed_end = 0
    for record in feed:
        result.feed_messages += 1
        if isinstance(record, Finding):
            result.findings.append(record)
            continue
        feed_end = max(feed_end, record.position)
        key = (record.operation_id, record.version)
        first = on_feed.get(key)
        if first is None:
            on_feed[key] = record
        elif (first.event_hash, first.position) != (record.event_hash, record.position):
            result.findings.append(
                Finding(
                    FindingKind.FEED_DIFFERENT,
                    record.position,
                    record.operation_id,
                    record.version,
                    f"the feed has this event twice, differently (messages {first.seq}"
                    f" and {record.seq})",
                )
            )
    for position, operation_id, version, topic, stored in rows:
        result.stored_events += 1
        copy = on_feed.pop((operation_id, version), None)
        if copy is None:
            reason = set_aside.get((operation_id, version))
            if reason is not None:
                result.notices.append(
                    Finding(
                        FindingKind.SET_ASIDE,
                        position,
                        operation_id,
                        version,
                        f"not on the feed: the relay set it aside ({reason})",
                    )
                )
            elif position > feed_end and _young(stored, now, grace):
                result.not_yet_relayed += 1
            else:
                result.findings.append(
                    Finding(
                        FindingKind.FEED_MISSING,
                        position,
                        operation_id,
                        version,
                        "a stored event the feed does not have",
                    )
                )
            continue
        event_hash = stored_event_hash(topic, stored)
        if copy.event_hash != event_hash:
            detail = f"differs from the feed's copy (message {copy.seq}): another hash"
        elif copy.position != position:
            detail = f"the feed has it at #{copy.position} (message {copy.seq})"
        else:
            continue
        result.findings.append(
            Finding(FindingKind.FEED_DIFFERENT, position, operation_id, version, detail)
        )
    for (operation_id, version), extra in sorted(
        on_feed.items(), key=lambda item: item[1].position
    ):
        result.findings.append(
            Finding(
                FindingKind.FEED_EXTRA,
                extra.position,
                operation_id,
                version,
                f"on the feed (message {extra.seq}), not in the store",
            )
        )
    return result


def _young(stored: bytes, now: datetime, grace: timedelta) -> bool:
    try:
        moment = datetime.fromisoformat(orjson.loads(stored)["timestamp"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return False
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return now - grace <= moment <= now + grace
