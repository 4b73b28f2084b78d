"""The base of every ledger event: a frozen pydantic model the library can apply.

Pydantic events keep their types through the orjson transcoder (timestamps come
back as datetimes), and give one JSON-mode dump that is both what is stored and
what is hashed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from eventsourcing.domain import CanInitAggregate, CanMutateAggregate
from eventsourcing.utils import get_topic
from pydantic import BaseModel, ConfigDict

from ledger.domain.hashing import state_hash

__all__ = ["LedgerCreatedEvent", "LedgerEvent", "event_hash"]


class LedgerEvent(BaseModel, CanMutateAggregate[str]):
    """An event of one operation, chained to its predecessor by `prev_hash`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    originator_id: str
    originator_version: int
    timestamp: datetime
    prev_hash: str


class LedgerCreatedEvent(LedgerEvent, CanInitAggregate[str]):
    """The first event of an operation."""

    originator_topic: str


def event_hash(event: LedgerEvent) -> str:
    """The hash of `event` exactly as it will be stored."""
    state: dict[str, Any] = event.model_dump(mode="json")
    return state_hash(get_topic(type(event)), state)
