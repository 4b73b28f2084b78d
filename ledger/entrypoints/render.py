"""Text for people: the inspection commands' views rendered as tables and fields."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from ledger.domain.event_kinds import when_text
from ledger.domain.states import OperationState


def render_json(data: Any) -> str:
    """Data as indented JSON (datetimes as RFC 3339)."""
    return orjson.dumps(data, option=orjson.OPT_INDENT_2, default=str).decode()


def render_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """An aligned plain-text table; None shows as `-`."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [
        max([len(header), *(len(row[i]) for row in cells)]) for i, header in enumerate(headers)
    ]
    lines = [list(headers), *cells]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _compact(value: Any) -> str:
    """A value on one line: scalars as they are, the rest as JSON."""
    if value is None:
        return "-"
    if isinstance(value, str | int | float | bool):
        return str(value)
    return json.dumps(value, ensure_ascii=False, default=str)


def _result_fields(result: dict[str, Any] | None, problem: str | None) -> list[tuple[str, str]]:
    """The kept result as hosts get it: its data (redacted by the executor), and how far
    to trust it."""
    if problem:
        return [("result", f"withheld: {problem}")]
    if not result:
        return []
    provenance = result.get("provenance") or {}
    fields = [("result", _compact(result.get("data") if result.get("ok") else result.get("error")))]
    trust = provenance.get("trust")
    if trust:
        fields.append(("result trust", f"{trust} (from {provenance.get('executor', '?')})"))
    if result.get("redactions"):
        fields.append(("redacted", ", ".join(result["redactions"])))
    return fields


def render_operations(rows: list[dict[str, Any]]) -> str:
    """`ops list` for people."""
    if not rows:
        return "no operations match"
    headers = ("OPERATION", "STATE", "TOOL", "ACTOR", "TENANT", "RISK", "ATTEMPTS", "UPDATED (UTC)")
    return render_table(
        headers,
        (
            (
                r["operation_id"],
                r["state"],
                f"{r['tool']}@{r['tool_version'] or '?'}",
                r["actor"],
                r["tenant"],
                r["risk"],
                r["attempts"],
                when_text(r["updated_at"]),
            )
            for r in rows
        ),
    )


def render_operation(data: dict[str, Any]) -> str:
    """`ops show` for people: key fields, then the timeline."""
    as_of = f", as of version {data['as_of']}" if data["as_of"] is not None else ""
    fields = [
        ("state", data["state"]),
        ("tool", f"{data['tool']}@{data['tool_version'] or '?'}"),
        ("actor", f"{data['actor']} (tenant {data['tenant']}, {data['environment']})"),
        ("risk", data["risk"]),
        ("proposal hash", data["proposal_hash"]),
        *_arguments_fields(data),
        *_approval_fields(data["approval"], data["approvers"]),
        ("attempts", f"{data['attempt']} of {data['max_attempts']}"),
        *(("lease", _lease_text(lease)) for lease in data["leases"]),
        ("outcome", _compact(data["outcome"])),
        *_result_fields(data.get("result"), data.get("result_problem")),
    ]
    timeline = render_table(
        ("VERSION", "TYPE", "TIME (UTC)", "SUMMARY"),
        (
            (e["version"], e["type"], when_text(e["timestamp"]), e["summary"])
            for e in data["timeline"]
        ),
    )
    header = f"Operation {data['operation_id']} (version {data['version']}{as_of})"
    body = _render_fields(fields, width=20)
    return "\n".join([header, body, "", "Timeline", _indent(timeline)])


def _arguments_fields(data: dict[str, Any]) -> list[tuple[str, Any]]:
    fields: list[tuple[str, Any]] = []
    if data["arguments"] is not None:
        fields.append(("arguments", _compact(data["arguments"])))
    else:
        fields.append(("proposed arguments", _compact(data["proposed_arguments"])))
    fields.extend(
        ("issue", f"{i.get('code')} at {i.get('path') or '/'}: {i.get('message')}")
        for i in data["issues"]
    )
    return fields


def _approval_fields(
    approval: dict[str, Any] | None, approvers: list[str]
) -> list[tuple[str, Any]]:
    if approval is None:
        return [("approval", "not required")]
    preview = approval.get("effect_preview") or {}
    reversible = "reversible" if preview.get("reversible") else "not reversible"
    roles = ", ".join(approval["approver_roles"])
    return [
        (
            "approval",
            f"{approval['approval_id']}: {len(approvers)} of "
            f"{approval['required_approvals']} from {roles}, "
            f"expires {when_text(approval['expires_at'])}",
        ),
        ("approved by", ", ".join(approvers) or "-"),
        ("effect", f"{preview.get('effect')} ({reversible})"),
        ("risk reasons", "; ".join(preview.get("risk_reasons") or []) or "-"),
    ]


