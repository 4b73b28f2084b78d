"""An executor's own secrets: loaded per process, never seen by the ledger service.

Sources, later ones winning:

1. `--secrets FILE`: a JSON object of name → string value.
2. Environment variables `OPLEDGER_SECRET_<NAME>`; the name is lower-cased,
   so `OPLEDGER_SECRET_EMAIL_PROVIDER_DB` is the secret `email_provider_db`.

Names are case-insensitive (stored lower case). Errors name the file or the
key, never a value.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from executors._errors import SecretsError

__all__ = ["SECRET_ENV_PREFIX", "SecretsError", "load_secrets"]

SECRET_ENV_PREFIX = "OPLEDGER_SECRET_"
"""Environment variables with this prefix become secrets of the executor."""

_NAME = re.compile(r"^[a-z0-9_]{1,64}$")


def _name(raw: str, source: str) -> str:
    name = raw.lower()
    if not _NAME.match(name):
        raise SecretsError(f"{source}: secret name {raw!r} must match [A-Za-z0-9_]{{1,64}}")
    return name


def load_secrets(
    path: Path | None = None, environ: Mapping[str, str] | None = None
) -> Mapping[str, str]:
    """The secrets of this executor process, read-only."""
    secrets: dict[str, str] = {}
    if path is not None:
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise SecretsError(f"{path}: cannot read secrets file ({exc.strerror})") from None
        except ValueError:
            # The decoder's message may quote part of the file, that is a secret.
            raise SecretsError(f"{path}: secrets file is not valid JSON") from None
        if not isinstance(document, dict):
            raise SecretsError(f"{path}: secrets file must hold a JSON object")
        for key, value in document.items():
            if not isinstance(value, str):
                raise SecretsError(f"{path}: secret {key!r} must be a string")
            secrets[_name(key, str(path))] = value
    env = os.environ if environ is None else environ
    for key, value in env.items():
        if key.startswith(SECRET_ENV_PREFIX) and len(key) > len(SECRET_ENV_PREFIX):
            secrets[_name(key[len(SECRET_ENV_PREFIX) :], "environment")] = value
    return MappingProxyType(secrets)
