"""Canonical JSON (RFC 8785) and the hashes built on it.

Hashes bind approvals to exact arguments and chain the ledger's events, so two
processes must produce byte-identical encodings of the same value. RFC 8785 fixes
key order, number formatting and string escaping; `rfc8785` implements it and
refuses integers beyond 2**53 rather than silently losing precision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import rfc8785

__all__ = ["CanonicalizationError", "canonical_json", "proposal_hash", "sha256_hex"]


class CanonicalizationError(ValueError):
    """A value has no canonical JSON form (NaN, huge integer, non-JSON type)."""


def canonical_json(value: Any) -> bytes:
    """Encode *value* as RFC 8785 canonical JSON bytes."""
    try:
        return rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as exc:
        raise CanonicalizationError(str(exc)) from None


def sha256_hex(data: bytes) -> str:
    """Hex SHA-256 of *data*."""
    return hashlib.sha256(data).hexdigest()


def proposal_hash(
    *,
    tool: str,
    tool_version: str,
    arguments: Mapping[str, Any],
    actor: str,
    tenant: str,
) -> str:
    """SHA-256 over the canonical proposal: what an approval is bound to.

    Only the fields that define the effect are hashed; identifiers such as the
    proposal ID are not, so the same call re-proposed hashes the same.
    """
    return sha256_hex(
        canonical_json(
            {
                "tool": tool,
                "tool_version": tool_version,
                "arguments": dict(arguments),
                "actor": actor,
                "tenant": tenant,
            }
        )
    )
