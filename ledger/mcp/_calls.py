"""Which ledger operation an MCP `tools/call` is, and the state that carries it across rounds.

MCP 2026-07-28 dropped stream resumption: "a broken response stream loses the
in-flight request; clients MUST re-issue it as a new request with a new request
ID". The JSON-RPC ID therefore says nothing about which call a request is, and
the protocol has no idempotency key of its own. What a re-issued request keeps
is its content: the tool, the arguments and the `_meta` the client sent. So:

- A client that sends `_meta["io.opledger/idempotencyKey"]` gets exactly that
  key's operation (a second call under it with other arguments is refused by
  the ledger as `OPERATION_CONFLICT`).
- Otherwise a call that *writes* (the ledger's own tool list says it is not
  read-only) is the operation derived from the caller, the tool, the canonical
  arguments and a dedup window: the same call within the window is the same
  operation, converging on one side effect. Every derived call first asks the
  ledger for the previous window's operation, so a re-issue converges with a
  call made less than one window before, wherever the window boundary falls;
  a call two windows or more later is a new operation.
- A read gets a fresh ID: reading again has no effect to deduplicate and should
  see current data.

Between the rounds of one call (approval pending, the outcome not in yet) the
operation ID travels in the MRTR `requestState`, sealed with an HMAC over the
caller, the call's digest and an expiry, so a client can neither redirect it to
another operation nor replay it for another call or another caller.

The *caller* is the host identity and the whole trusted runtime context
(principal, tenant, environment, capabilities), as `caller_of` digests them:
two gateways sharing one host identity but configured for different callers
derive different operations and honour only their own request states.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ledger.mcp._errors import McpConfigError, RequestStateRefused
from schemas import OpledgerError, RuntimeContext, canonical_json, sha256_hex

__all__ = [
    "IDEMPOTENCY_KEY_META",
    "STATE_KEY_MIN_BYTES",
    "CallIdentity",
    "RequestStateSeal",
    "call_digest",
    "caller_of",
]

IDEMPOTENCY_KEY_META = "io.opledger/idempotencyKey"
"""A `_meta` key a client may send to name the operation itself (any string)."""

STATE_KEY_MIN_BYTES = 32
"""The shortest `requestState` key accepted: a shorter one could be guessed offline
from one state a client holds, and then seal any operation of the host."""

_PREFIX = "mcp-"
_REFUSED = "the request state is not one this gateway issued"


def caller_of(host: str, context: RuntimeContext) -> str:
    """Who a gateway's calls are from: its host identity and the trusted runtime context
    its proposals carry, digested (SHA-256 of RFC 8785 canonical JSON)."""
    return sha256_hex(
        canonical_json(
            {
                "host": host,
                "principal": context.principal,
                "tenant": context.tenant,
                "environment": context.environment,
                "capabilities": sorted(context.capabilities),
            }
        )
    )


def call_digest(caller: str, tool: str, arguments: Mapping[str, Any]) -> str | None:
    """SHA-256 of the call's meaning for `caller` (`caller_of`), RFC 8785 canonical JSON;
    None when the arguments have no canonical form (the ledger rejects those anyway)."""
    try:
        return sha256_hex(
            canonical_json({"caller": caller, "tool": tool, "arguments": dict(arguments)})
        )
    except (OpledgerError, TypeError, ValueError, RecursionError):
        return None


@dataclass(frozen=True, slots=True)
class CallIdentity:
    """How one caller's MCP calls map to ledger operation IDs (the host's namespace)."""

    caller: str
    """`caller_of(host, context)`: the same key or call of another caller is another ID."""
    window_s: float = 600.0
    """A call converges with an identical one made less than this many seconds before."""

    def from_key(self, key: str) -> str:
        """The operation a client-chosen idempotency key names."""
        digest = sha256_hex(canonical_json({"caller": self.caller, "key": key}))
        return f"{_PREFIX}k-{digest[:48]}"

    def windowed(self, digest: str, now: float | None = None) -> tuple[str, str]:
        """(this window's operation ID, the previous window's).

        The caller proposes the previous window's operation when the ledger has it,
        else this window's: a re-issue less than one window after the first call
        always finds it, however close to a window boundary the first call was."""
        at = time.time() if now is None else now
        window = math.floor(at / self.window_s)
        return f"{_PREFIX}{digest[:48]}-{window}", f"{_PREFIX}{digest[:48]}-{window - 1}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class RequestStateSeal:
    """Seals an operation ID into an MRTR `requestState` and opens it again.

    The state is bound to the caller (`caller_of`: host identity and runtime
    context), the call (tool and canonical arguments) and an expiry: MCP's server
    requirements for `requestState` ("the authenticated principal", "a short
    expiry", "an identifier for the originating request").
    """

    key: bytes
    caller: str
    ttl_s: float = 900.0

    def __post_init__(self) -> None:
        if len(self.key) < STATE_KEY_MIN_BYTES:
            raise McpConfigError(
                f"a request-state key needs at least {STATE_KEY_MIN_BYTES} bytes"
            )

    def seal(self, operation_id: str, digest: str, now: float | None = None) -> str:
        """The opaque state for the next round of the call `digest`."""
        at = time.time() if now is None else now
        payload = json.dumps(
            {"v": 1, "caller": self.caller, "op": operation_id, "call": digest,
             "exp": int(at + self.ttl_s)},
            separators=(",", ":"), sort_keys=True,
        ).encode()
        mac = hmac.new(self.key, payload, hashlib.sha256).digest()
        return f"{_b64(payload)}.{_b64(mac)}"

    def open(self, state: str, digest: str | None, now: float | None = None) -> str:
        """The operation ID in `state`, if this gateway sealed it for this very call."""
        try:
            payload_text, mac_text = state.split(".", 1)
            payload = _unb64(payload_text)
            mac = _unb64(mac_text)
        except (ValueError, UnicodeError, binascii.Error):
            raise RequestStateRefused(_REFUSED) from None
        expected = hmac.new(self.key, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, expected):
            raise RequestStateRefused(_REFUSED)
        body = json.loads(payload)
        if body.get("caller") != self.caller:
            raise RequestStateRefused("the request state belongs to another caller")
        if digest is None or body.get("call") != digest:
            raise RequestStateRefused("the request state belongs to another call")
        at = time.time() if now is None else now
        if at > float(body.get("exp", 0)):
            raise RequestStateRefused("the request state has expired; call the tool again")
        return str(body["op"])
