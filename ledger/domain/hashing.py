"""Event hashes: what chains each operation's events and the global digest.

An event's hash covers its topic and its complete JSON state, including the
hash of the previous event of the same operation. The JSON state hashed is the
exact dict the mapper stores, so an auditor can verify stored rows without
reconstructing objects: decode, re-encode with sorted keys, hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = ["GENESIS_HASH", "chain_digest", "state_hash"]

GENESIS_HASH = "0" * 64
"""The `prev_hash` of an operation's first event, and the digest before any event."""


def state_hash(topic: str, state: Mapping[str, Any]) -> str:
    """SHA-256 of an event given its topic and JSON-mode state.

    Sorted keys make the encoding independent of field order; orjson's number
    and string encodings are deterministic, and the state is JSON-mode data
    (strings, numbers, lists, dicts) on both the write and the verify path.
    """
    body = orjson.dumps({"state": state, "topic": topic}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(body).hexdigest()


def chain_digest(previous_digest: str, event_hash: str) -> str:
    """The running digest after one more event in the global order."""
    return hashlib.sha256(f"{previous_digest}:{event_hash}".encode()).hexdigest()
