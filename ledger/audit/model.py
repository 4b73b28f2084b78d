"""Verifying what is derived from the events: the operations view and the kept results.

Neither is covered by the hash chains, and both are served: `ops list` shows
the view, `Ledger.status` hands kept results to hosts. So both are checked
against the events they come from, operation by operation:

- every row of `opledger_operations` must be exactly the fold of its
  operation's events (`ledger.projections.operations_view.fold_event`, the
  function the projector writes with) over the events the view has taken in
  (positions up to the view's own); a missing, extra or different row is a
  finding that names the columns;
- every row of `opledger_results` must be named by a settling event of its
  operation (`Succeeded`, `Failed` or `Reconciled` with that `result_ref`),
  and its text must hash to the event's `envelope_hash` (events from before
  it existed: its data to the event's `output_hash`). A result an event names
  but that is not kept is no fault: retention deletes results.

The three inputs are streams ordered by operation ID (events by operation
and version), merged in one pass: memory holds one operation at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import groupby
from typing import Any

import orjson
from pydantic import ValidationError

from ledger.adapters.results import envelope_text_hash
from ledger.audit.verify import Finding, FindingKind
from ledger.domain.errors import ResultIntegrityError
from ledger.projections.operations_view import ROW_COLUMNS, Row, fold_stored
from schemas import ResultEnvelope, canonical_json, sha256_hex

__all__ = [
    "ModelEvent",
    "ModelSummary",
    "ResultBinding",
    "ResultRow",
    "result_problem",
    "served_result",
    "verify_model",
]

ModelEvent = tuple[int, str, int, str, bytes]
"""(position, operation ID, version, topic, stored state), ordered by operation and version."""

ResultRow = tuple[str, str, str]
"""(result reference, operation ID, envelope text), ordered by operation and reference."""

_SETTLING = ("Succeeded", "Failed", "Reconciled")
_LEGACY_NULL_COLUMNS = frozenset({"lease_expires_at", "trace_parent"})
"""Columns that views made before them hold empty (the lease sweep then looks at the
operation itself; the relay continues no trace): empty there is no fault."""

_LEGACY_FORM_COLUMNS = frozenset({"approval_expires_at"})
"""Columns that views made before them hold in the event's own text of a moment, not
in the view's one form: the same moment in another form is no fault."""


def _same_moment(stored: object, expected: object) -> bool:
    if not isinstance(stored, str) or not isinstance(expected, str):
        return False
    try:
        return datetime.fromisoformat(stored) == datetime.fromisoformat(expected)
    except ValueError:
        return False


@dataclass(slots=True)
class ModelSummary:
    """What checking the view and the kept results found."""

    view_rows: int = 0
    results: int = 0
    findings: list[Finding] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ResultBinding:
    """What a settling event says about the envelope kept under its `result_ref`."""

    position: int
    version: int
    kind: str
    envelope_hash: str
    output_hash: str
    outcome: str
    code: str


def _by_operation(rows: Iterable[Sequence[Any]], key: int) -> Iterator[tuple[str, list[Any]]]:
    for operation_id, group in groupby(rows, key=lambda row: str(row[key])):
        yield operation_id, list(group)


def verify_model(
    events: Iterable[ModelEvent],
    view: Iterable[Sequence[Any]],
    results: Iterable[ResultRow],
    *,
    view_position: int,
) -> ModelSummary:
    """Check every view row and every kept result against the events (see the module).

    `view` rows are `ROW_COLUMNS` values ordered by operation ID; the three
    streams must use the same order (code point order: SQLite's default,
    PostgreSQL's `COLLATE "C"`).
    """
    summary = ModelSummary()
    streams = [
        _by_operation(events, 1),
        _by_operation(view, 0),
        _by_operation(results, 1),
    ]
    heads: list[tuple[str, list[Any]] | None] = [next(stream, None) for stream in streams]
    while any(head is not None for head in heads):
        operation_id = min(head[0] for head in heads if head is not None)
        groups: list[list[Any]] = []
        for index, head in enumerate(heads):
            if head is not None and head[0] == operation_id:
                groups.append(head[1])
                heads[index] = next(streams[index], None)
            else:
                groups.append([])
        own_events, own_view, own_results = groups
        summary.view_rows += len(own_view)
        summary.results += len(own_results)
        decoded = _decoded(own_events)
        _check_view(summary.findings, operation_id, decoded, own_view, view_position)
        _check_results(summary.findings, operation_id, decoded, own_results)
    return summary


def _decoded(events: list[ModelEvent]) -> list[tuple[int, int, str, dict[str, Any] | None]]:
    """(position, version, topic, state or None if it is not a JSON object)."""
    out: list[tuple[int, int, str, dict[str, Any] | None]] = []
    for position, _, version, topic, stored in events:
        try:
            state = orjson.loads(stored)
        except orjson.JSONDecodeError:
            state = None
        out.append((position, version, topic, state if type(state) is dict else None))
    return out


