"""Redaction of tool output before it leaves the executor (seed 001: "do not trust tool results").

Tool output goes back into a model's context and into the ledger's result
store, so the executor removes or limits, deterministically:

- values under secret-looking keys (`token`, `api_key`, `password`, `cookie`, ...);
- secret-looking text: `Bearer ...`, `Authorization:` and `Cookie:` headers,
  `password=...`-style pairs, JWTs, AWS access key IDs, well-known API token
  formats, private key blocks, credentials inside URLs, and this executor's
  own secret values wherever they appear;
- stack traces (the whole string: a partial trace still shows internals);
- control characters except `\\n` and `\\t`, plus invisible bidi and
  zero-width characters that hide text from a human reviewer;
- active HTML: `<script>`, `<style>`, `<iframe>`, `<object>`, `<embed>`
  elements, tags with `on...=` handlers, and `javascript:`/`vbscript:` URLs;
- strings longer than a limit (cut, with a marker) and lists longer than a
  limit (cut), and nesting deeper than a limit.

The result is the redacted copy plus the RFC 6901 pointers of every value that
changed, so the caller knows which fields are not what the tool returned.
Redacting twice changes nothing more: the placeholders match no rule.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from policy import json_pointer

__all__ = [
    "DEFAULT_POLICY",
    "REDACTED",
    "Redacted",
    "RedactionPolicy",
    "redact",
    "redact_text",
]

REDACTED = "[REDACTED]"
"""What a removed secret is replaced with."""
_STACK_TRACE = "[REDACTED:stack_trace]"
_BINARY = "[REDACTED:binary]"
_TOO_DEEP = "[REDACTED:too_deep]"
_MAX_ROUNDS = 4

# Key names are compared after lower-casing and dropping `-` and `_`, so
# `X-Api-Key`, `api_key` and `apiKey` are one name.
_SENSITIVE_KEYS = frozenset(
    {
        "token",
        "accesstoken",
        "refreshtoken",
        "idtoken",
        "authtoken",
        "bearer",
        "jwt",
        "apikey",
        "xapikey",
        "secret",
        "clientsecret",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "authorization",
        "proxyauthorization",
        "cookie",
        "cookies",
        "setcookie",
        "session",
        "sessionid",
        "credentials",
        "credential",
        "privatekey",
        "awssecretaccesskey",
        "signature",
    }
)
_SENSITIVE_SUFFIXES = (
    "token",
    "secret",
    "password",
    "apikey",
    "cookie",
    "credentials",
    "privatekey",
    "sessionid",
    "accesskey",
)


def _normalize_key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


@dataclass(frozen=True, slots=True)
class RedactionPolicy:
    """Limits and extra secrets for `redact`. The defaults suit the sample catalog."""

    max_string_chars: int = 20_000
    """Longer strings are cut to exactly this many characters, marker included."""
    max_list_items: int = 1_000
    max_depth: int = 32
    truncation_marker: str = "…[truncated]"
    sensitive_keys: frozenset[str] = _SENSITIVE_KEYS
    """Normalized key names (lower case, no `-` or `_`) whose values are always removed."""
    sensitive_key_suffixes: tuple[str, ...] = _SENSITIVE_SUFFIXES
    secret_values: tuple[str, ...] = field(default=())
    """Exact values (this executor's secrets) removed wherever they appear."""

    def __post_init__(self) -> None:
        if self.max_string_chars <= len(self.truncation_marker):
            raise ValueError("max_string_chars must be longer than the truncation marker")
        if self.max_list_items < 0 or self.max_depth < 1:
            raise ValueError("max_list_items must be >= 0 and max_depth >= 1")

    def with_secrets(self, values: Iterable[str], *, min_length: int = 8) -> RedactionPolicy:
        """This policy plus secret values to scrub. Short values are skipped: a
        four-character secret would also match ordinary words and numbers."""
        kept = {v for v in values if len(v) >= min_length}
        # Longest first, so a secret containing another is removed whole.
        ordered = tuple(sorted(kept | set(self.secret_values), key=lambda v: (-len(v), v)))
        return replace(self, secret_values=ordered)

    def is_sensitive_key(self, name: str) -> bool:
        """Whether a value under key `name` is always removed."""
        key = _normalize_key(name)
        return key in self.sensitive_keys or key.endswith(self.sensitive_key_suffixes)


DEFAULT_POLICY = RedactionPolicy()
"""The policy the runner uses unless told otherwise."""


@dataclass(frozen=True, slots=True)
class Redacted:
    """A redacted copy and the pointers (relative to the input) of what changed."""

    value: Any
    pointers: tuple[str, ...]

    @property
    def changed(self) -> bool:
        """Whether anything was redacted or truncated."""
        return bool(self.pointers)


# --------------------------------------------------------------------- rules

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b\u2060\ufeff\u202a-\u202e\u2066-\u2069]")

