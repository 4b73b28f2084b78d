"""Shared configuration for wire models."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer


class WireModel(BaseModel):
    """Base of every wire message: immutable, and strict about unknown fields.

    Unknown fields are refused so that a typo in a host written in another
    language fails loudly instead of being dropped. The price is paid by fields
    a later release adds: a reader of the release before refuses them. Such a
    field is named in `omitted_when_none` and left out of what is written while
    it is None, so that a message that does not use it reads as it always did
    and the two releases can run side by side during an upgrade.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    omitted_when_none: ClassVar[frozenset[str]] = frozenset()
    """Fields a later release added: not written while None (see the class doc)."""

    @model_serializer(mode="wrap")
    def _leave_out_unused_additions(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if self.omitted_when_none and isinstance(data, dict):
            for name in self.omitted_when_none:
                if data.get(name, 0) is None:
                    del data[name]
        return data
