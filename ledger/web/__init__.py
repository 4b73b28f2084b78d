"""The approval web page (`opledger web`): approvers decide in a browser.

- `build_web_app(ledger, WebOptions(verifier=TokenVerifier(TokenSettings(...))))`:
  the Starlette app.
- `TokenSettings`, `TokenVerifier`, `Approver`: bearer tokens (JWT) checked against a
  pinned key or a JWKS; groups mapped to approver roles by configuration.
- `LocalSigner`: the embedded default's own key pair, for a page on loopback with
  no identity provider (`opledger web token`).
"""

from ledger.web._app import SESSION_COOKIE, WebOptions, build_web_app
from ledger.web._auth import Approver, NotAuthenticated, TokenSettings, TokenVerifier
from ledger.web._local import LOCAL_AUDIENCE, LOCAL_ISSUER, LocalSigner

__all__ = [
    "LOCAL_AUDIENCE",
    "LOCAL_ISSUER",
    "SESSION_COOKIE",
    "Approver",
    "LocalSigner",
    "NotAuthenticated",
    "TokenSettings",
    "TokenVerifier",
    "WebOptions",
    "build_web_app",
]
