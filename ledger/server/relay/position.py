"""Where the relay is in the event log, and which events it went on without.

Two tables, over the `SqlDatabase` adapter:

- `opledger_relay`: one row per relay name, its saved position and its lease
  (`owner`, `until`). One relay runs at a time per database: instances take
  turns through this row, so two services never dispatch twice.
- `opledger_relay_set_aside`: the events the relay could not publish and
  went on without (position, operation, version, reason, when).

Why not `eventsourcing.projection` and its tracking records: a tracking
record says "processed up to N", and is written with the processing's own
state in one transaction. The relay's position is different on both counts.
It is what JetStream has *confirmed* storing, which lags what was sent (the
relay proves a run of unacknowledged feed events with one PubAck every
50 ms, see `ledger.server.relay.publisher`), and it is written in the same
row as the lease that says which instance may relay at all, renewed at most
every 200 ms rather than per batch. A tracking record has no owner and no
expiry, so the lease would still need this row, and the position would be
written twice. And `ProjectionRunner` hands each event to a projection as a
domain event, decoded through the application's mapper; the relay publishes
the stored state as it is (its hash is what auditors compare), so it would
decode every event for nothing, and it must set aside a row that does not
decode rather than stop on it (the runner's thread stops at the first
exception a projection raises). Measured on this machine over 3,030 stored
events (best of 5): `mapper.to_domain_event` 5.8 µs an event against 1.9 µs
for the `orjson.loads` the relay does, on a path that handles every event.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from ledger.adapters.sql import SqlDatabase

__all__ = ["SET_ASIDE_TABLE", "RelayPositions", "SetAsideRecord"]

SET_ASIDE_TABLE = "opledger_relay_set_aside"
"""Events the relay could not publish and went on without: (position, operation_id,
version, reason, set_aside_at). Each also gets `Operation.PublicationSetAside`."""

_TABLE = "opledger_relay"


@dataclass(frozen=True, slots=True)
class SetAsideRecord:
    """One event the relay went on without."""

    position: int
    operation_id: str
    version: int
    reason: str
    set_aside_at: datetime


class RelayPositions:
    """The relay's lease and saved position (`opledger_relay`) and its set-aside events."""

    def __init__(self, db: SqlDatabase, name: str = "relay") -> None:
        self._db = db
        self._name = name
        with db.creating():
            db.execute(
                f"CREATE TABLE IF NOT EXISTS {_TABLE} ("
                " name TEXT PRIMARY KEY, position BIGINT NOT NULL, owner TEXT, until TEXT)"
            )
            db.execute(
                f"INSERT INTO {_TABLE} (name, position) VALUES (?, 0)"
                " ON CONFLICT (name) DO NOTHING",
                (name,),
            )
            db.execute(
                f"CREATE TABLE IF NOT EXISTS {SET_ASIDE_TABLE} ("
                " position BIGINT PRIMARY KEY, operation_id TEXT NOT NULL,"
                " version INTEGER NOT NULL, reason TEXT NOT NULL, set_aside_at TEXT NOT NULL)"
            )

    def take(self, owner: str, now: datetime, until: datetime) -> int | None:
        """Take the lease for `owner` until `until` if it is free, expired or already
        `owner`'s; the saved position then, else None."""
        changed = self._db.execute_count(
            f"UPDATE {_TABLE} SET owner = ?, until = ?"
            " WHERE name = ? AND (owner IS NULL OR owner = ? OR until < ?)",
            (owner, until.isoformat(), self._name, owner, now.isoformat()),
        )
        if not changed:
            return None
        rows = self._db.query(f"SELECT position FROM {_TABLE} WHERE name = ?", (self._name,))
        return int(rows[0][0])

    def save(self, owner: str, position: int, until: datetime) -> bool:
        """Save `position` and renew `owner`'s lease until `until`; False if it is not
        `owner`'s any more (another relay took over)."""
        return bool(
            self._db.execute_count(
                f"UPDATE {_TABLE} SET position = ?, until = ? WHERE name = ? AND owner = ?",
                (position, until.isoformat(), self._name, owner),
            )
        )

    def release(self, owner: str, position: int) -> None:
        """Save `position` and give up `owner`'s lease, so another instance takes over at once."""
        self._db.execute(
            f"UPDATE {_TABLE} SET position = ?, owner = NULL, until = NULL"
            " WHERE name = ? AND owner = ?",
            (position, self._name, owner),
        )

    def set_aside_after(self, position: int) -> set[int]:
        """Positions after `position` already set aside (not to be tried again)."""
        return {
            int(found[0])
            for found in self._db.query(
                f"SELECT position FROM {SET_ASIDE_TABLE} WHERE position > ?", (position,)
            )
        }

    def set_aside(self, record: SetAsideRecord) -> bool:
        """Record an event set aside; False if it was already (a restart before the
        position was saved)."""
        return bool(
            self._db.execute_count(
                f"INSERT INTO {SET_ASIDE_TABLE}"
                " (position, operation_id, version, reason, set_aside_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (position) DO NOTHING",
                (
                    record.position,
                    record.operation_id,
                    record.version,
                    record.reason,
                    record.set_aside_at.isoformat(),
                ),
            )
        )


def read_set_aside(db: SqlDatabase) -> dict[tuple[str, int], str]:
    """The events the relay set aside, (operation, version) → reason, read only
    (an inspection command must not create the table a service would)."""
    if SET_ASIDE_TABLE not in db.tables():
        return {}
    rows = db.query(f"SELECT operation_id, version, reason FROM {SET_ASIDE_TABLE}")
    return {(str(op), int(version)): str(reason) for op, version, reason in rows}