def _lease_text(lease: dict[str, Any]) -> str:
    return (
        f"attempt {lease['attempt']} by {lease['executor']}, token {lease['fencing_token']},"
        f" until {when_text(lease['expires_at'])}"
    )


def _render_fields(fields: Sequence[tuple[str, Any]], width: int = 16) -> str:
    return "\n".join(f"  {label + ':':<{width}}{_cell(value)}" for label, value in fields)


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def render_report(data: dict[str, Any]) -> str:
    """`audit verify` for people: the counts, the heads, every finding and notice."""
    head = data["signed_head"]
    fields = [
        ("events checked", data["events_checked"]),
        ("operations checked", data["operations_checked"]),
        ("sealed events", data["sealed_events"]),
        ("unsealed events", data["unsealed_events"]),
        ("head digest", data["head_digest"]),
        (
            "signed head",
            f"#{head['position']} at {head['sealed_at']} by {head['public_key']}"
            if head
            else "none (no seal signed by a trusted key)",
        ),
        ("past signed head", data["events_past_signed_head"]),
        ("view rows checked", data["view_rows_checked"]),
        ("results checked", data["results_checked"]),
    ]
    if data["feed_events_checked"] is not None:
        fields.append(("feed events checked", data["feed_events_checked"]))
    findings = data["findings"]
    verdict = (
        "OK: every event matches its chain and the signed seal;"
        " the view and kept results match the events"
        if data["ok"]
        else f"FAILED: {len(findings)} finding(s)"
    )
    lines = [_render_fields(fields, width=22), verdict]
    lines.extend(f"  {finding['description']}" for finding in findings)
    if data["notices"]:
        lines.append(f"notices: {len(data['notices'])}")
        lines.extend(f"  {notice['description']}" for notice in data["notices"])
    return "\n".join(lines)


def render_head(data: dict[str, Any]) -> str:
    """`audit head` for people: the fields, then the one line to keep."""
    fields = [
        ("position", data["position"]),
        ("digest", data["digest"]),
        ("sealed at", data["sealed_at"]),
        ("public key", data["public_key"]),
        ("signature", data["signature"]),
    ]
    return "\n".join(
        [
            _render_fields(fields, width=12),
            "keep this line; give it back to `audit verify --expect-head`:",
            data["anchor"],
        ]
    )


def render_rebuild(data: dict[str, Any]) -> str:
    """`ops rebuild` for people."""
    return f"rebuilt the operations view from {data['events_projected']} events"


def render_export(data: dict[str, Any]) -> str:
    """`audit export`'s count, for stderr."""
    target = "stdout" if data["output"] == "-" else data["output"]
    return f"exported {data['exported']} events to {target}"


def render_pending(rows: list[dict[str, Any]]) -> str:
    """`approvals list` for people."""
    if not rows:
        return "no operations await approval"
    headers = (
        "OPERATION",
        "APPROVAL",
        "TOOL",
        "ACTOR",
        "TENANT",
        "RISK",
        "APPROVALS",
        "EXPIRES (UTC)",
    )
    return render_table(
        headers,
        (
            (
                r["operation_id"],
                r["approval_id"],
                f"{r['tool']}@{r['tool_version']}",
                r["actor"],
                r["tenant"],
                r["risk"],
                f"{r['approvals_granted']}/{r['approvals_required']}",
                when_text(r["approval_expires_at"]),
            )
            for r in rows
        ),
    )


_EFFECTS = {
    "pure_read": "reads data only; changes nothing",
    "external_read": "reads data from an outside service; changes nothing",
    "reversible_write": "changes data; the change can be undone",
    "irreversible_write": "changes data; this CANNOT be undone",
}


def render_approval(data: dict[str, Any]) -> str:
    """`approvals show` for people who are not developers."""
    granted = len(data["approved_by"])
    roles = ", ".join(data["approver_roles"]) or "-"
    who = f"{data['required_approvals']} approval(s) from role {roles}"
    if data["separation_of_duties"]:
        who += "; the requester may not approve"
    fields = [
        ("What it does", data["summary"]),
        ("Effect", _EFFECTS.get(data["effect"] or "", data["effect"])),
        ("Risk", str(data["risk"] or "-").upper()),
        ("Why this risk", "; ".join(data["risk_reasons"]) or "the tool's usual risk"),
        (
            "Requested by",
            f"{data['requested_by']} (tenant {data['tenant']}, {data['environment']})",
        ),
        ("Why approval", data["reason"]),
        ("Who approves", who),
        ("Approved so far", ", ".join(data["approved_by"]) or "nobody"),
        ("Expires", f"{when_text(data['expires_at'])} UTC"),
    ]
    lines = [
        f"Approval request {data['approval_id']} for {data['tool']} (version "
        f"{data['tool_version']})",
        f"Operation {data['operation_id']}: {data['state'].replace('_', ' ')} "
        f"({granted} of {data['required_approvals']} approvals)",
        "",
        _render_fields(fields, width=18),
        "",
        *_target_lines(data.get("targets") or [], data.get("targets_total") or 0),
        *_preview_lines(data),
        "Arguments (exactly what will run):",
        *_argument_lines(data["arguments"], data["applied_defaults"]),
        "",
        f"Proposal hash: {data['proposal_hash']}",
    ]
    if data.get("preview_hash"):
        lines.append(f"Preview hash:  {data['preview_hash']}")
    if data["state"] == OperationState.AWAITING_APPROVAL.value:
        lines.extend(_decision_hints(data))
    return "\n".join(lines)