def _check_view(
    findings: list[Finding],
    operation_id: str,
    events: list[tuple[int, int, str, dict[str, Any] | None]],
    view: list[Sequence[Any]],
    view_position: int,
) -> None:
    expected: Row | None = None
    for position, version, topic, state in events:
        # What the projector saw: the notification log, up to the view's position.
        if not 0 < position <= view_position:
            continue
        # The projector's own fold: an event that is not one leaves the row as
        # it was there too (the chain check names that event).
        if state is not None:
            expected = fold_stored(expected, operation_id, version, topic, state)
    stored = dict(zip(ROW_COLUMNS, view[0], strict=False)) if view else None
    if len(view) > 1:  # a primary key prevents it, but a forged table might not have one
        findings.append(
            Finding(FindingKind.VIEW_EXTRA, None, operation_id, None, "the view has this row twice")
        )
    if expected is None and stored is None:
        return
    if stored is None:
        assert expected is not None
        findings.append(
            Finding(
                FindingKind.VIEW_MISSING,
                None,
                operation_id,
                expected["last_version"],
                "the view has no row for this operation",
            )
        )
        return
    if expected is None:
        findings.append(
            Finding(
                FindingKind.VIEW_EXTRA,
                None,
                operation_id,
                None,
                "the view has a row for an operation with no projected event",
            )
        )
        return
    differences = [
        f"{column} is {stored[column]!r}, the events say {expected[column]!r}"
        for column in ROW_COLUMNS
        if stored[column] != expected[column]
        and not (column in _LEGACY_NULL_COLUMNS and stored[column] is None)
        and not (column in _LEGACY_FORM_COLUMNS and _same_moment(stored[column], expected[column]))
    ]
    if differences:
        findings.append(
            Finding(
                FindingKind.VIEW_MISMATCH,
                None,
                operation_id,
                expected["last_version"],
                "; ".join(differences),
            )
        )


def _references(
    events: list[tuple[int, int, str, dict[str, Any] | None]],
) -> dict[str, ResultBinding]:
    references: dict[str, ResultBinding] = {}
    for position, version, topic, state in events:
        kind = topic.rsplit(".", 1)[-1]
        if state is None or kind not in _SETTLING:
            continue
        reference = state.get("result_ref")
        if not isinstance(reference, str) or not reference:
            continue
        outcome = "succeeded" if kind == "Succeeded" else "failed" if kind == "Failed" else ""
        references[reference] = ResultBinding(
            position,
            version,
            kind,
            str(state.get("envelope_hash") or ""),
            str(state.get("output_hash") or ""),
            outcome or str(state.get("outcome", "")),
            str(state.get("code") or ""),
        )
    return references


def result_problem(text: str, operation_id: str, reference: ResultBinding) -> str:
    """Why a kept envelope does not belong to its event ("" when it does)."""
    if reference.envelope_hash:
        if envelope_text_hash(text) != reference.envelope_hash:
            return "its text does not hash to the envelope_hash of its event"
        return ""
    # Recorded before events bound the envelope's text: check what they did bind.
    try:
        envelope = orjson.loads(text)
    except orjson.JSONDecodeError:
        return "it is not JSON"
    if not isinstance(envelope, dict) or envelope.get("operation_id") != operation_id:
        return "it is not an envelope of this operation"
    if reference.outcome == "succeeded":
        data = envelope.get("data")
        output_hash = sha256_hex(canonical_json(data)) if data is not None else ""
        if not envelope.get("ok") or output_hash != reference.output_hash:
            return "its data does not hash to the output_hash of its event"
        return ""
    error = envelope.get("error") or {}
    if envelope.get("ok") or not isinstance(error, dict) or error.get("code") != reference.code:
        return "it is not the failure its event recorded"
    return ""


def _check_results(
    findings: list[Finding],
    operation_id: str,
    events: list[tuple[int, int, str, dict[str, Any] | None]],
    results: list[ResultRow],
) -> None:
    if not results:
        return
    references = _references(events)
    for result_ref, _, text in results:
        reference = references.get(result_ref)
        if reference is None:
            findings.append(
                Finding(
                    FindingKind.RESULT_ORPHANED,
                    None,
                    operation_id,
                    None,
                    f"{result_ref} is kept, but no event of this operation names it",
                )
            )
            continue
        problem = result_problem(str(text), operation_id, reference)
        if problem:
            findings.append(
                Finding(
                    FindingKind.RESULT_MISMATCH,
                    reference.position,
                    operation_id,
                    reference.version,
                    f"{result_ref}: {problem}",
                )
            )


def served_result(
    text: str | None, operation_id: str, reference: str, outcome: Mapping[str, Any]
) -> ResultEnvelope | None:
    """The kept envelope `text` of an operation's `outcome`, if it is the one its event bound.

    None when nothing is kept (retention may have deleted it). A kept text
    that does not match is never handed out: `ResultIntegrityError`.
    """
    if text is None:
        return None
    binding = ResultBinding(
        0,
        0,
        "",
        str(outcome.get("envelope_hash") or ""),
        str(outcome.get("output_hash") or ""),
        "succeeded" if outcome.get("status") == "succeeded" else "failed",
        str(outcome.get("code") or ""),
    )
    problem = result_problem(text, operation_id, binding)
    if not problem:
        try:
            return ResultEnvelope.model_validate_json(text)
        except ValidationError:
            problem = "it is not a result envelope"
    raise ResultIntegrityError(
        f"the kept result does not match its event ({problem}); it is not served",
        operation_id=operation_id,
        result_ref=reference,
    )
