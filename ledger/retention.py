"""What the ledger keeps of a rejected proposal's arguments.

A rejected proposal is recorded (auditors see every attempt, and the budget
counts them), but its arguments are kept only when they are plain JSON of a
modest size. Otherwise the event says what was left out: its size and hash,
so that an auditor can still match it against a copy the host kept. Without
this bound, 2,400 rejected proposals of 512 KiB each were 2.4 GB of ledger,
and a value the event encoder cannot write (a lone surrogate, an integer
beyond 64 bits) failed the append of every proposal stored with it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from policy import DEFAULT_LIMITS, json_value_issue

__all__ = ["KEPT_REJECTED_BYTES", "kept_arguments"]

KEPT_REJECTED_BYTES = 16 * 1024
"""Arguments of a rejected proposal up to this size (encoded) are kept in full."""


def kept_arguments(raw: Any, limit: int = KEPT_REJECTED_BYTES) -> tuple[Any, dict[str, Any] | None]:
    """`(arguments to store, what was omitted)` for a rejected proposal's raw arguments.

    Either the arguments as sent and None, or None and a description of what
    was left out: `{"reason": "too_large" | "not_json", "bytes": n, "sha256": h}`
    (no hash for a Python object that is not JSON at all).
    """
    if isinstance(raw, str | bytes):
        text = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
        try:
            text.decode("utf-8")
        except UnicodeDecodeError:
            return None, _omitted("not_json", text)
        if len(text) > limit:
            return None, _omitted("too_large", text)
        return (raw if isinstance(raw, str) else text.decode("utf-8")), None
    if json_value_issue(raw, DEFAULT_LIMITS.max_depth) is not None:
        return None, {"reason": "not_json", "type": type(raw).__name__}
    encoded = orjson.dumps(raw)
    if len(encoded) > limit:
        return None, _omitted("too_large", encoded)
    return raw, None


def _omitted(reason: str, data: bytes) -> dict[str, Any]:
    return {"reason": reason, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
