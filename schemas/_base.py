"""Shared configuration for wire models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """Base of every wire message: immutable, and strict about unknown fields.

    Unknown fields are refused so that a typo in a host written in another
    language fails loudly instead of being dropped.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
