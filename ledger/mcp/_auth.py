"""Who may speak to the gateway's Streamable HTTP endpoint: the holder of its bearer token.

The gateway acts as one host identity for one runtime context (principal,
tenant, capabilities), so whoever reaches its HTTP endpoint acts as that
caller. Every request must carry `Authorization: Bearer <token>`, a secret
given to this gateway alone (`--token-file` or `OPLEDGER_MCP_TOKEN`).

The check is the MCP SDK's own resource-server hook: `StaticTokenVerifier` is a
`mcp.server.auth.provider.TokenVerifier`, which `Server.streamable_http_app`
puts in front of the MCP endpoint (Starlette's `AuthenticationMiddleware` with
the SDK's `BearerAuthBackend`, then `RequireAuthMiddleware`): a request without
the token is answered 401 with `WWW-Authenticate: Bearer ...` before the MCP
transport reads it.
"""

from __future__ import annotations

import hmac
import math
import os
import re
import stat
from pathlib import Path

from mcp.server.auth.provider import AccessToken

from ledger.mcp._errors import McpConfigError

__all__ = [
    "TOKEN_ENV",
    "TOKEN_MIN_BYTES",
    "StaticTokenVerifier",
    "check_token",
    "read_token_file",
]

TOKEN_ENV = "OPLEDGER_MCP_TOKEN"
TOKEN_MIN_BYTES = 32
"""Entropy a bearer token needs, in bytes: `secrets.token_urlsafe(32)`, `openssl rand -hex 32`."""

_HOW = (
    "make one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
    " or `openssl rand -hex 32`"
)
_TOKEN68 = re.compile(r"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750 b64token
_HEX = frozenset("0123456789abcdefABCDEF")
_MIN_DISTINCT = 10  # a random 64-digit hex token has fewer with probability ~1e-12
_MAX_FILE_BYTES = 4096


def check_token(token: str, where: str) -> str:
    """`token` if it can be a random secret of `TOKEN_MIN_BYTES` bytes; `McpConfigError`
    naming `where` (the file or variable it came from) if not.

    Entropy cannot be measured from one sample: what is bounded is the most a token of
    this length and alphabet can hold (4 bits a character for hex, 6 for base64), and a
    token of few distinct characters is refused as not random."""
    if not _TOKEN68.fullmatch(token):
        raise McpConfigError(
            f"{where}: a bearer token is one word of letters, digits and -._~+/ (RFC 6750);"
            f" {_HOW}"
        )
    body = token.rstrip("=")
    bits = len(body) * (4 if set(body) <= _HEX else 6)
    if bits < TOKEN_MIN_BYTES * 8 or len(set(body)) < _MIN_DISTINCT:
        held = "too few distinct characters" if bits >= TOKEN_MIN_BYTES * 8 else (
            f"at most {math.floor(bits / 8)} bytes of entropy"
        )
        raise McpConfigError(
            f"{where}: the bearer token needs at least {TOKEN_MIN_BYTES} random bytes"
            f" and this one has {held}; {_HOW}"
        )
    return token


def read_token_file(path: Path) -> str:
    """The one token in `path`, a regular file only its owner may read or write."""
    where = f"--token-file {path}"
    try:
        # Non-blocking: a FIFO put there must not hang the start (it is refused below).
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        raise McpConfigError(f"{where}: {error.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        mode = os.fstat(file.fileno()).st_mode  # of the file read, not of a path checked earlier
        if not stat.S_ISREG(mode):
            raise McpConfigError(f"{where}: not a regular file")
        if mode & 0o077:
            raise McpConfigError(
                f"{where}: group or others may access it (mode {stat.S_IMODE(mode):04o});"
                f" it holds a secret: `chmod 600 {path}`"
            )
        data = file.read(_MAX_FILE_BYTES + 1)
    if len(data) > _MAX_FILE_BYTES:
        raise McpConfigError(f"{where}: holds more than one token")
    try:
        words = data.decode("ascii").split()
    except UnicodeDecodeError:
        raise McpConfigError(f"{where}: a bearer token is ASCII; {_HOW}") from None
    if len(words) != 1:
        raise McpConfigError(f"{where}: must hold exactly one token, not {len(words)}")
    return check_token(words[0], where)


class StaticTokenVerifier:
    """The SDK's `TokenVerifier` for one shared secret: the gateway's bearer token.

    Compared in constant time; the `AccessToken` it grants carries no copy of the secret."""

    def __init__(self, token: str, *, client_id: str) -> None:
        self._token = check_token(token, "the gateway's token").encode("ascii")
        self._client_id = client_id

    async def verify_token(self, token: str) -> AccessToken | None:
        """An access token for the gateway's one client when `token` is the secret."""
        # Starlette decodes header values as Latin-1, so this cannot fail for one.
        offered = token.encode("latin-1", errors="replace")
        if not hmac.compare_digest(offered, self._token):
            return None
        return AccessToken(token="<the gateway's bearer token>", client_id=self._client_id,
                           scopes=[])
