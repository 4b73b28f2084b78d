"""Sample executors of the document tools, over the fake document store in `_world`.

- `search_documents`: keyword search over sections, ranked, filtered by type and date.
- `read_document_span`: a character range, re-checking `expected_revision` first.
- `compare_document_snapshots`: section-by-section changes between two snapshots.
- `delete_document`: forbidden by policy (the ledger never leases it), but
  implemented like any irreversible write: revision re-check, idempotent, reconcilable.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import date
from typing import Any

from executors._api import Precondition, Reconciliation, ToolContext, ToolError, tool
from executors.samples._world import Document, Snapshot, world
from schemas import ErrorCategory

__all__ = [
    "compare_document_snapshots",
    "delete_document",
    "read_document_span",
    "search_documents",
]

_MAX_SPAN_CHARS = 20_000
_MAX_CHANGE_CHARS = 2_000
_WORD = re.compile(r"\w+")


def _words(text: str) -> set[str]:
    return {word.lower() for word in _WORD.findall(text)}


# ------------------------------------------------------------- search_documents


@tool("search_documents", version="2.1.0")
def search_documents(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
    """Rank the caller's tenant's sections by the share of query words they contain."""
    if not context.tenant:
        # No trusted tenant (a ledger older than this executor): searching every
        # tenant's documents instead would leak them.
        raise ToolError(
            ErrorCategory.UNAUTHORIZED, "NO_TRUSTED_TENANT", "the lease names no tenant"
        )
    query = _words(str(arguments["query"]))
    if not query:
        raise ToolError(
            ErrorCategory.INVALID_INPUT, "INVALID_QUERY", "the query has no searchable words"
        )
    source_types = set(arguments.get("source_types") or ("policy", "manual"))
    raw_from = arguments.get("date_from")
    date_from = date.fromisoformat(raw_from) if isinstance(raw_from, str) else None
    top_k = int(arguments.get("top_k", 8))
    hits: list[tuple[float, str, str, dict[str, Any]]] = []
    with world().lock:
        documents = list(world().documents.values())
    for document in documents:
        if document.tenant != context.tenant:
            continue  # another tenant's: never searched, never scored
        if document.source_type not in source_types:
            continue
        if date_from is not None and document.effective_date < date_from:
            continue
        for section_id, text in document.snapshot.sections:
            found = len(query & _words(text))
            if not found:
                continue
            score = round(found / len(query), 4)
            span_id = f"{document.id}#{section_id}"
            item = {
                "source_id": document.id,
                "revision": document.revision,
                "span_id": span_id,
                "text": text[:2_000],
                "score": score,
            }
            hits.append((-score, document.id, span_id, item))
    hits.sort(key=lambda hit: hit[:3])
    items = [hit[3] for hit in hits[:top_k]]
    truncated = len(hits) > top_k
    return {
        "items": items,
        "truncated": truncated,
        "next_cursor": f"offset-{top_k}" if truncated else None,
    }


# ----------------------------------------------------------- read_document_span


def _visible(document: Document | None, context: ToolContext) -> Document | None:
    """The document, if the caller's tenant (from the lease) may see it."""
    if document is None or not context.tenant or document.tenant != context.tenant:
        return None
    return document


def _read_target(arguments: Mapping[str, Any], context: ToolContext) -> tuple[str, Snapshot]:
    """The current revision and the snapshot to read; NOT_FOUND when invisible."""
    with world().lock:
        document = _visible(world().documents.get(str(arguments["document_id"])), context)
        if document is None:
            raise ToolError(
                ErrorCategory.NOT_FOUND, "DOCUMENT_NOT_FOUND", "no such document is visible"
            )
        snapshot_id = arguments.get("snapshot_id")
        if snapshot_id is None:
            return document.revision, document.snapshot
        snapshot = world().snapshots.get(str(snapshot_id))
        if snapshot is None or snapshot.document_id != document.id:
            raise ToolError(
                ErrorCategory.NOT_FOUND,
                "DOCUMENT_NOT_FOUND",
                "no such snapshot of this document is visible",
            )
        return document.revision, snapshot


