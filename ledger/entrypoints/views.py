"""What the inspection commands show, as JSON-able data (one view per thing shown).

`--json` prints these as they are; `render` turns them into text for people.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ledger.audit.verify import Finding, VerificationReport
from ledger.domain.event_kinds import EVENT_KINDS
from ledger.domain.operation import Operation


def operation_view(operation: Operation) -> dict[str, Any]:
    """The key fields of one operation, JSON-able (datetimes stay datetimes)."""
    return {
        "operation_id": operation.id,
        "version": operation.version,
        "state": operation.state.value,
        "tool": operation.tool,
        "tool_version": operation.tool_version,
        "actor": operation.actor,
        "tenant": operation.tenant,
        "environment": operation.environment,
        "risk": operation.risk,
        "proposal_hash": operation.proposal_hash,
        "arguments": operation.arguments,
        "proposed_arguments": operation.proposal.get("arguments"),
        "issues": operation.issues,
        "approval": operation.approval.as_dict() if operation.approval else None,
        "approvers": operation.approvers,
        "attempt": operation.attempt,
        "max_attempts": operation.max_attempts,
        "lease": operation.lease.as_dict() if operation.lease else None,
        "leases": [lease.as_dict() for lease in operation.leases],
        "outcome": operation.outcome.as_dict() if operation.outcome else None,
        "cancel_requested": operation.cancel_requested,
    }


def timeline_entry(event: Any) -> dict[str, Any]:
    """One event of the timeline: version, type, time and a one-line summary."""
    kind = type(event).__name__
    registered = EVENT_KINDS.get(type(event))
    summarize = registered.summary if registered is not None else None
    return {
        "version": event.originator_version,
        "type": kind,
        "timestamp": event.timestamp,
        "summary": summarize(event) if summarize else "",
    }


def report_view(report: VerificationReport) -> dict[str, Any]:
    """A verification report, JSON-able."""
    head = report.signed_head
    return {
        "ok": report.ok,
        "events_checked": report.events_checked,
        "operations_checked": report.operations_checked,
        "sealed_events": report.sealed_events,
        "unsealed_events": report.unsealed_events,
        "head_digest": report.head_digest,
        "signed_head": asdict(head) | {"anchor": head.anchor()} if head is not None else None,
        "events_past_signed_head": report.unsigned_events,
        "view_rows_checked": report.view_rows_checked,
        "results_checked": report.results_checked,
        "feed_events_checked": report.feed_events_checked,
        "findings": [finding_view(finding) for finding in report.findings],
        "notices": [finding_view(finding) for finding in report.notices],
    }


def finding_view(finding: Finding) -> dict[str, Any]:
    """One verification finding, JSON-able, with its one-line description."""
    return {
        "kind": finding.kind.value,
        "notification_id": finding.notification_id,
        "operation_id": finding.operation_id,
        "version": finding.version,
        "detail": finding.detail,
        "description": finding.describe(),
    }


def pending_view(row: dict[str, Any]) -> dict[str, Any]:
    """One operation awaiting approval, from its view row."""
    names = (
        "operation_id",
        "approval_id",
        "tool",
        "tool_version",
        "actor",
        "tenant",
        "risk",
        "approvals_granted",
        "approvals_required",
        "approval_expires_at",
    )
    return {name: row[name] for name in names}


def approval_view(operation: Operation) -> dict[str, Any]:
    """What an approver must see, from the approval request's effect preview."""
    approval = operation.approval.as_dict() if operation.approval else {}
    preview: dict[str, Any] = approval.get("effect_preview") or {}
    return {
        "operation_id": operation.id,
        "state": operation.state.value,
        "approval_id": approval.get("approval_id"),
        "tool": preview.get("tool", operation.tool),
        "tool_version": preview.get("tool_version", operation.tool_version),
        "summary": preview.get("summary", ""),
        "effect": preview.get("effect"),
        "reversible": preview.get("reversible"),
        "risk": preview.get("risk", operation.risk),
        "risk_reasons": preview.get("risk_reasons", []),
        "arguments": preview.get("arguments", operation.arguments),
        "targets": preview.get("targets", []),
        "targets_total": preview.get("targets_total", 0),
        "applied_defaults": preview.get("applied_defaults", []),
        "requested_by": preview.get("requested_by", operation.actor),
        "tenant": preview.get("tenant", operation.tenant),
        "environment": preview.get("environment", operation.environment),
        "reason": approval.get("reason", ""),
        "proposal_hash": operation.proposal_hash,
        # The tool's own preview of the call (a dry run on its executor), when its
        # contract asks for one: what an approval of it is bound to besides the call.
        "preview_requested": operation.preview_requested,
        "preview": operation.preview,
        "preview_hash": operation.preview_hash,
        # Why it cannot be approved yet, or at all, for want of a preview (None: it can).
        "preview_unapprovable": (
            str(operation.preview_unapprovable) if operation.preview_unapprovable else None
        ),
        "approver_roles": approval.get("approver_roles", []),
        "required_approvals": approval.get("required_approvals", 1),
        "approved_by": operation.approvers,
        "separation_of_duties": approval.get("separation_of_duties", False),
        "expires_at": approval.get("expires_at"),
    }


def decision_view(operation: Operation, decision: str, user: str, via: str) -> dict[str, Any]:
    """The operation after an approver's decision (`via`: how it was recorded)."""
    approval = operation.approval.as_dict() if operation.approval else {}
    return {
        "operation_id": operation.id,
        "decision": decision,
        "by": user,
        "via": via,
        "state": operation.state.value,
        "approval_id": approval.get("approval_id"),
        "approved_by": operation.approvers,
        "required_approvals": approval.get("required_approvals"),
    }
