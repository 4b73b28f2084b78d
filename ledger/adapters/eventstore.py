"""The `eventsourcing` application that stores operations, with pydantic events as JSON."""

from __future__ import annotations

from typing import Any, cast

import orjson
from eventsourcing.application import Application
from eventsourcing.domain import DomainEventProtocol
from eventsourcing.persistence import Mapper, StoredEvent, Transcoder, Transcoding
from eventsourcing.utils import get_topic, resolve_topic
from pydantic import BaseModel

from ledger.adapters.storage import READ_ONLY_OPTIONS, StorageConfig
from ledger.domain.events import LedgerEvent, encoded_event, remember_stored_form

__all__ = ["EventStoreApp", "OrjsonTranscoder", "PydanticMapper"]


class PydanticMapper(Mapper[str]):
    """Stores an event as its complete JSON-mode pydantic dump.

    The stored state is byte-for-byte what `ledger.domain.events.event_hash`
    hashed, so auditors can verify rows without the classes.
    """

    def to_stored_event(self, domain_event: DomainEventProtocol[str]) -> StoredEvent:
        """Encode one event (ledger events were encoded once already, when hashed)."""
        if isinstance(domain_event, LedgerEvent):
            state = encoded_event(domain_event)
        else:
            state = self.transcoder.encode(cast(BaseModel, domain_event).model_dump(mode="json"))
        return StoredEvent(
            originator_id=domain_event.originator_id,
            originator_version=domain_event.originator_version,
            topic=get_topic(type(domain_event)),
            state=state,
        )

    def to_domain_event(self, stored_event: StoredEvent) -> DomainEventProtocol[str]:
        """Decode one event, restoring its types through pydantic."""
        cls = resolve_topic(stored_event.topic)
        event = cls.model_validate(self.transcoder.decode(stored_event.state))
        if isinstance(event, LedgerEvent):
            remember_stored_form(event, bytes(stored_event.state))
        return cast(DomainEventProtocol[str], event)


class OrjsonTranscoder(Transcoder):
    """JSON by orjson; pydantic does all type conversion, so no transcodings."""

    def encode(self, obj: Any) -> bytes:
        """Encode JSON-mode data."""
        return orjson.dumps(obj)

    def decode(self, data: bytes) -> Any:
        """Decode to JSON-mode data."""
        return orjson.loads(data)

    def register(self, transcoding: Transcoding) -> None:
        """Transcodings are not used: pydantic models carry their own types."""
        raise NotImplementedError("use pydantic models instead of transcodings")


class EventStoreApp(Application[str]):
    """The event-sourced store of operations. Table names start with `opledger`."""

    name = "opledger"

    def __init__(self, storage: StorageConfig) -> None:
        self.storage = storage
        super().__init__(env=storage.eventsourcing_env())
        if storage.read_only and storage.is_postgres:
            # The library's pool takes no session options from the environment;
            # it opens its first connection only when asked for one, so the
            # option set here is on every connection it makes.
            pool = getattr(self.factory, "datastore").pool  # noqa: B009 (untyped in the library)
            pool.kwargs = {**(pool.kwargs or {}), "options": READ_ONLY_OPTIONS}

    def construct_mapper(self) -> Mapper[str]:
        """Pydantic events as JSON."""
        return PydanticMapper(transcoder=self.construct_transcoder())

    def construct_transcoder(self) -> Transcoder:
        """orjson."""
        return OrjsonTranscoder()
