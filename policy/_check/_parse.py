"""Stage 1, parse: the model's arguments, often a JSON string, into a JSON object.

What comes out of this stage is JSON the rest of the system can always hash,
store and publish: an object of plain JSON values, no deeper than
`ArgumentLimits.max_depth`, no larger than `max_bytes` encoded, integers in
the interoperable range of I-JSON (RFC 7493) and RFC 8785, finite numbers and
valid Unicode text. Anything else is a finding here, with a pointer, rather
than an exception three layers down: a lone surrogate, an integer beyond 64
bits or a 300-level nesting used to pass the check and then fail the event
encoder (and with it every proposal stored in the same append).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from policy._check._structure import json_type
from policy._errors import ArgumentLimitsError
from policy._registry import json_pointer
from schemas import CheckStage, ValidationIssue

__all__ = ["DEFAULT_LIMITS", "ArgumentLimits", "json_value_issue", "parse_arguments"]

_MAX_SAFE_INTEGER = 2**53 - 1
"""RFC 7493 §2.2 and RFC 8785 §3.2.2.3: integers beyond this lose precision as doubles."""


@dataclass(frozen=True, slots=True)
class ArgumentLimits:
    """How large and how deep a proposal's arguments may be, and how many findings it gets.

    The defaults keep every message derived from one proposal (the stored
    events, the reply with its normalized arguments, the lease) well inside
    NATS's default 1 MiB payload, even when the arguments come as JSON text
    whose escapes double in size once stored inside another JSON document.
    """

    max_bytes: int = 256 * 1024
    """Encoded size of the arguments (the JSON text as sent, or an object once encoded)."""
    max_depth: int = 32
    """Nesting of objects and arrays; the arguments object itself is depth 1."""
    max_issues: int = 50
    """Findings reported per proposal; the rest are summarized in one last finding."""

    def __post_init__(self) -> None:
        if self.max_bytes < 2 or self.max_depth < 1 or self.max_issues < 1:
            raise ArgumentLimitsError("argument limits must be positive")


DEFAULT_LIMITS = ArgumentLimits()


def _issue(code: str, message: str, **extra: Any) -> ValidationIssue:
    return ValidationIssue(
        stage=CheckStage.PARSE, code=code, message=message, repairable=True, **extra
    )


def _too_large(size: int, limits: ArgumentLimits) -> ValidationIssue:
    return _issue(
        "too_large",
        f"arguments are {size} bytes; at most {limits.max_bytes} are accepted",
        expected=limits.max_bytes,
        actual=size,
    )


def parse_arguments(
    raw: Any, limits: ArgumentLimits = DEFAULT_LIMITS
) -> tuple[dict[str, Any] | None, list[ValidationIssue]]:
    """The arguments as a dict of plain JSON, or the one finding that explains why not."""
    value = raw
    text = isinstance(raw, str | bytes)
    if text:
        size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
        if size > limits.max_bytes:
            return None, [_too_large(size, limits)]
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            # orjson's message names line, column and character: enough for a model
            # to fix. It also refuses text that is not valid UTF-8.
            return None, [_issue("json_syntax", f"arguments are not valid JSON: {exc}")]
    if not isinstance(value, dict):
        return None, [
            _issue(
                "not_an_object",
                "arguments must be a JSON object",
                expected="object",
                actual=json_type(value),
            )
        ]
    problem = json_value_issue(value, limits.max_depth)
    if problem is not None:
        return None, [problem]
    if not text:
        # Only now is the object known to encode; text was measured as sent.
        size = len(orjson.dumps(value))
        if size > limits.max_bytes:
            return None, [_too_large(size, limits)]
    return value, []


def json_value_issue(value: Any, max_depth: int) -> ValidationIssue | None:
    """The first reason `value` is not plain, storable JSON, as a finding; None if it is.

    Iterative, so that depth is a finding and never a RecursionError. Exact
    types only: a `bool` is not an integer here, and a tuple, a set, bytes or
    any other Python object (possible through the Python API, never from JSON
    text) is not JSON at all.
    """
    stack: list[tuple[Any, tuple[object, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        kind = type(item)
        if kind is str:
            if not item.isascii() and not _valid_unicode(item):
                return _at(
                    path, "invalid_string", "text must be valid Unicode (no lone surrogates)"
                )
        elif kind is dict or kind is list:
            if len(path) >= max_depth:
                return _at(
                    path,
                    "too_deep",
                    f"arguments may nest at most {max_depth} objects or arrays deep",
                    expected=max_depth,
                )
            if kind is dict:
                for key, child in item.items():
                    if type(key) is not str:
                        return _at(path, "not_json", "object keys must be strings")
                    if not key.isascii() and not _valid_unicode(key):
                        return _at(
                            path, "invalid_string", "property names must be valid Unicode"
                        )
                    stack.append((child, (*path, key)))
            else:
                stack.extend((child, (*path, index)) for index, child in enumerate(item))
        elif kind is int:
            if not -_MAX_SAFE_INTEGER <= item <= _MAX_SAFE_INTEGER:
                return _at(
                    path,
                    "number_out_of_range",
                    "integers must lie within ±(2**53 - 1); send larger numbers as strings",
                    expected=f"-{_MAX_SAFE_INTEGER}..{_MAX_SAFE_INTEGER}",
                )
        elif kind is float:
            if not math.isfinite(item):
                return _at(path, "not_finite", "numbers must be finite (no NaN or infinity)")
        elif item is not None and kind is not bool:
            return _at(path, "not_json", f"{kind.__name__} is not a JSON value")
    return None


def _valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _at(path: tuple[object, ...], code: str, message: str, **extra: Any) -> ValidationIssue:
    return _issue(code, message, path=json_pointer(path), **extra)
