"""Event hashes: what chains each operation's events and the global digest.

An event's hash is SHA-256 over its topic, a newline, and its encoded state:
exactly the bytes the event store keeps. That state includes the hash of the
previous event of the same operation. Hashing stored bytes (rather than a
re-encoding) lets an auditor verify rows without decoding them into objects,
and keeps old hashes valid if a JSON library ever changes its formatting.
"""

from __future__ import annotations

import hashlib

__all__ = ["GENESIS_HASH", "chain_digest", "stored_event_hash"]

GENESIS_HASH = "0" * 64
"""The `prev_hash` of an operation's first event, and the digest before any event."""


def stored_event_hash(topic: str, state: bytes) -> str:
    """SHA-256 of one stored event: its topic and its encoded state."""
    digest = hashlib.sha256(topic.encode())
    digest.update(b"\n")
    digest.update(state)
    return digest.hexdigest()


def chain_digest(previous_digest: str, event_hash: str) -> str:
    """The running digest after one more event in the global order."""
    return hashlib.sha256(f"{previous_digest}:{event_hash}".encode()).hexdigest()
