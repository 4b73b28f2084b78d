"""Canonical JSON (RFC 8785) and the hashes built on it.

Hashes bind approvals to exact arguments and chain the ledger's events, so two
processes must produce byte-identical encodings of the same value. RFC 8785 fixes
key order, number formatting and string escaping; `rfc8785` implements it and
refuses integers beyond 2**53 rather than silently losing precision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Annotated, Any

import orjson
import rfc8785
from pydantic import WithJsonSchema

from schemas._exceptions import CanonicalizationError

__all__ = ["DIGEST_PATTERN", "Digest", "canonical_json", "proposal_hash", "sha256_hex"]

_SAFE_INT = 2**53 - 1
_SURROGATES_START = "\ud800"


def _orjson_is_canonical(value: Any) -> bool:
    """Whether orjson with sorted keys writes exactly RFC 8785 for `value`.

    True for JSON without floats, with integers in the interoperable range and
    object keys below U+D800: there, RFC 8785's UTF-16 key order equals
    orjson's code-point order and both escape strings identically (the
    equivalence is property-tested against `rfc8785`). Anything else takes
    the reference implementation.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if item is None or item is True or item is False or type(item) is str:
            continue
        if type(item) is int:
            if -_SAFE_INT <= item <= _SAFE_INT:
                continue
            return False
        if type(item) is list:
            stack.extend(item)
            continue
        if type(item) is dict:
            for key in item:
                if type(key) is not str or (key and max(key) >= _SURROGATES_START):
                    return False
            stack.extend(item.values())
            continue
        return False  # floats, tuples, subclasses: the reference implementation decides
    return True


def canonical_json(value: Any) -> bytes:
    """Encode *value* as RFC 8785 canonical JSON bytes.

    `rfc8785` is the reference; for the common case it is 10-20 times slower
    than orjson, which produces identical bytes there (see `_orjson_is_canonical`).
    """
    if _orjson_is_canonical(value):
        try:
            return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except TypeError:
            pass  # e.g. a lone surrogate in a string: let the reference report it
    try:
        return rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as exc:
        raise CanonicalizationError(str(exc)) from None


DIGEST_PATTERN = r"^[0-9a-f]{64}$"
"""What `sha256_hex` writes: a proposal hash, an event or head digest."""

Digest = Annotated[str, WithJsonSchema({"type": "string", "pattern": DIGEST_PATTERN})]
"""A digest the ledger writes (`sha256_hex`), as a field of a message it sends: published
with `DIGEST_PATTERN`, and read as any string (only the ledger produces one)."""


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
