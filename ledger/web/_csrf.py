"""Forms that only the page itself can submit (cross-site request forgery).

Three layers, each enough on its own against a form on another site: the
session cookie is `SameSite=Strict` (the browser does not send it with a
cross-site request), every state-changing form carries a token derived from
the session with a key only this process holds, and a request whose `Origin`
is another site is refused. Behind a proxy that adds `Authorization` to every
request the cookie layer does not apply, and the other two still do.
"""

from __future__ import annotations

import hashlib
import hmac
import os

__all__ = ["CsrfGuard"]


class CsrfGuard:
    """Derives and checks the per-session form token."""

    def __init__(self, key: bytes | None = None) -> None:
        # A fresh key per process: restarting the page only asks for a reload.
        self._key = key or os.urandom(32)

    def token_for(self, session: str) -> str:
        """The form token of `session` (the bearer token, or the login nonce)."""
        return hmac.new(self._key, session.encode(), hashlib.sha256).hexdigest()

    def check(self, session: str, given: str) -> bool:
        """Whether `given` is `session`'s form token (in constant time)."""
        # As bytes: `compare_digest` raises on a str that is not ASCII (a form may send
        # anything), which answered 500 instead of the refusal.
        return hmac.compare_digest(
            self.token_for(session).encode(), given.encode("utf-8", "replace")
        )
