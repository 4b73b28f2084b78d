"""Trace context on the wire, and the names of opledger's spans and attributes.

A host's proposal may carry a W3C `traceparent` (and `tracestate`) NATS header;
the ledger's spans continue that trace, the ledger keeps the context of its
check with the operation (`Operation.Proposed.trace_parent`), and every later
message about the operation carries it on: the work item to the executor, the
executor's lease request and result back to the ledger. One operation is one
trace however long it waits for a person.

This lives beside the wire models because it is part of the wire, and because
the three parties that speak it (the host's SDK, the ledger, the executors)
share nothing else. Only the OpenTelemetry API is needed: without an SDK every
span here is a no-op that still passes a host's context on.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "TRACEPARENT_PATTERN",
    "GenAI",
    "TraceAttr",
    "capture_tool_content",
    "context_from_headers",
    "context_from_traceparent",
    "current_traceparent",
    "setup_tracing",
    "trace_headers",
    "tracer",
]

_log = logging.getLogger(__name__)

TRACEPARENT_PATTERN: Final = r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
"""A version-00 W3C `traceparent`, as the ledger stores one."""
_TRACEPARENT = re.compile(TRACEPARENT_PATTERN)

_EXTRA = "pip install 'opledger[otlp]'"

# W3C Trace Context alone, whatever propagators a process configured: nothing else a
# sender puts in its headers (baggage, say) is read, or echoed into a log.
_PROPAGATOR = TraceContextTextMapPropagator()
_MAX_TRACEPARENT = 128
_MAX_TRACESTATE = 512
"""W3C's own limit on what a vendor must keep of `tracestate`; a longer one is dropped."""

_CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
"""The GenAI instrumentations' opt-in for content: argument and result values."""


class GenAI:
    """The OpenTelemetry GenAI semantic conventions' names for a tool execution."""

    OPERATION_NAME: Final = "gen_ai.operation.name"
    EXECUTE_TOOL: Final = "execute_tool"
    TOOL_NAME: Final = "gen_ai.tool.name"
    TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
    TOOL_TYPE: Final = "gen_ai.tool.type"
    TOOL_DESCRIPTION: Final = "gen_ai.tool.description"
    TOOL_CALL_ARGUMENTS: Final = "gen_ai.tool.call.arguments"
    """Opt-in (`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`), redacted."""
    TOOL_CALL_RESULT: Final = "gen_ai.tool.call.result"
    """Opt-in, as the arguments; the result as the executor publishes it (redacted)."""
    ERROR_TYPE: Final = "error.type"


class TraceAttr:
    """opledger's own span attributes (`opledger.*`)."""

    OPERATION_ID: Final = "opledger.operation.id"
    """The ledger's operation ID (`<host>/<host's ID>`)."""
    HOST: Final = "opledger.host"
    TENANT: Final = "opledger.tenant"
    STATE: Final = "opledger.state"
    DECISION: Final = "opledger.decision"
    """The check's outcome: ready, needs_approval, rejected, needs_clarification."""
    RISK: Final = "opledger.risk"
    RISK_REASONS: Final = "opledger.risk.reasons"
    CREATED: Final = "opledger.created"
    """False: the same call under the same ID again (an idempotent retry)."""
    APPROVAL_REQUIRED: Final = "opledger.approval.required"
    APPROVAL_ACTION: Final = "opledger.approval.action"
    """approve or deny."""
    APPROVAL_APPROVER: Final = "opledger.approval.approver"
    APPROVAL_VIA: Final = "opledger.approval.via"
    APPROVAL_PREVIEW_HASH: Final = "opledger.approval.preview_hash"
    """The digest of the tool's preview the approver named (a previewed call)."""
    APPROVAL_GRANTED: Final = "opledger.approval.granted"
    """Approvals given so far."""
    APPROVAL_NEEDED: Final = "opledger.approval.needed"
    """Approvals the contract asks for."""
    REFUSAL: Final = "opledger.refusal"
    """Why a request was refused (its error code)."""
    ATTEMPT: Final = "opledger.attempt"
    FENCING_TOKEN: Final = "opledger.fencing_token"
    PURPOSE: Final = "opledger.purpose"
    """execute or reconcile (the work item's)."""
    LOOKUP: Final = "opledger.lookup"
    EXECUTOR: Final = "opledger.executor"
    LEASE_DECISION: Final = "opledger.lease.decision"
    OUTCOME: Final = "opledger.outcome"
    """What the attempt ended in: succeeded, failed, unknown, or why it did not run."""
    DISPOSITION: Final = "opledger.result.disposition"
    """What the ledger made of a result: recorded, duplicate, stale, refused, ..."""
    COMMAND: Final = "opledger.command"
    """An operator's or host's command: cancel, resolve, retry."""


def tracer() -> Tracer:
    """opledger's tracer (from the global provider: a no-op until a process sets one)."""
    return trace.get_tracer("opledger")


def trace_headers(
    headers: dict[str, str] | None = None, *, span: Span | None = None
) -> dict[str, str] | None:
    """`headers` with the trace context of `span` (default: the current span) added
    (`traceparent`, `tracestate`); None when there is nothing to send."""
    carrier: dict[str, str] = dict(headers or {})
    _PROPAGATOR.inject(
        carrier, context=None if span is None else trace.set_span_in_context(span)
    )
    return carrier or None


def context_from_headers(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context a message's headers carry (an empty one for none, or a
    malformed one: a sender's bad header costs it only its trace)."""
    if not headers:
        return otel_context.Context()
    parent = headers.get("traceparent")
    if not parent or len(parent) > _MAX_TRACEPARENT:
        return otel_context.Context()
    carrier = {"traceparent": parent}
    state = headers.get("tracestate")
    if state and len(state) <= _MAX_TRACESTATE:
        carrier["tracestate"] = state
    try:
        return _PROPAGATOR.extract(carrier)
    except Exception:  # a propagator must never fail a request
        return otel_context.Context()


def context_from_traceparent(traceparent: str | None) -> otel_context.Context:
    """The context of a stored `traceparent` (empty for None)."""
    if not traceparent:
        return otel_context.Context()
    return context_from_headers({"traceparent": traceparent})


def current_traceparent() -> str | None:
    """The current span's context as a `traceparent`, None when there is no valid one."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    value = carrier.get("traceparent")
    return value if value is not None and _TRACEPARENT.match(value) else None


def capture_tool_content() -> bool:
    """Whether spans may carry argument and result values (off unless asked for)."""
    return os.environ.get(_CAPTURE_ENV, "").strip().lower() in ("1", "true", "yes")


def setup_tracing(service_name: str, instance: str | None = None) -> bool:
    """Install an SDK tracer provider for this process if the environment asks for
    one (`OTEL_TRACES_EXPORTER`, or `OTEL_EXPORTER_OTLP_ENDPOINT` /
    `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); True if spans are now exported.

    `otlp` needs the `opledger[otlp]` extra, `console` prints spans to stderr. A
    process that already has a provider (an agent host with its own) keeps it.
    """
    wanted = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if wanted == "none" or (wanted == "" and not endpoint):
        return False
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return False  # someone in this process set one up already: theirs stands
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )
    except ImportError:
        _log.warning("traces asked for, but the OpenTelemetry SDK is missing: %s", _EXTRA)
        return False
    exporter: SpanExporter
    if wanted == "console":
        exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            _log.warning("OTLP traces asked for, but the exporter is missing: %s", _EXTRA)
            return False
        exporter = OTLPSpanExporter()
    attributes: dict[str, Any] = {"service.name": service_name}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True
