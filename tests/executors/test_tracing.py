"""The executor's spans: argument values only when asked for, then redacted and with
the contract's sensitive arguments masked; a lookup is no `execute_tool` span."""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from executors._redact import DEFAULT_POLICY
from executors._tracing import execute_tool_span, reconcile_span
from tests.executors.helpers import contract

CAPTURE = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
ARGUMENTS = {
    "recipient_ids": ["cus-0001"],
    "template": "support_received",
    "variables": {"ticket_id": "TCK-42", "note": "call me on 555-0100"},
}



def _run(capture: str | None, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    if capture is None:
        monkeypatch.delenv(CAPTURE, raising=False)
    else:
        monkeypatch.setenv(CAPTURE, capture)
    with execute_tool_span(
        contract("send_customer_email"),
        operation_id="h1/mail-1",
        attempt=1,
        fencing_token=3,
        executor="email-0",
        arguments=ARGUMENTS,
        redaction=DEFAULT_POLICY.with_secrets(["TCK-42-secret-value"]),
    ) as span:
        assert span.is_recording()
        return dict(span.attributes or {})  # type: ignore[attr-defined]


def test_argument_values_stay_off_the_span_unless_asked_for(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    attributes = _run(None, monkeypatch)
    assert "gen_ai.tool.call.arguments" not in attributes
    assert attributes["gen_ai.tool.call.id"] == "mail-1"
    assert _run("false", monkeypatch).get("gen_ai.tool.call.arguments") is None


def test_asked_for_arguments_are_shown_with_sensitive_ones_masked(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown = json.loads(str(_run("true", monkeypatch)["gen_ai.tool.call.arguments"]))
    # `/variables` is sensitive in the e-mail contract: its value never leaves.
    assert shown == {
        "recipient_ids": ["cus-0001"],
        "template": "support_received",
        "variables": "[sensitive]",
    }
    assert ARGUMENTS["variables"] != "[sensitive]"  # the call itself is untouched


def test_a_lookup_is_a_reconcile_span_not_a_tool_execution(
    spans: InMemorySpanExporter,
) -> None:
    with reconcile_span(
        contract("send_customer_email"), operation_id="h1/mail-1", attempt=1, lookup=2
    ):
        pass
    (span,) = spans.get_finished_spans()
    assert span.name == "opledger.reconcile"
    assert "gen_ai.operation.name" not in (span.attributes or {})
