"""The base of every ledger event: a frozen pydantic model the library can apply.

Pydantic events keep their types through the orjson transcoder (timestamps come
back as datetimes). Each event is encoded once: the bytes it is hashed by are
the bytes the event store keeps.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

import orjson
from eventsourcing.domain import CanInitAggregate, CanMutateAggregate
from eventsourcing.utils import get_topic
from pydantic import BaseModel, ConfigDict

from ledger.domain.errors import TamperDetected
from ledger.domain.hashing import GENESIS_HASH, stored_event_hash

__all__ = [
    "ChainedEvent",
    "LedgerCreatedEvent",
    "LedgerEvent",
    "encoded_event",
    "event_hash",
    "start_chain",
]

# Where an event keeps its encoding. A plain __dict__ entry, not a pydantic
# private attribute: those cost more per event than the encoding itself. Never
# `model_copy` an event: the copy would carry the original's bytes.
_ENCODED = "_encoded"


class LedgerEvent(BaseModel, CanMutateAggregate[str]):
    """An event of one operation, chained to its predecessor by `prev_hash`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    omitted_when_none: ClassVar[frozenset[str]] = frozenset()
    """Fields added in a later release, left out of the stored form while they are
    None: the release before it reads such an event as it always did (its events
    forbid fields they do not know), so an upgrade can be rolled back."""

    originator_id: str
    originator_version: int
    timestamp: datetime
    prev_hash: str


class LedgerCreatedEvent(LedgerEvent, CanInitAggregate[str]):
    """The first event of an operation."""

    originator_topic: str


def encoded_event(event: LedgerEvent) -> bytes:
    """The event's stored form: its JSON-mode dump as orjson bytes, computed once."""
    encoded: bytes | None = event.__dict__.get(_ENCODED)
    if encoded is None:
        state = event.model_dump(mode="json")
        for name in type(event).omitted_when_none:
            if state.get(name, 0) is None:
                del state[name]
        encoded = orjson.dumps(state)
        event.__dict__[_ENCODED] = encoded
    return encoded


def remember_stored_form(event: LedgerEvent, stored: bytes) -> None:
    """Attach the bytes an event was read from, so replay hashes exactly those."""
    event.__dict__[_ENCODED] = stored


def event_hash(event: LedgerEvent) -> str:
    """The hash of `event` exactly as it is (or will be) stored."""
    return stored_event_hash(get_topic(type(event)), encoded_event(event))


class ChainedEvent(LedgerEvent):
    """An event that keeps its aggregate's hash chain as it applies: it must follow the
    aggregate's last event (`prev_hash`), or replay stops with `TamperDetected`.

    The base of an operation's and a plan's events; each event's own change is its
    `apply_to`.
    """

    def apply(self, aggregate: Any) -> None:
        if self.prev_hash != aggregate.head_hash:
            raise TamperDetected(
                "event does not follow its predecessor",
                operation_id=self.originator_id,
                version=self.originator_version,
            )
        self.apply_to(aggregate)
        aggregate.head_hash = event_hash(self)
        # What this aggregate's history weighs as stored: caches bound their
        # memory by it (the encoding exists already, for the hash).
        aggregate.history_bytes += len(encoded_event(self))

    def apply_to(self, aggregate: Any) -> None:
        """Change the aggregate's state; overridden by each event."""


def start_chain(aggregate: Any) -> None:
    """Before an aggregate's first event applies: its chain starts at the genesis hash."""
    aggregate.head_hash = GENESIS_HASH
    aggregate.history_bytes = 0
