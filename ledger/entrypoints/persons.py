"""What the commands a person runs over NATS share: their identity, the server, the
connection, and the one line that says the broker refused them.

An approver (`approvals approve|deny`) and an operator (`ops cancel|resolve|retry`)
each act as their own NKey identity: the broker lets that identity publish only
on its own subject, and the ledger records the subject's name. Nothing here
lets a flag claim a name or a role.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

from nats.aio.client import Client
from pydantic import ValidationError

from ledger.client import LedgerUnavailable
from ledger.config import ConfigError, Settings
from ledger.embedded import running_stack
from ledger.nats import Identity, Role, connect_as
from ledger.nats.errors import CredentialsError
from schemas import ErrorCategory, OperationStatus, OpledgerError, PlanStatus, check_token

__all__ = [
    "NatsRefusedIdentity",
    "add_identity_arguments",
    "connected",
    "invalid_request",
    "nats_url",
    "person_identity",
    "request_as_person",
    "token",
]


class NatsRefusedIdentity(OpledgerError):
    """NATS refused the person's publish: the seed is not the named identity's."""

    category = ErrorCategory.UNAUTHORIZED
    code = "NOT_THIS_IDENTITY"


_SEED_PREFIX = {Role.APPROVER: "approver", Role.OPERATOR: "operator"}


def add_identity_arguments(parser: argparse.ArgumentParser, role: Role, flag: str) -> None:
    """`--<flag> NAME`, `--seed` and `--nats-url` for a person acting as `role`."""
    prefix = _SEED_PREFIX[role]
    parser.add_argument(
        f"--{flag}",
        dest="identity",
        metavar="NAME",
        help=f"your {prefix} identity: the request is signed with its NKey seed"
        " (default: none; required unless --break-glass)",
    )
    parser.add_argument(
        "--seed",
        type=Path,
        help=f"NAME's NKey seed file (default: <creds>/{prefix}-NAME.nk)",
    )
    parser.add_argument(
        "--nats-url",
        help="the NATS server(s) (default: $OPLEDGER_NATS_URL, else the running stack's)",
    )


def token(value: str, flag: str) -> str:
    """`value` as an identity name, or one line that says it is none."""
    try:
        return check_token(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r} is not a valid identity name") from None


def person_identity(
    role: Role, name: str | None, seed: Path | None, settings: Settings, flag: str
) -> Identity:
    """The identity `name` of `role` from its seed (`seed`, or the creds folder's)."""
    if not name:
        raise ConfigError(f"name your {_SEED_PREFIX[role]} identity with --{flag} NAME")
    checked = token(name, f"--{flag}")
    creds = settings.creds_dir or settings.home / "creds"
    path = seed or Path(creds) / f"{_SEED_PREFIX[role]}-{checked}.nk"
    try:
        return Identity.from_seed_file(role, checked, path)
    except CredentialsError as error:
        raise ConfigError(f"{error.message}; give your seed file with --seed") from None


def nats_url(given: str | None, settings: Settings) -> str:
    """The NATS URL: given, configured, or the running stack's; else one clear line."""
    if given or settings.nats_url:
        return str(given or settings.nats_url)
    stack = running_stack(settings.home)
    if stack is None:
        raise ConfigError(
            f"no NATS URL: no stack runs from {settings.home.resolve()} (start one with"
            " `opledger up`), and neither --nats-url nor OPLEDGER_NATS_URL is set"
        )
    return stack.nats_url


def invalid_request(error: ValidationError) -> ConfigError:
    """A request the wire format refuses (a reason too long, an ID that is none), as
    one line that says which field and why."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "the request"
    return ConfigError(f"{where}: {first['msg']}")


Answer = TypeVar("Answer", OperationStatus, PlanStatus)
Send = Callable[[Client, Identity], Awaitable[Answer]]
"""One request over a person's connection: (connection, identity) → the status after (an
operation's, or a plan's)."""


def request_as_person(
    role: Role,
    flag: str,
    args: argparse.Namespace,
    settings: Settings,
    subject: Callable[[str], str],
    send: Send[Answer],
) -> tuple[Identity, Answer]:
    """Send one request as the person `--<flag> NAME` names, with their own seed, on
    their own `subject`; a refusal of any kind is one line (`ConfigError`,
    `NatsRefusedIdentity`, the ledger's own error), never a traceback."""
    identity = person_identity(role, args.identity, args.seed, settings, flag)
    url = nats_url(args.nats_url, settings)

    async def request() -> Answer:
        async with connected(url, identity, subject) as nc:
            return await send(nc, identity)

    try:
        return identity, asyncio.run(request())
    except ValidationError as error:
        raise invalid_request(error) from None


@asynccontextmanager
async def connected(
    url: str, identity: Identity, subject: Callable[[str], str]
) -> AsyncIterator[Client]:
    """A connection as `identity`; a request the broker refused on `subject(name)`
    surfaces as `NatsRefusedIdentity` instead of a timeout."""
    refused: list[str] = []

    async def on_error(error: Exception) -> None:
        if "permissions violation" in str(error):
            refused.append(str(error))

    try:
        nc = await connect_as(
            url, identity, error_cb=on_error, allow_reconnect=False, connect_timeout=5
        )
    except Exception as error:  # nats-py raises several kinds; all mean the same here
        raise LedgerUnavailable(
            f"cannot connect to NATS at {url} as {identity.role.value} {identity.name}"
            f" ({type(error).__name__})"
        ) from None
    try:
        yield nc
    except LedgerUnavailable:
        if refused:
            raise NatsRefusedIdentity(
                f"NATS refused the publish on {subject(identity.name)}: the seed"
                f" {identity.seed_path} is not {identity.role.value} {identity.name}'s"
            ) from None
        raise
    finally:
        await nc.close()