_TRACE_MARKERS = re.compile(
    r"Traceback \(most recent call last\)|^goroutine \d+ \[[a-z ]+\]:", re.MULTILINE
)
_TRACE_FRAME = re.compile(
    r"^\s*(?:"
    r'File "[^"\n]+", line \d+'  # Python
    r"|at [\w$.<>/]+\((?:[\w$.-]+:\d+|Native Method|Unknown Source)\)"  # Java / .NET
    r"|at (?:async )?(?:[^\s()]+ \()?[^\s()]+:\d+:\d+\)?"  # JavaScript
    r")",
    re.MULTILINE,
)

_ACTIVE_ELEMENTS = "script|style|iframe|object|embed|applet|noscript|template"
_HTML_BLOCK = re.compile(rf"<({_ACTIVE_ELEMENTS})\b[^>]*>.*?</\1\s*>", re.IGNORECASE | re.DOTALL)
# An opening tag without its end: the browser treats the rest as script.
_HTML_OPEN = re.compile(rf"<(?:{_ACTIVE_ELEMENTS})\b.*", re.IGNORECASE | re.DOTALL)
_HTML_CLOSE = re.compile(rf"</(?:{_ACTIVE_ELEMENTS})\s*>", re.IGNORECASE)
_HTML_HANDLER_TAG = re.compile(
    r"<[A-Za-z][^>]*?(?:\son[a-z]+\s*=|(?:java|vb)script\s*:)[^>]*>", re.IGNORECASE
)
_SCRIPT_URL = re.compile(r"\b(?:java|vb)script\s*:", re.IGNORECASE)

_NOT_PLACEHOLDER = r"(?!\[REDACTED)"
_TEXT_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)",
            re.DOTALL,
        ),
        REDACTED,
    ),
    (
        re.compile(
            rf"(?im)^(\s*(?:set-cookie|cookie|authorization|proxy-authorization|x-api-key)"
            rf"\s*:\s*){_NOT_PLACEHOLDER}\S[^\r\n]*"
        ),
        rf"\g<1>{REDACTED}",
    ),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9\-._~+/]{16,}=*"), rf"\g<1>{REDACTED}"),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*"), REDACTED),
    (re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}\b"), REDACTED),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36,}\b|\bgithub_pat_[A-Za-z0-9_]{22,}"), REDACTED),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"), REDACTED),
    (re.compile(r"\b[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"), REDACTED),
    (re.compile(r"\bsk-(?:proj-)?[A-Za-z0-9_-]{20,}"), REDACTED),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b"), REDACTED),
    (
        re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@"),
        rf"\g<1>{REDACTED}@",
    ),
    (
        re.compile(
            r"(?i)\b((?:[a-z0-9]+[_-])*(?:api[_-]?key|secret|password|passwd|pwd|token"
            r"|access[_-]?key|secret[_-]?key|client[_-]?secret|session[_-]?id|private[_-]?key))"
            rf"(\s*[\"']?\s*[:=]\s*[\"']?){_NOT_PLACEHOLDER}[^\s\"'&,;<>]+"
        ),
        rf"\g<1>\g<2>{REDACTED}",
    ),
)


