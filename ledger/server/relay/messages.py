"""What each stored event means on NATS: the pure half of the relay.

A stored event becomes its feed record on `ops.feed.<tool>.<EventType>`;
a dispatching event (`EventKind.dispatches`) also becomes a work item on its tool's queue
(to run an attempt, or to look an unknown outcome up); a settling event
(`EventKind.settles`) also becomes an outcome notice to the host that proposed
the operation, and a notifying one (`EventKind.notifies`: it needs a person) a
notice that is not final. Nothing here does I/O: the outcome notice's
status, the tool's sensitive arguments and the metrics come in as ports,
so the builder is tested without NATS or a database.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from opentelemetry.trace import SpanKind

from ledger._recent import Recent
from ledger.adapters.event_tables import StoredRow
from ledger.audit.export import feed_record
from ledger.domain.event_kinds import event_kind
from ledger.domain.plan import PLAN_FEED_TOKEN, is_plan_id, plan_host
from schemas import (
    GenAI,
    OperationStatus,
    Subjects,
    TraceAttr,
    WorkItem,
    WorkPurpose,
    context_from_traceparent,
    feed_message_id,
    host_operation_id,
    trace_headers,
    tracer,
)

__all__ = [
    "FinalStatus",
    "Observe",
    "RelayMessage",
    "Route",
    "SensitiveArguments",
    "learn_routes",
    "messages_for",
    "plan_route",
]

_log = logging.getLogger(__name__)

Route = tuple[str, str | None, str, str | None]
"""What the relay needs to know of an operation: (tool, tool version or None, host, the
traceparent its spans continue or None)."""

SensitiveArguments = Callable[[str], Sequence[str]]
"""tool → the JSON pointers of its arguments the feed carries hashed (none for an
unknown tool)."""

FinalStatus = Callable[[str, int, str, bool], OperationStatus | None]
"""(host's operation ID, the version just read, host, final) → the status to announce,
or None for none (unreadable, or not what `final` expects: the host asks instead).
`final`: announce only a final outcome; otherwise only a state that needs a person."""

Observe = Callable[[dict[str, Any], str], None]
"""Counts one feed record of a tool (the metrics)."""


@dataclass(frozen=True, slots=True)
class RelayMessage:
    """One NATS message the relay publishes."""

    subject: str
    payload: bytes
    message_id: str | None
    """The `Nats-Msg-Id`; None: core NATS (outcome notices are not stored)."""
    feed: bool = False
    """A feed event: its stream sequence number is known in advance."""
    row: StoredRow | None = None
    """The event a feed message carries (to set it aside if JetStream refuses it)."""
    headers: dict[str, str] | None = None
    """Headers besides the `Nats-Msg-Id` (a work item's trace context)."""


def plan_route(plan_id: str) -> Route:
    """A plan's route: its events go to the feed under `_plan`, its host from its ID."""
    return (PLAN_FEED_TOKEN, None, plan_host(plan_id), None)


def learn_routes(rows: Iterable[StoredRow], routes: Recent[str, Route]) -> None:
    """Note each operation's tool, tool version and host from the events that name them
    (a plan's route is its ID's: `plan_route`).

    The relay reads every event anyway; keeping these three facts saves
    bringing the operations view up to date (a transaction) per batch.
    """
    for _, operation_id, _, topic, stored in rows:
        if is_plan_id(operation_id):
            if operation_id not in routes:
                routes.remember(operation_id, plan_route(operation_id))
            continue
        kind = topic.rsplit(".", 1)[-1]
        try:
            if kind == "Proposed":
                state = orjson.loads(stored)
                traced = state.get("trace_parent")
                route = (
                    str(state["tool"]),
                    None,
                    str(state.get("host", "")),
                    traced if isinstance(traced, str) else None,
                )
                routes.remember(operation_id, route)
            elif kind in ("Validated", "Rejected"):
                known = routes.get(operation_id)
                if known is not None:
                    version = orjson.loads(stored).get("tool_version")
                    routes.remember(
                        operation_id,
                        (known[0], None if version is None else str(version), *known[2:]),
                    )
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            # Not an event (a row written by hand): nothing to learn from it;
            # without a route the relay sets it aside.
            continue


def messages_for(
    row: StoredRow,
    route: Route,
    *,
    limit: int,
    sensitive: SensitiveArguments,
    final_status: FinalStatus,
    observe: Observe | None = None,
) -> list[RelayMessage]:
    """The messages one event means, each within `limit` bytes; raises if it has none."""
    tool, tool_version, host, trace_parent = route
    operation_id, version = row[1], row[2]
    if tool == PLAN_FEED_TOKEN:
        # A plan's event: on the feed only, each step's arguments hashed by its tool's
        # sensitive pointers. Its steps are operations with their own messages.
        record = feed_record(row, (), sensitive_of=lambda name: tuple(sensitive(name)))
    else:
        record = feed_record(row, tuple(sensitive(tool)))
    kind = record["type"]
    if observe is not None:
        try:
            observe(record, tool)
        except Exception:  # a metric must never cost an event its publication
            _log.warning("metrics could not count %s event %s", kind, version, exc_info=True)
    payload = orjson.dumps(record)
    if len(payload) > limit:
        # The event itself stays in the ledger; the feed carries its hash,
        # which is what an auditor compares against the store.
        payload = orjson.dumps(record | {"event": {}, "event_omitted": True})
        if len(payload) > limit:
            raise ValueError(f"even without its body the feed record is {len(payload)} bytes")
    messages = [
        RelayMessage(
            Subjects.feed(tool, kind),
            payload,
            feed_message_id(operation_id, version),
            feed=True,
            row=row,
        )
    ]
    registered = None if tool == PLAN_FEED_TOKEN else event_kind(kind)
    if registered is not None and registered.dispatches and tool_version:
        item = _work_item(record["event"], registered.dispatches, operation_id, tool, tool_version)
        messages.append(
            RelayMessage(
                Subjects.work(tool),
                item.model_dump_json().encode(),
                # One dispatch event per attempt (and per lookup of its outcome, and
                # one preview per call), so one work item each.
                item.message_id,
                headers=dispatch_headers(item, trace_parent),
            )
        )
    if registered is not None and (registered.settles or registered.notifies) and host:
        notice = _outcome_notice(
            operation_id, version, host, limit, final_status, final=registered.settles
        )
        if notice is not None:
            messages.append(notice)
    return messages


def dispatch_headers(item: WorkItem, trace_parent: str | None) -> dict[str, str] | None:
    """The trace context a work item carries: a dispatch span in the operation's trace,
    so the executor's spans continue it (None for an untraced operation)."""
    if trace_parent is None:
        return None
    try:
        return _dispatch_span_headers(item, trace_parent)
    except Exception:  # a broken span processor costs the item its trace, nothing else
        _log.debug("no trace context for %s", item.operation_id, exc_info=True)
        return None


def _dispatch_span_headers(item: WorkItem, trace_parent: str) -> dict[str, str] | None:
    span = tracer().start_span(
        "opledger.dispatch",
        context=context_from_traceparent(trace_parent),
        kind=SpanKind.PRODUCER,
        attributes={
            GenAI.TOOL_NAME: item.tool,
            TraceAttr.OPERATION_ID: item.operation_id,
            TraceAttr.ATTEMPT: item.attempt,
            TraceAttr.PURPOSE: item.purpose.value,
            TraceAttr.LOOKUP: item.lookup,
        },
    )
    try:
        # A span's context is what an executor continues; it ends here, at the
        # hand-over (the publish itself is batched with the feed's).
        return trace_headers(span=span)
    finally:
        span.end()


def _work_item(
    event: dict[str, Any], purpose: WorkPurpose, operation_id: str, tool: str, tool_version: str
) -> WorkItem:
    if purpose is WorkPurpose.EXECUTE:
        attempt, lookup = int(event.get("after_attempt", 0)) + 1, 0
    elif purpose is WorkPurpose.PREVIEW:
        attempt, lookup = 1, 0  # before any attempt: the first one is what it previews
    else:
        # The first lookup after the outcome became unknown, or the next one after
        # an inconclusive lookup. Events stored before they named their attempt
        # say 0; the ID stays unique per lookup all the same.
        attempt, lookup = max(int(event.get("attempt", 0)), 1), int(event.get("round", 0)) + 1
    return WorkItem(
        operation_id=operation_id,
        tool=tool,
        tool_version=tool_version,
        attempt=attempt,
        purpose=purpose,
        lookup=lookup,
    )


def _outcome_notice(
    operation_id: str,
    version: int,
    host: str,
    limit: int,
    final_status: FinalStatus,
    *,
    final: bool = True,
) -> RelayMessage | None:
    """The announcement of a final outcome to its host, if there is one to make.

    Best effort (core NATS, and the host asks for the status when none
    comes): a status that cannot be read is the host's to ask about, and
    it never costs the event its place on the feed.
    """
    # The host knows its operation by its own ID: asked in its namespace.
    local = host_operation_id(operation_id)
    status = final_status(local, version, host, final)
    if status is None:
        return None
    payload = status.model_dump_json().encode()
    if len(payload) > limit:
        # A result too large for any message: no notice (a notice without
        # its result would read as "no result"). The host's status request
        # is answered with an error that says so.
        _log.warning("no outcome notice for %s: %d bytes", operation_id, len(payload))
        return None
    return RelayMessage(Subjects.outcome(host, local), payload, None)
