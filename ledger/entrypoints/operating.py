"""`opledger ops cancel|resolve|retry`: an operator steers an operation over NATS, as
themselves.

    opledger ops cancel OP_ID --operator NAME [--reason TEXT]
    opledger ops resolve OP_ID (--applied | --not-applied) --operator NAME --reason TEXT
    opledger ops retry OP_ID --operator NAME --reason TEXT

The request travels on `ops.operate.NAME`, signed with NAME's own NKey seed
(`--seed`, default `<creds>/operator-NAME.nk`); the broker lets only that
identity publish there, and the ledger records the action as `operator:NAME`.
It can be run from any machine that reaches NATS.

Break glass: with `--break-glass --as USER`, the command writes the database
directly, recorded as `break-glass:USER`, so an auditor tells it apart from an
operator's own identity. That is possible for whoever can write the database
anyway; it is the way to act while the ledger service is down.
"""

from __future__ import annotations

import argparse
from typing import Any

from nats.aio.client import Client

from ledger.client import OperatorClient
from ledger.config import ConfigError, Settings
from ledger.entrypoints.persons import (
    add_identity_arguments,
    request_as_person,
)
from ledger.entrypoints.render import render_json
from ledger.nats import Identity, Role
from schemas import OperationStatus, Subjects

__all__ = ["BREAK_GLASS", "add_operator_arguments", "operate"]

EXIT_OK = 0

BREAK_GLASS = "break-glass:"
"""How an action written to the database directly names who took it."""


def add_operator_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """The identity and break-glass options of `ops cancel|resolve|retry` (`command`)."""
    add_identity_arguments(parser, Role.OPERATOR, "operator")
    glass = parser.add_argument_group(
        "break glass (writes the database directly; recorded as break-glass:USER)"
    )
    glass.add_argument(
        "--break-glass",
        action="store_true",
        help="act without NATS, for whoever holds the database (default: off)",
    )
    glass.add_argument(
        "--as", dest="user", metavar="USER", help="with --break-glass: who (default: none)"
    )
    parser.set_defaults(
        run=operate,
        operator_command=command,
        break_glass_ok=True,
        break_glass_check=break_glass_user,
    )


def operate(args: argparse.Namespace, settings: Settings) -> int:
    """Run `ops cancel|resolve|retry` over NATS; prints the operation's state after.

    (`--break-glass` never gets here: the command line runs it as a database command.)
    """
    if args.user:
        raise ConfigError(
            "--as is for --break-glass only: over NATS, who you are is your identity"
            " (--operator NAME and its seed)"
        )
    identity, status = request_as_person(
        Role.OPERATOR,
        "operator",
        args,
        settings,
        Subjects.operate,
        lambda nc, identity: _send(nc, identity, args),
    )
    data = {
        **status.model_dump(mode="json", exclude_none=True),
        "command": args.operator_command,
        "asked_for": args.operation_id,
        "by": f"operator:{identity.name}",
    }
    as_json = bool(getattr(args, "json", False))
    print(render_json(data) if as_json else _render_status(data))
    return EXIT_OK


def break_glass_user(args: argparse.Namespace) -> str:
    """Who a break-glass action is recorded as (`--as` is required for it); checked
    before the database is opened, so a refused command writes nothing."""
    if args.identity or args.seed or args.nats_url:
        raise ConfigError(
            "--operator, --seed and --nats-url are for NATS; with --break-glass say who you"
            " are with --as"
        )
    if not args.user or not args.user.strip():
        raise ConfigError("--break-glass needs --as USER (who you are, for the record)")
    if len(args.reason) > 500:
        raise ConfigError("--reason has at most 500 characters")
    return BREAK_GLASS + " ".join(args.user.split())


async def _send(nc: Client, identity: Identity, args: argparse.Namespace) -> OperationStatus:
    client = OperatorClient(nc, identity.name)
    command = args.operator_command
    if command == "cancel":
        return await client.cancel(args.operation_id, reason=args.reason)
    if command == "resolve":
        return await client.resolve(
            args.operation_id, applied=bool(args.applied), reason=args.reason
        )
    return await client.retry(args.operation_id, reason=args.reason)


def _render_status(data: dict[str, Any]) -> str:
    done = f"{data['command']} {data['asked_for']} as {data['by']}: "
    if data["operation_id"] != data["asked_for"]:  # a retry runs as a new operation
        return done + f"runs again as {data['operation_id']}, now {data['state']}"
    return done + f"it is now {data['state']}"