def _preview_lines(data: dict[str, Any]) -> list[str]:
    """The tool's own preview of the call (a dry run), when its contract asks for one."""
    if not data.get("preview_requested"):
        return []
    report = data.get("preview")
    if report is None:
        return [
            "What it would do: not previewed yet (the tool's executor runs a dry run",
            "  first; an approval waits for it: show the approval again shortly)",
            "",
        ]
    if "error" in report:
        error = report["error"]
        return [
            f"What it would do: the tool could not preview it ({_printable(error.get('code'))}:"
            f" {_printable(error.get('message'))}); there is no effect to approve",
            "",
        ]
    lines = ["What it would do (the tool's own preview, nothing done yet):"]
    for name, value in (report.get("effect") or {}).items():
        if isinstance(value, str) and "\n" in value:
            lines.append(f"  {_printable(name)}:")
            lines.extend(f"    | {_printable(line)}" for line in value.splitlines())
        else:
            lines.append(f"  {_printable(name)}: {_printable(_effect_text(value))}")
    if report.get("redactions"):
        lines.append(f"  (changed for display: {', '.join(report['redactions'])})")
    return [*lines, ""]


def _effect_text(value: Any) -> str:
    """A preview's value for people: yes/no, none, a list of records one after another."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list) and not value:
        return "none"
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return "; ".join(" · ".join(str(v) for v in item.values()) for item in value)
    return _argument_text(value)


_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")


def _printable(value: Any) -> str:
    """Text from a tool for a terminal: no escape sequences, no hidden characters."""
    return _UNPRINTABLE.sub("\ufffd", str(value))


def _target_lines(targets: list[dict[str, Any]], total: int) -> list[str]:
    """Who or what the call acts on, as the host's systems name them."""
    if not targets:
        return []
    lines = ["It acts on:"]
    for target in targets:
        label = f": {target['label']}" if target.get("label") else ""
        lines.append(f"  {target['kind']} {target['id']}{label}")
    if total > len(targets):
        lines.append(f"  … and {total - len(targets)} more ({total} in all)")
    return [*lines, ""]


def _argument_lines(arguments: Any, defaults: list[str]) -> list[str]:
    if not isinstance(arguments, dict) or not arguments:
        return [f"  {_compact(arguments)}"]
    width = max(len(name) for name in arguments) + 2
    lines = [f"  {name + ':':<{width}}{_argument_text(value)}" for name, value in arguments.items()]
    if defaults:
        lines.append(f"  (filled in by default: {', '.join(d.lstrip('/') for d in defaults)})")
    return lines


def _argument_text(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return ", ".join(str(v) for v in value)
    return _compact(value)


def _decision_hints(data: dict[str, Any]) -> list[str]:
    operation = data["operation_id"]
    deny = [
        "To deny it:",
        f'  opledger approvals deny {operation} --approver YOUR_NAME --reason "..."',
    ]
    if data.get("preview_unapprovable"):
        # Nothing an approval could stand for yet (or at all): approving is refused.
        return ["", *deny]
    return [
        "",
        "To approve exactly this call, as your approver identity:",
        f"  opledger approvals approve {operation} --approver YOUR_NAME "
        f"--proposal-hash {data['proposal_hash']}"
        + (f" --preview-hash {data['preview_hash']}" if data.get("preview_hash") else ""),
        *deny,
    ]


def render_decision(data: dict[str, Any]) -> str:
    """`approvals approve` / `deny` for people."""
    operation, state = data["operation_id"], data["state"]
    by = data["by"] + (" (break glass)" if data.get("via") == "break_glass" else "")
    if data["decision"] == "denied":
        return f"denied {operation} as {by}: it will not run (state {state})"
    granted, required = len(data["approved_by"]), data["required_approvals"]
    following = (
        "it is ready to run"
        if state == OperationState.READY.value
        else f"{required - granted} more approval(s) needed"
    )
    return (
        f"approved {operation} as {by} ({granted} of {required} approvals): "
        f"{following} (state {state})"
    )