@tool("read_document_span", version="1.2.0")
def read_document_span(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
    """The text of `[start_char, end_char)` of the document or one of its snapshots."""
    _, snapshot = _read_target(arguments, context)
    start, end = int(arguments["start_char"]), int(arguments["end_char"])
    if end <= start or end > snapshot.length:
        raise ToolError(
            ErrorCategory.INVALID_INPUT,
            "SPAN_OUT_OF_RANGE",
            f"the range must lie within the {snapshot.length} characters of the text",
            safe_details={"length": snapshot.length},
        )
    truncated = end - start > _MAX_SPAN_CHARS
    stop = start + _MAX_SPAN_CHARS if truncated else end
    return {
        "document_id": snapshot.document_id,
        "snapshot_id": arguments.get("snapshot_id"),
        "revision": snapshot.revision,
        "start_char": start,
        "end_char": stop,
        "text": snapshot.text[start:stop],
        "truncated": truncated,
    }


@read_document_span.precondition
def _read_current(arguments: Mapping[str, Any], context: ToolContext) -> Precondition:
    # expected_revision names the revision the caller saw: if the document
    # moved on since, the span it wants to quote may no longer exist.
    revision, _ = _read_target(arguments, context)
    expected = arguments.get("expected_revision")
    if expected is not None and expected != revision:
        return Precondition.stale(
            f"the document is at revision {revision}, not {expected}", code="REVISION_CHANGED"
        )
    return Precondition.ok()


# --------------------------------------------------- compare_document_snapshots


def _normalize(text: str | None, ignore_whitespace: bool) -> str | None:
    if text is None or not ignore_whitespace:
        return text
    return " ".join(text.split())


def _location(snapshot: Snapshot, section_id: str) -> str | None:
    span = snapshot.section_span(section_id)
    return None if span is None else f"{snapshot.id}:{span[0]}-{span[1]}"


@tool("compare_document_snapshots", version="1.0.0")
def compare_document_snapshots(
    arguments: Mapping[str, Any], context: ToolContext
) -> dict[str, Any]:
    """Every section whose text differs between the two snapshots, before → after."""
    source_id = str(arguments["source_id"])
    with world().lock:
        before = world().snapshots.get(str(arguments["before_snapshot_id"]))
        after = world().snapshots.get(str(arguments["after_snapshot_id"]))
        source = _visible(world().documents.get(source_id), context)
    if before is None or after is None or source is None:
        raise ToolError(
            ErrorCategory.NOT_FOUND, "SNAPSHOT_NOT_FOUND", "no such snapshot is visible"
        )
    if before.document_id != source_id or after.document_id != source_id:
        raise ToolError(
            ErrorCategory.INVALID_INPUT,
            "SOURCE_MISMATCH",
            "both snapshots must belong to source_id; nothing was compared",
        )
    ignore_whitespace = bool(arguments.get("ignore_whitespace", True))
    before_sections, after_sections = dict(before.sections), dict(after.sections)
    known = list(before_sections) + [s for s in after_sections if s not in before_sections]
    requested = arguments.get("sections")
    if requested is None:
        compared, missing = known, []
    else:
        compared = [s for s in requested if s in before_sections or s in after_sections]
        missing = [s for s in requested if s not in compared]
    changes = []
    for section in compared:
        old, new = before_sections.get(section), after_sections.get(section)
        if _normalize(old, ignore_whitespace) == _normalize(new, ignore_whitespace):
            continue
        changes.append(
            {
                "section": section,
                "before_text": None if old is None else old[:_MAX_CHANGE_CHARS],
                "after_text": None if new is None else new[:_MAX_CHANGE_CHARS],
                "before_location": _location(before, section),
                "after_location": _location(after, section),
            }
        )
    return {
        "status": "partial" if missing else "complete",
        "compared_inputs": {
            "source_id": source_id,
            "before_snapshot_id": before.id,
            "after_snapshot_id": after.id,
        },
        "compared_sections": compared,
        "missing_sections": missing,
        "changes": changes,
    }


# -------------------------------------------------------------- delete_document


@tool("delete_document", version="1.0.0")
def delete_document(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
    """Delete the document and its snapshots (once per idempotency key)."""
    document_id = str(arguments["document_id"])
    with world().lock:
        if document_id not in world().documents and context.idempotency_key not in (
            world().deletions
        ):
            raise ToolError(
                ErrorCategory.NOT_FOUND, "DOCUMENT_NOT_FOUND", "no such document is visible"
            )
        return dict(world().delete_document(context.idempotency_key, document_id))


@delete_document.precondition
def _delete_current(arguments: Mapping[str, Any], context: ToolContext) -> Precondition:
    with world().lock:
        done = world().deletions.get(context.idempotency_key)
        if done is not None:
            return Precondition.already_applied(done, "this operation already deleted it")
        document = _visible(world().documents.get(str(arguments["document_id"])), context)
    if document is None:
        raise ToolError(
            ErrorCategory.NOT_FOUND, "DOCUMENT_NOT_FOUND", "no such document is visible"
        )
    if document.revision != arguments["expected_revision"]:
        return Precondition.stale(
            f"the document is at revision {document.revision}, not the one approved",
            code="REVISION_CHANGED",
        )
    return Precondition.ok()


@delete_document.reconciler
def _delete_lookup(operation_id: str, _context: ToolContext) -> Reconciliation:
    with world().lock:
        done = world().deletions.get(operation_id)
    return Reconciliation.applied(done) if done is not None else Reconciliation.not_applied()
