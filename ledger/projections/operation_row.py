"""One operation's row in the operations view, folded from its events: a pure function.

The view is this fold over each operation's events in version order, and
nothing else: the projector (`ledger.projections.operations_view`) writes
what it returns, and verification (`ledger.audit.model`) recomputes it from
the events to check the table, so the two cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from ledger.domain.event_kinds import EVENT_KINDS, EventKind, StateAfter
from ledger.domain.operation import Operation
from ledger.domain.states import OperationState

__all__ = [
    "ROW_COLUMNS",
    "VIEW_COLUMNS",
    "OperationRow",
    "Row",
    "fold_event",
    "fold_stored",
    "iso_timestamp",
    "view_text",
]

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


# Event type → the columns it sets besides the state (which the event registry,
# `ledger.domain.event_kinds`, says). A callable computes a value from the event.
_Setter = dict[str, Any | Callable[[dict[str, Any]], Any]]

_COLUMNS: dict[type[Operation.Event], _Setter] = {
    Operation.Validated: {
        "tool_version": lambda e: e["tool_version"],
        "risk": lambda e: e["risk"],
        "proposal_hash": lambda e: e["proposal_hash"],
    },
    Operation.Rejected: {"tool_version": lambda e: e["tool_version"]},
    Operation.ApprovalRequested: {
        "approval_id": lambda e: e["approval_id"],
        # In the view's one form, so that the approval sweep finds what is due by
        # comparing text (an index range), not by parsing every waiting request.
        "approval_expires_at": lambda e: _normalized(e["expires_at"]),
        "approvals_required": lambda e: e["required_approvals"],
    },
    Operation.ApprovalDenied: {"approval_id": None},
    Operation.ApprovalExpired: {"approval_id": None},
    Operation.Readied: {"approval_id": None},
    Operation.LeaseClaimed: {
        "attempts": lambda e: e["attempt"],
        "lease_expires_at": lambda e: _normalized(e["lease_expires_at"]),
    },
    Operation.Cancelled: {"approval_id": None},
    Operation.ExecutionRefused: {"approval_id": None},
}


def _event_type(topic: str) -> str:
    return topic.rsplit(".", 1)[-1]


ROW_COLUMNS = (*VIEW_COLUMNS, "lease_expires_at", "trace_parent")
"""Every column of a view row, in table order (`VIEW_COLUMNS`, the lease's expiry, and
the traceparent the operation's spans continue)."""

Row = dict[str, Any]
"""One view row as column → value, exactly the values SQL stores and returns."""


def fold_event(
    row: Row | None, operation_id: str, version: int, topic: str, state: dict[str, Any]
) -> Row | None:
    """The operation's view row after one more of its events (`row` is updated in place).

    The view is this fold over each operation's events in version order,
    and nothing else: the projector writes what it returns, and verification
    recomputes it from the events to check the table, so the two cannot
    drift. None: no row (events before the operation's `Proposed`). Raises
    for a state that is no event; `fold_stored` is the total form.
    """
    kind = _event_type(topic)
    if kind == "Proposed":
        return _proposed_row(operation_id, version, state)
    if row is None:
        return None
    row.update(_changes(row, version, kind, state))
    return row


def _proposed_row(operation_id: str, version: int, state: dict[str, Any]) -> Row:
    timestamp = _normalized(state["timestamp"])
    return {
        "operation_id": operation_id,
        "state": "proposed",
        "tool": state["tool"],
        "tool_version": None,
        "actor": state["actor"],
        "tenant": state["tenant"],
        "risk": None,
        "attempts": 0,
        "created_at": timestamp,
        "updated_at": timestamp,
        "last_version": version,
        "approval_id": None,
        "approval_expires_at": None,
        "approvals_required": 0,
        "approvals_granted": 0,
        "proposal_hash": None,
        "host": state.get("host", ""),
        "lease_expires_at": None,
        "trace_parent": state.get("trace_parent"),
    }


def _changes(row: Row, version: int, kind: str, state: dict[str, Any]) -> Row:
    """The columns one event (not the first) changes, computed before any is written."""
    changes: Row = {"updated_at": _normalized(state["timestamp"]), "last_version": version}
    fold = _FOLD.get(kind)
    if fold is None:
        return changes
    after, columns, counts_approval = fold
    if isinstance(after, str):
        changes["state"] = after
    elif after is not None:
        changes["state"] = after(state, OperationState(row["state"])).value
    for column, value in columns.items():
        changes[column] = value(state) if callable(value) else value
    if counts_approval:
        changes["approvals_granted"] = row["approvals_granted"] + 1
    return changes


def _fold_of(kind: EventKind) -> tuple[str | StateAfter | None, _Setter, bool]:
    after = kind.state.value if isinstance(kind.state, OperationState) else kind.state
    counts_approval = kind.event is Operation.ApprovalGranted
    return after, _COLUMNS.get(kind.event, {}), counts_approval


# Per stored type name, what folding it does, computed once from the registry
# (the fold runs for every event the view and verification read).
_FOLD = {kind.name: _fold_of(kind) for kind in EVENT_KINDS.values()}


def fold_stored(
    row: Row | None, operation_id: str, version: int, topic: str, stored: bytes | dict[str, Any]
) -> Row | None:
    """`fold_event` over a stored event, total: it never raises, and leaves `row` as it is.

    An event that is not one (its state not a JSON object, a field missing or
    of the wrong type: a row written by hand) leaves the row as it was; the
    view must never stop for one row it cannot read (verification names such
    rows by their hashes). Text that PostgreSQL's TEXT cannot hold (U+0000)
    is stored as U+FFFD, the same on both backends.
    """
    try:
        state = orjson.loads(stored) if isinstance(stored, bytes | bytearray) else stored
        if type(state) is not dict:
            return row
        kind = _event_type(topic)
        if kind == "Proposed":
            changes = _proposed_row(operation_id, version, state)
        elif row is None:
            return None
        else:
            changes = _changes(row, version, kind, state)
    except Exception:
        return row
    # Only what the event changes is checked, before anything is written.
    for column, value in changes.items():
        if type(value) is str:
            if "\x00" in value:
                changes[column] = view_text(value)
        elif value is not None and type(value) is not int:
            return row  # a value of a type no column takes: not an event
    if kind == "Proposed":
        return changes
    assert row is not None
    row.update(changes)
    return row


def view_text(text: str) -> str:
    """`text` as the view stores it: U+0000, which PostgreSQL's TEXT cannot hold, as U+FFFD."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def iso_timestamp(moment: datetime) -> str:
    """`moment` in the view's one fixed-width UTC form (string order is time order)."""
    # One fixed-width UTC form, so that string comparison orders timestamps.
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _normalized(timestamp: str) -> str:
    # Events store UTC timestamps in this very form (pydantic's, with microseconds):
    # keep it as it is. Parsing and formatting every event's was a fifth of the
    # view check's time in `audit verify`.
    if len(timestamp) == 27 and timestamp[26] == "Z" and timestamp[19] == ".":
        return timestamp
    return iso_timestamp(datetime.fromisoformat(timestamp))
