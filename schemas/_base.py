"""Shared configuration for wire models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """Base of every wire message: immutable, and strict about unknown fields.

    Unknown fields are refused so that a typo in a host written in another
    language fails loudly instead of being dropped. The price is paid by fields
    a later release adds: a reader of the release before refuses them. Such a
    field is declared with `exclude_if=left_out_while_none` and left out of what
    is written while it is None, so that a message that does not use it reads as
    it always did and the two releases can run side by side during an upgrade.
    (Per field, in pydantic's core: a serializer of the whole model, wrapping
    every message's dump, doubled the cost of dumping any of them.)
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


def left_out_while_none(value: object) -> bool:
    """`Field(exclude_if=...)` of a field a later release added: not written while None
    (see `WireModel`)."""
    return value is None
