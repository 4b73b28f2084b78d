"""`opledger approvals approve|deny`: an approver decides over NATS, as themselves.

    opledger approvals approve OP_ID --approver NAME --proposal-hash HASH
    opledger approvals deny OP_ID --approver NAME [--reason TEXT]

The decision travels on `ops.approve.NAME`, signed with NAME's own NKey seed
(`--seed`, default `<creds>/approver-NAME.nk`); the broker lets only that
identity publish there, and the ledger records the decision as NAME's, with the
approver roles its own configuration gives NAME. No flag of this command can
claim a role, so it can be run from any machine that reaches NATS.

Break glass: with `--break-glass`, the command writes to the database directly
instead, as `--as USER` with the `--role`s given. That is possible for whoever
can write the database anyway; it is recorded as such (`via: break_glass` on
the event), so an auditor tells it apart from an approver's own word.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from ledger.client import ApproverClient, LedgerUnavailable
from ledger.config import ConfigError, Settings
from ledger.embedded import running_stack
from ledger.entrypoints.render import render_json
from ledger.nats import Identity, Role, connect_as
from ledger.nats.errors import CredentialsError
from schemas import ErrorCategory, OperationStatus, OpledgerError, Subjects, check_token

__all__ = ["add_decision_arguments", "decide"]

EXIT_OK = 0


class NatsRefusedIdentity(OpledgerError):
    """NATS refused the approver's publish: the seed is not the named approver's."""

    category = ErrorCategory.UNAUTHORIZED
    code = "NOT_THIS_IDENTITY"


def add_decision_arguments(parser: argparse.ArgumentParser, decision: str) -> None:
    """The options of `approvals approve` (`decision` "approve") or `approvals deny`."""
    parser.add_argument("operation_id", metavar="OP_ID")
    parser.add_argument(
        "--approver",
        metavar="NAME",
        help="your approver identity: the decision is signed with its NKey seed"
        " (default: none; required unless --break-glass)",
    )
    parser.add_argument(
        "--seed",
        type=Path,
        help="NAME's NKey seed file (default: <creds>/approver-NAME.nk)",
    )
    parser.add_argument(
        "--nats-url",
        help="the NATS server(s) (default: $OPLEDGER_NATS_URL, else the running stack's)",
    )
    if decision == "approve":
        parser.add_argument(
            "--proposal-hash",
            required=True,
            metavar="HASH",
            help="the proposal hash `approvals show` showed you: the approval counts for"
            " exactly that call",
        )
    else:
        parser.add_argument(
            "--reason", default="", help="why, for the requester and the audit (default: none)"
        )
    glass = parser.add_argument_group(
        "break glass (writes the database directly; recorded as break_glass)"
    )
    glass.add_argument(
        "--break-glass",
        action="store_true",
        help="decide without NATS, for whoever holds the database: recorded as such"
        " (default: off)",
    )
    glass.add_argument(
        "--as", dest="user", metavar="USER", help="with --break-glass: who (default: none)"
    )
    glass.add_argument(
        "--role",
        dest="roles",
        action="append",
        default=[],
        metavar="ROLE",
        help="with --break-glass: an approver role USER holds (repeatable; default: none)",
    )
    parser.set_defaults(run=decide, decision=decision, break_glass_ok=True)


def decide(args: argparse.Namespace, settings: Settings) -> int:
    """Run `approvals approve|deny` over NATS; prints the operation after the decision.

    (`--break-glass` never gets here: the command line runs it as a database command.)
    """
    if args.user or args.roles:
        raise ConfigError(
            "--as and --role are for --break-glass only: over NATS, who you are is your"
            " identity and your roles are the ledger's configuration"
        )
    if not args.approver:
        raise ConfigError("name your approver identity with --approver NAME")
    name = _token(args.approver, "--approver")
    creds = settings.creds_dir or settings.home / "creds"
    seed = args.seed or Path(creds) / f"approver-{name}.nk"
    try:
        identity = Identity.from_seed_file(Role.APPROVER, name, seed)
    except CredentialsError as error:
        raise ConfigError(f"{error.message}; give your seed file with --seed") from None
    url = args.nats_url or settings.nats_url or _stack_url(settings.home)
    status = asyncio.run(_send(url, identity, args))
    data = {
        **status.model_dump(mode="json", exclude_none=True),
        "decision": args.decision,
        "by": name,
    }
    as_json = bool(getattr(args, "json", False))
    print(render_json(data) if as_json else _render_status(data))
    return EXIT_OK


def _token(value: str, flag: str) -> str:
    try:
        return check_token(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r} is not a valid identity name") from None


def _stack_url(home: Path) -> str:
    stack = running_stack(home)
    if stack is None:
        raise ConfigError(
            f"no NATS URL: no stack runs from {home.resolve()} (start one with `opledger up`),"
            " and neither --nats-url nor OPLEDGER_NATS_URL is set"
        )
    return stack.nats_url


async def _send(url: str, identity: Identity, args: argparse.Namespace) -> OperationStatus:
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
            f"cannot connect to NATS at {url} as approver {identity.name}"
            f" ({type(error).__name__})"
        ) from None
    client = ApproverClient(nc, identity.name)
    try:
        if args.decision == "approve":
            return await client.approve(args.operation_id, proposal_hash=args.proposal_hash)
        return await client.deny(args.operation_id, reason=args.reason)
    except LedgerUnavailable:
        if refused:
            raise NatsRefusedIdentity(
                f"NATS refused the publish on {Subjects.approve(identity.name)}: the seed"
                f" {identity.seed_path} is not approver {identity.name}'s"
            ) from None
        raise
    finally:
        await nc.close()


def _render_status(data: dict[str, Any]) -> str:
    return f"{data['decision']} {data['operation_id']} as {data['by']}: it is now {data['state']}"
