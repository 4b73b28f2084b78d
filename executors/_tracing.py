"""The executor's spans: one `execute_tool {tool}` per attempt that runs the tool.

A redelivered item whose operation is already settled, a lease refused, a
lookup of an unknown outcome: none of these runs the tool, so none gets an
`execute_tool` span (a lookup gets `opledger.reconcile`). Argument and result
values go on a span only when `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`
asks for them, and then redacted as the executor redacts what it publishes,
with the contract's sensitive arguments masked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from executors._redact import RedactionPolicy, redact
from policy import ToolContract, replace_at_pointers
from schemas import (
    GenAI,
    ResultEnvelope,
    ResultOutcome,
    TraceAttr,
    capture_tool_content,
    host_operation_id,
    tracer,
)

__all__ = ["describe_result", "execute_tool_span", "reconcile_span"]

_MASK = "[sensitive]"
_MAX_CAPTURED = 8192
"""Characters of argument or result JSON a span keeps (a result may be 512 KiB)."""


def _captured(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= _MAX_CAPTURED else text[:_MAX_CAPTURED] + "…[truncated]"


@contextmanager
def execute_tool_span(
    contract: ToolContract,
    *,
    operation_id: str,
    attempt: int,
    fencing_token: int,
    executor: str,
    arguments: dict[str, Any],
    redaction: RedactionPolicy,
) -> Iterator[Span]:
    """The GenAI conventions' tool execution span around one attempt that runs the tool."""
    attributes: dict[str, Any] = {
        GenAI.OPERATION_NAME: GenAI.EXECUTE_TOOL,
        GenAI.TOOL_NAME: contract.name,
        # The host's ID of the call: the ID its model's tool call carried.
        GenAI.TOOL_CALL_ID: host_operation_id(operation_id),
        GenAI.TOOL_TYPE: "function",
        GenAI.TOOL_DESCRIPTION: contract.description.summary,
        TraceAttr.OPERATION_ID: operation_id,
        TraceAttr.ATTEMPT: attempt,
        TraceAttr.FENCING_TOKEN: fencing_token,
        TraceAttr.EXECUTOR: executor,
    }
    if capture_tool_content():
        shown = replace_at_pointers(arguments, contract.sensitive_arguments, lambda _: _MASK)
        attributes[GenAI.TOOL_CALL_ARGUMENTS] = _captured(redact(shown, redaction).value)
    with tracer().start_as_current_span(
        f"{GenAI.EXECUTE_TOOL} {contract.name}",
        kind=SpanKind.INTERNAL,
        attributes=attributes,
        # A tool's failure is an outcome, described below, not an exception to record.
        record_exception=False,
        set_status_on_exception=True,
    ) as span:
        yield span


@contextmanager
def reconcile_span(
    contract: ToolContract, *, operation_id: str, attempt: int, lookup: int | None
) -> Iterator[Span]:
    """A lookup of an attempt's unknown outcome: it runs the lookup, never the tool."""
    with tracer().start_as_current_span(
        "opledger.reconcile",
        kind=SpanKind.INTERNAL,
        attributes={
            GenAI.TOOL_NAME: contract.name,
            TraceAttr.OPERATION_ID: operation_id,
            TraceAttr.ATTEMPT: attempt,
            TraceAttr.LOOKUP: lookup or 0,
        },
    ) as span:
        yield span


def describe_result(span: Span, envelope: ResultEnvelope | None, reason: str) -> None:
    """What the attempt ended in, on its span (`reason`: the disposition's word)."""
    if envelope is None:
        span.set_attribute(TraceAttr.OUTCOME, reason)
        return
    outcome = envelope.outcome
    span.set_attribute(TraceAttr.OUTCOME, outcome.value)
    if outcome is not ResultOutcome.SUCCEEDED and envelope.error is not None:
        span.set_attribute(GenAI.ERROR_TYPE, envelope.error.code)
        span.set_status(Status(StatusCode.ERROR, envelope.error.code))
    elif envelope.data is not None and capture_tool_content():
        # Already redacted: the envelope is what the executor publishes.
        span.set_attribute(GenAI.TOOL_CALL_RESULT, _captured(envelope.data))