def _is_stack_trace(text: str) -> bool:
    if _TRACE_MARKERS.search(text):
        return True
    # One frame-like line may be prose; two or more is a trace.
    frames = _TRACE_FRAME.findall(text)
    return len(frames) >= 2


def _strip_html(text: str) -> str:
    text = _HTML_BLOCK.sub("", text)
    text = _HTML_OPEN.sub("", text)
    text = _HTML_CLOSE.sub("", text)
    text = _HTML_HANDLER_TAG.sub("", text)
    return _SCRIPT_URL.sub("blocked:", text)


def _scrub(text: str, policy: RedactionPolicy) -> str:
    """Every string rule except truncation, in a fixed order."""
    if _is_stack_trace(text):
        return _STACK_TRACE
    text = _CONTROL.sub("", text)
    if "<" in text or "script" in text.lower():
        text = _strip_html(text)
    for secret in policy.secret_values:
        if secret in text:
            text = text.replace(secret, REDACTED)
    for pattern, replacement in _TEXT_RULES:
        text = pattern.sub(replacement, text)
    return text


def _truncate(text: str, policy: RedactionPolicy) -> str:
    if len(text) <= policy.max_string_chars:
        return text
    keep = policy.max_string_chars - len(policy.truncation_marker)
    return text[:keep] + policy.truncation_marker


def redact_text(text: str, policy: RedactionPolicy = DEFAULT_POLICY) -> tuple[str, bool]:
    """One string through every rule; returns the result and whether it changed."""
    result = text
    # Removing text can join what was apart (a tag between two halves of a
    # token, a cut right after `password=`): repeat until nothing changes, so
    # that redacting the output again is a no-op. Two rounds settle real data;
    # the bound only guards against a pathological input.
    for _ in range(_MAX_ROUNDS):
        scrubbed = _truncate(_scrub(result, policy), policy)
        if scrubbed == result:
            break
        result = scrubbed
    return result, result != text


# ----------------------------------------------------------------- traversal


def _blank_or_placeholder(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value in ("", REDACTED))


def redact(value: Any, policy: RedactionPolicy = DEFAULT_POLICY) -> Redacted:
    """A redacted deep copy of a JSON value and the pointers of every changed value.

    Accepts JSON types (tuples count as arrays); `bytes` become a placeholder.
    Any other type raises `TypeError`: tool output must be JSON.
    """
    pointers: list[str] = []
    copy = _walk(value, (), 0, policy, pointers)
    return Redacted(copy, tuple(pointers))


def _walk(
    value: Any,
    path: tuple[object, ...],
    depth: int,
    policy: RedactionPolicy,
    pointers: list[str],
) -> Any:
    if isinstance(value, str):
        result, changed = redact_text(value, policy)
        if changed:
            pointers.append(json_pointer(path))
        return result
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        pointers.append(json_pointer(path))
        return _BINARY
    if isinstance(value, Mapping | list | tuple) and depth >= policy.max_depth:
        pointers.append(json_pointer(path))
        return _TOO_DEEP
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"object keys must be strings, got {type(key).__name__}")
            # Nothing to hide in an empty value; an earlier placeholder stays as it is.
            if policy.is_sensitive_key(key) and not _blank_or_placeholder(item):
                pointers.append(json_pointer((*path, key)))
                out[key] = REDACTED
                continue
            out[key] = _walk(item, (*path, key), depth + 1, policy, pointers)
        return out
    if isinstance(value, list | tuple):
        items = [
            _walk(item, (*path, index), depth + 1, policy, pointers)
            for index, item in enumerate(value[: policy.max_list_items])
        ]
        if len(value) > policy.max_list_items:
            pointers.append(json_pointer(path))
        return items
    raise TypeError(f"not a JSON value: {type(value).__name__}")
