"""`opledger plans`: a plan with its steps, for the people who approve, run and undo it.

    opledger plans show PLAN_ID
    opledger plans approve PLAN_ID --approver NAME --plan-hash HASH
    opledger plans deny PLAN_ID --approver NAME [--reason TEXT]
    opledger plans retry PLAN_ID --break-glass --as USER --reason TEXT
    opledger plans compensate PLAN_ID --break-glass --as USER --reason TEXT

`PLAN_ID` is the ledger's `<host>/<plan id>`. `show` reads the database only;
it shows every step's exact effect (tool, arguments, where a value comes from
an earlier step's result), the step table and the plan hash an approval names.
`approve` and `deny` travel over NATS as the approver's own identity, exactly as
`approvals approve|deny` do; `retry` and `compensate` write the database
directly and are recorded as `break-glass:USER`.
"""

from __future__ import annotations

import argparse
from typing import Any

from nats.aio.client import Client

from ledger.client import ApproverClient
from ledger.config import ConfigError, Settings
from ledger.domain.event_kinds import when_text
from ledger.entrypoints.persons import add_identity_arguments, request_as_person
from ledger.entrypoints.render import render_json
from ledger.nats import Identity, Role
from ledger.service import Ledger
from schemas import PlanStatus, Subjects

__all__ = ["add_plan_decision_arguments", "decide_plan", "plan_view", "render_plan"]

EXIT_OK = 0


def plan_view(ledger: Ledger, plan_id: str) -> dict[str, Any]:
    """A plan as `plans show` shows it: its status, step table and, while it waits for
    approval, what approving it would run."""
    plan = ledger.plans.get(plan_id)
    status = ledger.plans.status(plan_id)
    approval = plan.approval
    data: dict[str, Any] = status.model_dump(mode="json")
    data.update(
        requested_by=plan.actor,
        tenant=plan.tenant,
        environment=plan.environment,
        host=plan.host,
        proposed_by=plan.proposed_by,
        compensates=(plan.compensates or "").removesuffix("~plan") or None,
        approved_by=plan.approvers,
        approval=None if approval is None else {
            "reason": approval.reason,
            "approver_roles": list(approval.approver_roles),
            "required_approvals": approval.required_approvals,
            "separation_of_duties": approval.separation_of_duties,
            "expires_at": approval.expires_at.isoformat(),
            "steps": approval.effect_preview.get("steps", []),
        },
    )
    return data


def render_plan(data: dict[str, Any]) -> str:
    """`plans show` for people: every step's effect first, then where the plan stands."""
    lines = [
        f"Plan {data['plan_id']}: {data['state'].replace('_', ' ')}"
        + (" (cancel requested)" if data["cancel_requested"] else ""),
        f"  requested by {data['requested_by']} (tenant {data['tenant']},"
        f" {data['environment']}) through host {data['host']}",
    ]
    if data.get("proposed_by"):
        lines.append(f"  proposed by {data['proposed_by']} to undo plan {data['compensates']}")
    if data.get("risk"):
        lines.append(f"  risk: {str(data['risk']).upper()} (its riskiest step)")
    approval = data.get("approval")
    if approval is not None:
        who = f"{approval['required_approvals']} approval(s) from role"
        who += f" {', '.join(approval['approver_roles'])}"
        if approval["separation_of_duties"]:
            who += "; the requester may not approve"
        lines += [
            f"  approval: {who}; approved so far: {', '.join(data['approved_by']) or 'nobody'};"
            f" expires {when_text(approval['expires_at'])} UTC",
            f"  why: {approval['reason']}",
            "",
            "What approving it runs, step by step (one approval stands for all of them):",
        ]
        for number, step in enumerate(approval["steps"], 1):
            after = ", ".join(step.get("depends_on") or []) or "nothing"
            lines.append(
                f"  {number}. {step['step']}: {step['tool']} ({step.get('effect', '-')},"
                f" risk {step.get('risk') or '-'}), after {after}"
            )
            for name, value in (step.get("arguments") or {}).items():
                lines.append(f"       {name}: {_value(value)}")
    elif data["issues"]:
        lines += ["", "Refused, with these findings:"]
        for issue in data["issues"]:
            step = (issue.get("details") or {}).get("step", "-")
            lines.append(f"  step {step} at {issue['path']}: {issue['code']}: {issue['message']}")
    lines += ["", "Steps:"]
    width = max((len(row["step"]) for row in data["steps"]), default=4) + 2
    for row in data["steps"]:
        notes = []
        if row.get("skipped_because"):
            notes.append(f"skipped: {row['skipped_because']}")
        if row.get("retry_needed"):
            notes.append("a retry runs it again")
        if row.get("compensation"):
            notes.append(f"undone by {row['compensation']}")
        lines.append(
            f"  {row['step'] + ':':<{width}}{row['state']:<18} {row['tool']:<16}"
            f" {row['operation_id']}" + (f"  ({'; '.join(notes)})" if notes else "")
        )
    if data.get("plan_hash"):
        lines += ["", f"Plan hash: {data['plan_hash']}"]
    if data["state"] == "awaiting_approval":
        lines += [
            "",
            f"Approve: opledger plans approve {data['plan_id']} --approver NAME"
            f" --plan-hash {data['plan_hash']}",
            f"Deny:    opledger plans deny {data['plan_id']} --approver NAME --reason TEXT",
        ]
    return "\n".join(lines)


def _value(value: Any) -> str:
    if isinstance(value, dict) and set(value) == {"$result"}:
        named = value["$result"]
        return f"<{named.get('pointer')} of {named.get('step')}'s result>"
    text = str(value)
    return text if len(text) <= 200 else text[:197] + "..."


def add_plan_decision_arguments(parser: argparse.ArgumentParser, decision: str) -> None:
    """The options of `plans approve` (`decision` "approve") or `plans deny`."""
    parser.add_argument("plan_id", metavar="PLAN_ID")
    add_identity_arguments(parser, Role.APPROVER, "approver")
    if decision == "approve":
        parser.add_argument(
            "--plan-hash", required=True, metavar="HASH",
            help="the plan hash `plans show` showed you: the approval counts for exactly"
            " that plan (its steps, their order and their edges)",
        )
    else:
        parser.add_argument(
            "--reason", default="", help="why, for the requester and the audit (default: none)"
        )
    parser.set_defaults(run=decide_plan, decision=decision)


def decide_plan(args: argparse.Namespace, settings: Settings) -> int:
    """Run `plans approve|deny` over NATS as the approver; prints the plan's state after."""
    if not args.plan_id.count("/") == 1:
        raise ConfigError("PLAN_ID is the ledger's <host>/<plan id>, as `plans show` shows it")
    identity, status = request_as_person(
        Role.APPROVER, "approver", args, settings, Subjects.approve,
        lambda nc, identity: _send(nc, identity, args),
    )
    data = {**status.model_dump(mode="json"), "decision": args.decision, "by": identity.name}
    if getattr(args, "json", False):
        print(render_json(data))
    else:
        print(f"{args.decision} {args.plan_id} as {identity.name}: it is now {status.state}")
    return EXIT_OK


async def _send(nc: Client, identity: Identity, args: argparse.Namespace) -> PlanStatus:
    client = ApproverClient(nc, identity.name)
    if args.decision == "approve":
        return await client.approve_plan(args.plan_id, plan_hash=args.plan_hash)
    return await client.deny_plan(args.plan_id, reason=args.reason)
