"""The operations read model and the global digest chain, projected from the event order.

One projector follows the application's notification log. For each event it
updates the operation's row and extends the running digest, in the same
transaction as its tracking position, so the view never skips or repeats an
event. Dropping the tables and replaying gives the identical view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from eventsourcing.persistence import ApplicationRecorder, Notification

from ledger.adapters.sql import SqlDatabase
from ledger.domain.hashing import GENESIS_HASH, chain_digest, stored_event_hash

__all__ = ["VIEW_COLUMNS", "OperationRow", "OperationsProjector"]

_NAME = "operations_view"
VIEW_COLUMNS = (
    "operation_id",
    "state",
    "tool",
    "tool_version",
    "actor",
    "tenant",
    "risk",
    "attempts",
    "created_at",
    "updated_at",
    "last_version",
    "approval_id",
    "approval_expires_at",
    "approvals_required",
    "approvals_granted",
    "proposal_hash",
    "host",
)

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS opledger_operations (
        operation_id TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        tool TEXT NOT NULL,
        tool_version TEXT,
        actor TEXT NOT NULL,
        tenant TEXT NOT NULL,
        risk TEXT,
        attempts INTEGER NOT NULL DEFAULT 0,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        last_version INTEGER NOT NULL,
        approval_id TEXT,
        approval_expires_at TEXT,
        approvals_required INTEGER NOT NULL DEFAULT 0,
        approvals_granted INTEGER NOT NULL DEFAULT 0,
        proposal_hash TEXT,
        host TEXT NOT NULL DEFAULT '',
        lease_expires_at TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS opledger_operations_budget"
    " ON opledger_operations (tenant, actor, tool, created_at)",
    "CREATE INDEX IF NOT EXISTS opledger_operations_state ON opledger_operations (state)",
    """CREATE TABLE IF NOT EXISTS opledger_digest (
        notification_id BIGINT PRIMARY KEY,
        operation_id TEXT NOT NULL,
        version INTEGER NOT NULL,
        event_hash TEXT NOT NULL,
        running_digest TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS opledger_positions (
        name TEXT PRIMARY KEY,
        position BIGINT NOT NULL
    )""",
]


@dataclass(frozen=True, slots=True)
class OperationRow:
    """One row of the operations view."""

    operation_id: str
    state: str
    tool: str
    tool_version: str | None
    actor: str
    tenant: str
    risk: str | None
    attempts: int
    created_at: str
    updated_at: str
    last_version: int
    approval_id: str | None
    approval_expires_at: str | None
    approvals_required: int
    approvals_granted: int
    proposal_hash: str | None
    host: str


# Event type → columns it sets. A callable computes values from the event state.
_Setter = dict[str, Any | Callable[[dict[str, Any]], Any]]

_STATE_CHANGES: dict[str, _Setter] = {
    "Validated": {
        "state": "validated",
        "tool_version": lambda e: e["tool_version"],
        "risk": lambda e: e["risk"],
        "proposal_hash": lambda e: e["proposal_hash"],
    },
    "Rejected": {"state": "rejected", "tool_version": lambda e: e["tool_version"]},
    "ApprovalRequested": {
        "state": "awaiting_approval",
        "approval_id": lambda e: e["approval_id"],
        "approval_expires_at": lambda e: e["expires_at"],
        "approvals_required": lambda e: e["required_approvals"],
    },
    "ApprovalDenied": {"state": "approval_denied", "approval_id": None},
    "ApprovalExpired": {"state": "approval_expired", "approval_id": None},
    "Readied": {"state": "ready", "approval_id": None},
    "LeaseClaimed": {
        "state": "executing",
        "attempts": lambda e: e["attempt"],
        "lease_expires_at": lambda e: _normalized(e["lease_expires_at"]),
    },
    "LeaseExpired": {"state": "outcome_unknown"},
    "OutcomeUnknown": {"state": "outcome_unknown"},
    "Succeeded": {"state": "succeeded"},
    "Failed": {"state": "failed"},
    "ReconciliationStarted": {"state": "reconciling"},
    "ReconciliationInconclusive": {"state": "outcome_unknown"},
    "Reconciled": {"state": lambda e: "succeeded" if e["outcome"] == "succeeded" else "failed"},
    "RetryScheduled": {"state": "ready"},
    "Cancelled": {"state": "cancelled", "approval_id": None},
}


def _event_type(topic: str) -> str:
    return topic.rsplit(".", 1)[-1]


class _ViewChanges:
    """One batch's changes to the view, merged into one statement per operation.

    Five or more events per operation usually arrive in one batch; their
    column changes are merged (a later event's value wins) and written with
    one INSERT or UPDATE per operation, grouped into `executemany` calls. The
    few changes that depend on the stored row (a counter, a conditional state)
    are written where they occur, after everything before them.
    """

    def __init__(self) -> None:
        self._inserts: list[tuple[Any, ...]] = []
        self._updates: dict[str, dict[str, Any]] = {}

    def add(self, notification: Notification, state: dict[str, Any], db: SqlDatabase) -> None:
        kind = _event_type(notification.topic)
        operation_id = str(notification.originator_id)
        timestamp = _normalized(state["timestamp"])
        if kind == "Proposed":
            self._inserts.append(
                (
                    operation_id,
                    state["tool"],
                    state["actor"],
                    state["tenant"],
                    timestamp,
                    timestamp,
                    notification.originator_version,
                    state.get("host", ""),
                )
            )
            return
        columns = self._updates.setdefault(operation_id, {})
        columns["updated_at"] = timestamp
        columns["last_version"] = notification.originator_version
        for column, value in _STATE_CHANGES.get(kind, {}).items():
            columns[column] = value(state) if callable(value) else value
        if kind == "ApprovalGranted":
            special = "approvals_granted = approvals_granted + 1"
        elif kind == "CancelRequested":
            special = "state = CASE WHEN state = 'executing' THEN 'cancel_requested' ELSE state END"
        else:
            return
        self._write_inserts(db)
        self._write_update(db, operation_id, self._updates.pop(operation_id))
        db.execute(
            f"UPDATE opledger_operations SET {special} WHERE operation_id = ?", (operation_id,)
        )

    def flush(self, db: SqlDatabase) -> None:
        """Write what is left: inserts first (an operation's first event), then updates."""
        self._write_inserts(db)
        by_columns: dict[tuple[str, ...], list[tuple[Any, ...]]] = {}
        for operation_id, columns in self._updates.items():
            by_columns.setdefault(tuple(columns), []).append((*columns.values(), operation_id))
        self._updates.clear()
        for names, rows in by_columns.items():
            assignments = ", ".join(f"{column} = ?" for column in names)
            db.executemany(
                f"UPDATE opledger_operations SET {assignments} WHERE operation_id = ?", rows
            )

    def _write_inserts(self, db: SqlDatabase) -> None:
        if self._inserts:
            db.executemany(
                "INSERT INTO opledger_operations (operation_id, state, tool, actor, tenant,"
                " created_at, updated_at, last_version, host)"
                " VALUES (?, 'proposed', ?, ?, ?, ?, ?, ?, ?)",
                self._inserts,
            )
            self._inserts = []

    @staticmethod
    def _write_update(db: SqlDatabase, operation_id: str, columns: dict[str, Any]) -> None:
        assignments = ", ".join(f"{column} = ?" for column in columns)
        db.execute(
            f"UPDATE opledger_operations SET {assignments} WHERE operation_id = ?",
            (*columns.values(), operation_id),
        )


class OperationsProjector:
    """Keeps the operations view and the digest chain up to date with the event log."""

    def __init__(self, db: SqlDatabase, recorder: ApplicationRecorder, batch_size: int = 500):
        self._db = db
        self._recorder = recorder
        self._batch_size = batch_size
        with db.transaction():
            for statement in _SCHEMA:
                db.execute(statement)
            self._add_lease_column(db)
            db.execute(
                "INSERT INTO opledger_positions (name, position) VALUES (?, 0)"
                " ON CONFLICT (name) DO NOTHING",
                (_NAME,),
            )

    @staticmethod
    def _add_lease_column(db: SqlDatabase) -> None:
        # Views made before the column existed get it empty; the lease sweep
        # treats an empty one as "look at the operation itself".
        if db.is_postgres:
            db.execute(
                "ALTER TABLE opledger_operations ADD COLUMN IF NOT EXISTS lease_expires_at TEXT"
            )
            return
        columns = {row[1] for row in db.query("PRAGMA table_info(opledger_operations)")}
        if "lease_expires_at" not in columns:
            db.execute("ALTER TABLE opledger_operations ADD COLUMN lease_expires_at TEXT")

    def position(self) -> int:
        """The last notification ID the view includes."""
        return int(
            self._db.query("SELECT position FROM opledger_positions WHERE name = ?", (_NAME,))[0][0]
        )

    def catch_up(self) -> int:
        """Project every notification not yet in the view; returns how many."""
        total = 0
        while True:
            count = self._project_batch()
            total += count
            if count < self._batch_size:
                return total

    def _project_batch(self) -> int:
        db = self._db
        with db.transaction():
            lock = " FOR UPDATE" if db.is_postgres else ""
            position = int(
                db.query(f"SELECT position FROM opledger_positions WHERE name = ?{lock}", (_NAME,))[
                    0
                ][0]
            )
            notifications = self._recorder.select_notifications(
                start=position, limit=self._batch_size, inclusive_of_start=False
            )
            if not notifications:
                return 0
            digest_rows = db.query(
                "SELECT running_digest FROM opledger_digest ORDER BY notification_id DESC LIMIT 1"
            )
            digest = digest_rows[0][0] if digest_rows else GENESIS_HASH
            digests: list[tuple[Any, ...]] = []
            changes = _ViewChanges()
            for notification in notifications:
                state = orjson.loads(notification.state)
                event_hash = stored_event_hash(notification.topic, notification.state)
                digest = chain_digest(digest, event_hash)
                digests.append(
                    (
                        notification.id,
                        notification.originator_id,
                        notification.originator_version,
                        event_hash,
                        digest,
                    )
                )
                changes.add(notification, state, db)
            changes.flush(db)
            db.executemany(
                "INSERT INTO opledger_digest"
                " (notification_id, operation_id, version, event_hash, running_digest)"
                " VALUES (?, ?, ?, ?, ?)",
                digests,
            )
            db.execute(
                "UPDATE opledger_positions SET position = ? WHERE name = ?",
                (notifications[-1].id, _NAME),
            )
            return len(notifications)

    def rebuild(self) -> int:
        """Drop the view and the digest chain and project everything again."""
        with self._db.transaction():
            self._db.execute("DELETE FROM opledger_operations")
            self._db.execute("DELETE FROM opledger_digest")
            self._db.execute("UPDATE opledger_positions SET position = 0 WHERE name = ?", (_NAME,))
        return self.catch_up()

    # ------------------------------------------------------------------ queries

    def rows(
        self,
        *,
        state: str | None = None,
        tool: str | None = None,
        tenant: str | None = None,
        limit: int = 1000,
    ) -> list[OperationRow]:
        """Operations, newest first, optionally filtered."""
        conditions, params = [], []
        for column, value in (("state", state), ("tool", tool), ("tenant", tenant)):
            if value is not None:
                conditions.append(f"{column} = ?")
                params.append(value)
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        rows = self._db.query(
            f"SELECT {', '.join(VIEW_COLUMNS)} FROM opledger_operations{where}"
            " ORDER BY created_at DESC, operation_id LIMIT ?",
            (*params, limit),
        )
        return [OperationRow(*row) for row in rows]

    def row(self, operation_id: str) -> OperationRow | None:
        """One operation's row."""
        rows = self._db.query(
            f"SELECT {', '.join(VIEW_COLUMNS)} FROM opledger_operations WHERE operation_id = ?",
            (operation_id,),
        )
        return OperationRow(*rows[0]) if rows else None

    def routes(self, operation_ids: Iterable[str]) -> dict[str, tuple[str, str | None, str]]:
        """operation ID → (tool, tool version, host), for the IDs the view has (batched)."""
        rows = self._db.query_in(
            "SELECT operation_id, tool, tool_version, host FROM opledger_operations"
            " WHERE operation_id IN ({marks})",
            list(dict.fromkeys(operation_ids)),
        )
        return {operation_id: (tool, version, host) for operation_id, tool, version, host in rows}

    def lease_expiry_candidates(self, now: datetime) -> list[str]:
        """Executing operations whose lease ran out by `now` (or whose expiry the view lacks)."""
        rows = self._db.query(
            "SELECT operation_id FROM opledger_operations WHERE state = 'executing'"
            " AND (lease_expires_at IS NULL OR lease_expires_at <= ?)",
            (_iso(now),),
        )
        return [str(row[0]) for row in rows]

    def ready_since_before(self, moment: datetime) -> list[tuple[str, str, str | None, int]]:
        """Ready operations unchanged since before `moment`: (ID, tool, version, attempts)."""
        rows = self._db.query(
            "SELECT operation_id, tool, tool_version, attempts FROM opledger_operations"
            " WHERE state = 'ready' AND updated_at <= ? ORDER BY updated_at",
            (_iso(moment),),
        )
        return [
            (str(r[0]), str(r[1]), None if r[2] is None else str(r[2]), int(r[3])) for r in rows
        ]

    def count_since(self, *, tenant: str, actor: str, tool: str, since: datetime) -> int:
        """Accepted operations of `actor` for `tool` since `since` (for budgets).

        Rejected proposals do not count: a model repairing its arguments should
        not use up the caller's budget.
        """
        return int(
            self._db.query(
                "SELECT COUNT(*) FROM opledger_operations"
                " WHERE tenant = ? AND actor = ? AND tool = ? AND created_at >= ?"
                " AND state <> 'rejected'",
                (tenant, actor, tool, _iso(since)),
            )[0][0]
        )

    def digest_rows(self) -> Sequence[tuple[int, str, int, str, str]]:
        """The digest chain: (notification ID, operation, version, event hash, digest)."""
        # Both drivers already return these types: no per-row conversion.
        return self._db.query(
            "SELECT notification_id, operation_id, version, event_hash, running_digest"
            " FROM opledger_digest ORDER BY notification_id"
        )


def _iso(moment: datetime) -> str:
    # One fixed-width UTC form, so that string comparison orders timestamps.
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _normalized(timestamp: str) -> str:
    return _iso(datetime.fromisoformat(timestamp))
