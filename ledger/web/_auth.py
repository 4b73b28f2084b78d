"""Who is at the approval page: a bearer token (JWT) checked against a configured key.

The page never keeps passwords and never decides who someone is. An identity
provider (or the reverse proxy in front of the page) issues a JWT; the page
checks its signature against a pinned public key or a JWKS, its issuer,
audience and lifetime, and reads two claims: who (`user_claim`, `sub` by
default) and which groups (`roles_claim`). Which approver roles a group
carries is this deployment's configuration (`role_map`), never the token's
say: a group nobody mapped gives no role.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt

from schemas import ErrorCategory, OpledgerError

__all__ = ["Approver", "NotAuthenticated", "TokenSettings", "TokenVerifier"]

_NAME = re.compile(r"^[A-Za-z0-9@._+-]{1,128}$")
"""What a recorded approver name may hold: an IdP's user ID or e-mail, nothing more."""


class NotAuthenticated(OpledgerError):
    """The bearer token is missing, unsigned, expired, or not for this page."""

    category = ErrorCategory.UNAUTHORIZED
    code = "NOT_AUTHENTICATED"


@dataclass(frozen=True)
class TokenSettings:
    """How bearer tokens are checked, and how their groups map to approver roles."""

    issuer: str
    audience: str
    public_key_pem: str | None = None
    """A pinned public key (PEM): every token must be signed by it."""
    jwks: Mapping[str, Any] | None = None
    """A JSON Web Key Set (as read from a file): the token's `kid` picks the key."""
    jwks_url: str | None = None
    """Where the identity provider publishes its JWKS (fetched and cached by PyJWT)."""
    algorithms: tuple[str, ...] = ("RS256", "ES256", "EdDSA")
    """Accepted signature algorithms; never `none`, never an HMAC one (a public key
    given as an HMAC secret would let anyone who has it sign)."""
    user_claim: str = "sub"
    roles_claim: str = "groups"
    role_map: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """Group (a value of `roles_claim`) → the approver roles it carries."""
    groups_are_roles: bool = False
    """Each group is the approver role of its name (the home's own key only: there,
    whoever signs tokens holds the database anyway)."""
    leeway_s: int = 30

    def __post_init__(self) -> None:
        sources = [s for s in (self.public_key_pem, self.jwks, self.jwks_url) if s]
        if len(sources) != 1:
            raise ValueError("give exactly one of a public key, a JWKS or a JWKS URL")
        if any(a.upper().startswith("HS") or a.lower() == "none" for a in self.algorithms):
            raise ValueError("only public-key signature algorithms are accepted")

    @classmethod
    def jwks_from_file(cls, path: Path) -> Mapping[str, Any]:
        """A JWKS file's contents (`ValueError` if it is not one)."""
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
            raise ValueError(f"{path} is not a JSON Web Key Set")
        return data


@dataclass(frozen=True)
class Approver:
    """A person the page verified: their name, their approver roles, until when."""

    name: str
    roles: frozenset[str]
    groups: tuple[str, ...]
    expires_at: datetime


class TokenVerifier:
    """Checks bearer tokens as `TokenSettings` say."""

    def __init__(self, settings: TokenSettings) -> None:
        self.settings = settings
        self._jwks = jwt.PyJWKSet.from_dict(dict(settings.jwks)) if settings.jwks else None
        self._jwks_client = jwt.PyJWKClient(settings.jwks_url) if settings.jwks_url else None

    def verify(self, token: str) -> Approver:
        """The approver the token names; `NotAuthenticated` for anything else."""
        s = self.settings
        try:
            claims = jwt.decode(
                token,
                self._key(token),
                algorithms=list(s.algorithms),
                audience=s.audience,
                issuer=s.issuer,
                leeway=s.leeway_s,
                options={"require": ["exp", "iat", "iss", "aud", s.user_claim]},
            )
        except (jwt.PyJWTError, ValueError) as error:
            raise NotAuthenticated(f"the token was not accepted ({type(error).__name__})") from None
        name = claims.get(s.user_claim)
        if not isinstance(name, str) or not _NAME.match(name):
            raise NotAuthenticated(f"the token's {s.user_claim} is not a usable name")
        groups = _groups(claims.get(s.roles_claim))
        if s.groups_are_roles:
            roles = frozenset(groups)
        else:
            roles = frozenset(role for group in groups for role in s.role_map.get(group, ()))
        try:
            expires_at = datetime.fromtimestamp(claims["exp"], UTC)
        except (OverflowError, OSError, ValueError, TypeError):
            raise NotAuthenticated("the token's exp is not a usable time") from None
        return Approver(name, roles, groups, expires_at)

    def _key(self, token: str) -> Any:
        s = self.settings
        if s.public_key_pem is not None:
            return s.public_key_pem
        if self._jwks_client is not None:
            return self._jwks_client.get_signing_key_from_jwt(token).key
        assert self._jwks is not None
        kid = jwt.get_unverified_header(token).get("kid")
        keys = [key for key in self._jwks.keys if kid is None or key.key_id == kid]
        if len(keys) == 1:
            return keys[0].key
        if keys:  # no `kid` and several keys: the one that verifies it, if any
            for key in keys:
                try:
                    jwt.decode(token, key.key, algorithms=list(s.algorithms),
                               options={"verify_aud": False, "verify_iss": False,
                                        "verify_exp": False})
                except jwt.PyJWTError:
                    continue
                return key.key
        raise NotAuthenticated("the token names a key the page does not know")


def _groups(value: Any) -> tuple[str, ...]:
    """A groups claim as a tuple: a list of strings, or one space-separated string."""
    if isinstance(value, str):
        return tuple(value.split())
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, str))
    return ()
