"""`opledger approvals approve|deny`: an approver decides over NATS, as themselves.

    opledger approvals approve OP_ID --approver NAME --proposal-hash HASH [--preview-hash HASH]
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
from typing import Any

from nats.aio.client import Client

from ledger.client import ApproverClient
from ledger.config import ConfigError, Settings
from ledger.entrypoints.persons import (
    NatsRefusedIdentity,
    add_identity_arguments,
    request_as_person,
)
from ledger.entrypoints.render import render_json
from ledger.nats import Identity, Role
from schemas import OperationStatus, Subjects

__all__ = ["NatsRefusedIdentity", "add_decision_arguments", "decide"]

EXIT_OK = 0


def add_decision_arguments(parser: argparse.ArgumentParser, decision: str) -> None:
    """The options of `approvals approve` (`decision` "approve") or `approvals deny`."""
    parser.add_argument("operation_id", metavar="OP_ID")
    add_identity_arguments(parser, Role.APPROVER, "approver")
    if decision == "approve":
        parser.add_argument(
            "--proposal-hash",
            required=True,
            metavar="HASH",
            help="the proposal hash `approvals show` showed you: the approval counts for"
            " exactly that call",
        )
        parser.add_argument(
            "--preview-hash",
            default=None,
            metavar="HASH",
            help="the preview hash `approvals show` showed you, for a call the tool previews:"
            " the approval counts for exactly that effect (default: none)",
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
    identity, status = request_as_person(
        Role.APPROVER,
        "approver",
        args,
        settings,
        Subjects.approve,
        lambda nc, identity: _send(nc, identity, args),
    )
    data = {
        **status.model_dump(mode="json", exclude_none=True),
        "decision": args.decision,
        "by": identity.name,
    }
    as_json = bool(getattr(args, "json", False))
    print(render_json(data) if as_json else _render_status(data))
    return EXIT_OK


async def _send(nc: Client, identity: Identity, args: argparse.Namespace) -> OperationStatus:
    client = ApproverClient(nc, identity.name)
    if args.decision == "approve":
        return await client.approve(
            args.operation_id, proposal_hash=args.proposal_hash, preview_hash=args.preview_hash
        )
    return await client.deny(args.operation_id, reason=args.reason)


def _render_status(data: dict[str, Any]) -> str:
    return f"{data['decision']} {data['operation_id']} as {data['by']}: it is now {data['state']}"
