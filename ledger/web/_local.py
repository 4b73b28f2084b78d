"""The embedded default's own token issuer: a key pair under `<home>/web/`.

With no identity provider, `opledger web` checks tokens against this key, and
`opledger web token --as NAME --group GROUP` signs one. Whoever can read the
private key can sign in as anyone, which is the same trust as writing the
database (break glass): the key is created 0600 in the home directory, and the
page only listens on loopback unless told otherwise.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

__all__ = ["LOCAL_AUDIENCE", "LOCAL_ISSUER", "LocalSigner"]

LOCAL_ISSUER = "opledger-local"
LOCAL_AUDIENCE = "opledger-approvals"


class LocalSigner:
    """The key pair in `directory` (created on first use), and tokens signed with it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.private_path = directory / "signing-key.pem"
        self.public_path = directory / "signing-key.pub.pem"

    def public_key_pem(self) -> str:
        """The public key (created with the pair if there is none yet)."""
        self._ensure()
        return self.public_path.read_text(encoding="ascii")

    def token(self, name: str, groups: list[str], *, lifetime_s: int = 8 * 3600) -> str:
        """A token for `name` in `groups`, valid for `lifetime_s` seconds."""
        self._ensure()
        key = serialization.load_pem_private_key(self.private_path.read_bytes(), password=None)
        now = int(time.time())
        claims = {
            "iss": LOCAL_ISSUER, "aud": LOCAL_AUDIENCE, "sub": name, "groups": groups,
            "iat": now, "exp": now + lifetime_s,
        }
        return jwt.encode(claims, key, algorithm="EdDSA")  # type: ignore[arg-type]

    def _ensure(self) -> None:
        if self.private_path.exists():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        key = Ed25519PrivateKey.generate()
        private = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(self.private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(private)
        public = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.public_path.write_bytes(public)
