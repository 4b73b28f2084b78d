"""Sample executor of `create_ticket`, honouring `dry_run` (the default): preview only.

A real ticket (`dry_run: false`) is created once per idempotency key; a
postcondition reads it back to check the effect is what was asked for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from executors._api import Precondition, Reconciliation, ToolContext, ToolError, tool
from executors.samples._world import customer_address, world
from schemas import ErrorCategory

__all__ = ["create_ticket"]

_QUEUES = {
    "billing": "billing",
    "refund": "billing",
    "shipping": "logistics",
    "account": "accounts",
    "technical": "engineering",
    "other": "general",
}


def _preview(arguments: Mapping[str, Any]) -> dict[str, str]:
    priority = str(arguments.get("priority", "normal"))
    queue = _QUEUES[str(arguments["category"])]
    if priority == "urgent" and queue == "engineering":
        queue = "engineering-oncall"
    return {"title": str(arguments["title"]), "queue": queue, "priority": priority}


@tool("create_ticket", version="1.1.0")
def create_ticket(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
    """Preview the ticket, and create it unless this is a dry run."""
    contact = arguments.get("contact")
    if isinstance(contact, Mapping) and customer_address(str(contact["customer_id"])) is None:
        raise ToolError(
            ErrorCategory.NOT_FOUND, "CONTACT_NOT_FOUND", "the contact customer is not visible"
        )
    preview = _preview(arguments)
    dry_run = bool(arguments.get("dry_run", True))
    if dry_run:
        return {"ticket_id": None, "dry_run": True, "preview": preview}
    stored = world().create_ticket(
        context.idempotency_key,
        {
            "preview": preview,
            "description": arguments.get("description", ""),
            "labels": list(arguments.get("labels", ())),
        },
    )
    return {"ticket_id": stored["ticket_id"], "dry_run": False, "preview": stored["preview"]}


@create_ticket.precondition
def _ticket_not_yet_created(arguments: Mapping[str, Any], context: ToolContext) -> Precondition:
    if arguments.get("dry_run", True):
        return Precondition.ok()
    with world().lock:
        stored = world().tickets.get(context.idempotency_key)
    if stored is not None:
        return Precondition.already_applied(
            {"ticket_id": stored["ticket_id"], "dry_run": False, "preview": stored["preview"]},
            "this operation's ticket already exists",
        )
    return Precondition.ok()


@create_ticket.postcondition
def _ticket_as_asked(
    arguments: Mapping[str, Any], output: Mapping[str, Any], context: ToolContext
) -> Sequence[str]:
    if output["dry_run"] != bool(arguments.get("dry_run", True)):
        return ["the dry_run flag of the result differs from the call"]
    if output["dry_run"]:
        return [] if output["ticket_id"] is None else ["a dry run reported a ticket"]
    with world().lock:
        stored = world().tickets.get(context.idempotency_key)
    if stored is None or stored["ticket_id"] != output["ticket_id"]:
        return ["the ticket cannot be read back"]
    if stored["preview"]["title"] != arguments["title"]:
        return ["the stored ticket has another title"]
    return []


@create_ticket.reconciler
def _ticket_lookup(operation_id: str, _context: ToolContext) -> Reconciliation:
    with world().lock:
        stored = world().tickets.get(operation_id)
    if stored is None:
        # Dry runs leave no record either; reporting "not applied" lets the ledger run it again.
        return Reconciliation.not_applied("no ticket was created under this operation")
    return Reconciliation.applied(
        {"ticket_id": stored["ticket_id"], "dry_run": False, "preview": stored["preview"]}
    )
