"""Exporting the ledger as JSON Lines for auditors, without secrets in clear.

Argument values a contract marks sensitive are replaced by their SHA-256, in
every place they appear (the proposal, the validated arguments, the approval
preview). Hashes keep them comparable across events without revealing them.
A tool's own preview of a call (`PreviewRecorded.report`) is hashed whole, for
every tool: it renders the arguments into text nobody can point into (a message
body), and holds what the executor resolved and the ledger never had (the
recipients' addresses). It is for the approvers, who read it from the ledger;
auditors compare its hash.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import IO, Any

import orjson

from ledger.adapters.event_tables import StoredRow
from ledger.domain.hashing import stored_event_hash
from ledger.domain.plan import is_plan_id
from policy import ToolContract, replace_at_pointers
from schemas import canonical_json, sha256_hex

__all__ = ["export_jsonl", "exported_events", "feed_record", "redact_arguments"]


def _hashed(value: Any) -> dict[str, str]:
    try:
        encoded = canonical_json(value)
    except ValueError:
        encoded = repr(value).encode()
    return {"sha256": sha256_hex(encoded)}


def redact_arguments(arguments: Any, sensitive: tuple[str, ...]) -> Any:
    """A copy of `arguments` with every sensitive pointer's value hashed."""
    if not sensitive:
        return arguments
    if not isinstance(arguments, dict):
        # Raw text we could not parse: nothing can be pointed into, hash it whole.
        return _hashed(arguments)
    return replace_at_pointers(arguments, sensitive, _hashed)


SensitiveOf = Callable[[str], tuple[str, ...]]
"""tool → the pointers its contract marks sensitive (for a plan's events, whose steps
are calls of several tools)."""


def _redact_plan_steps(state: dict[str, Any], sensitive_of: SensitiveOf) -> dict[str, Any]:
    """A plan event with each step's sensitive arguments hashed, by that step's tool:
    the plan as proposed (`plan.steps[].tool_name`), as checked (`steps[].tool`) and as
    shown to approvers (`effect_preview.steps[].tool`)."""
    state = copy.deepcopy(state)
    lists = []
    if isinstance(state.get("plan"), dict):
        lists.append((state["plan"].get("steps"), "tool_name"))
    lists.append((state.get("steps"), "tool"))
    if isinstance(state.get("effect_preview"), dict):
        lists.append((state["effect_preview"].get("steps"), "tool"))
    for steps, tool_key in lists:
        if not isinstance(steps, list):
            continue
        for one in steps:
            if isinstance(one, dict) and "arguments" in one:
                pointers = sensitive_of(str(one.get(tool_key, "")))
                if pointers:
                    one["arguments"] = redact_arguments(one["arguments"], pointers)
    return state


def _redact_event(state: dict[str, Any], sensitive: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(state.get("report"), dict):
        state = {**state, "report": _hashed(state["report"])}
    if not sensitive:
        return state
    state = copy.deepcopy(state)
    if isinstance(state.get("proposal"), dict) and "arguments" in state["proposal"]:
        state["proposal"]["arguments"] = redact_arguments(state["proposal"]["arguments"], sensitive)
    if "arguments" in state:
        state["arguments"] = redact_arguments(state["arguments"], sensitive)
    preview = state.get("effect_preview")
    if isinstance(preview, dict) and "arguments" in preview:
        preview["arguments"] = redact_arguments(preview["arguments"], sensitive)
    return state


def feed_record(
    row: StoredRow, sensitive: tuple[str, ...], *, sensitive_of: SensitiveOf | None = None
) -> dict[str, Any]:
    """One stored event as an export or feed record, sensitive values hashed (for a
    plan's event, `sensitive_of` gives each step's tool's pointers).

    The hash is computed from the stored event, before redaction, so a record
    can be checked against a later verification.
    """
    position, operation_id, version, topic, stored = row
    state = orjson.loads(stored)
    if sensitive_of is not None and isinstance(state, dict):
        state = _redact_plan_steps(state, sensitive_of)
    return {
        "position": position,
        "operation_id": operation_id,
        "version": version,
        "type": topic.rsplit(".", 1)[-1],
        "timestamp": state.get("timestamp"),
        "event_hash": stored_event_hash(topic, stored),
        "prev_hash": state.get("prev_hash"),
        "event": _redact_event(state, sensitive),
    }


def exported_events(
    rows: Iterable[StoredRow], contracts: Mapping[str, ToolContract]
) -> Iterator[dict[str, Any]]:
    """Every event in global order, as an export record, sensitive values hashed.

    `contracts` maps tool name → contract (for the sensitive pointers).
    """
    tools: dict[str, str] = {}

    def sensitive_of(tool: str) -> tuple[str, ...]:
        contract = contracts.get(tool)
        return contract.sensitive_arguments if contract else ()

    for row in rows:
        operation_id, version, stored = row[1], row[2], row[4]
        if is_plan_id(operation_id):
            yield feed_record(row, (), sensitive_of=sensitive_of)
            continue
        if version == 1:
            tools[operation_id] = str(orjson.loads(stored).get("tool", ""))
        contract = contracts.get(tools.get(operation_id, ""))
        yield feed_record(row, contract.sensitive_arguments if contract else ())


def export_jsonl(
    rows: Iterable[StoredRow],
    contracts: Mapping[str, ToolContract],
    out: IO[bytes],
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write the export to `out`, one JSON object per line; returns the count
    (`progress` is told the count every thousand events)."""
    count = 0
    for record in exported_events(rows, contracts):
        out.write(orjson.dumps(record) + b"\n")
        count += 1
        if progress is not None and count % 1000 == 0:
            progress(count)
    if progress is not None:
        progress(count)
    return count
