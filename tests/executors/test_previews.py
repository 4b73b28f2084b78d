"""The executor's side of previews, against a fake lease responder: the dry run it runs
for approvers, and the second one right before the real run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from executors import ItemAction, ItemProcessor, ProcessorOptions, Tool, ToolContext, ToolError
from schemas import (
    PREVIEW_MAX_BYTES,
    ErrorCategory,
    ErrorInfo,
    LeaseDecision,
    LeaseReply,
    LeaseRequest,
    PreviewReport,
    canonical_json,
    sha256_hex,
)
from tests.executors.helpers import FakeLedger, contract, process, reply, work_item

WRITE = "send_customer_email"
ARGS = {"recipient_ids": ["cus-0001"], "template": "support_received",
        "variables": {"ticket_id": "TCK-1"}}
OUT: dict[str, Any] = {"accepted_count": 1, "rejected_recipient_ids": [],
                       "provider_message_ids": ["msg-1"]}
SECRET = "provider-password-123456"


class Recorder:
    """A write tool whose preview says what `effect` holds; counts runs and previews."""

    def __init__(self, effect: Any) -> None:
        self.effect = effect
        self.runs = 0
        self.previews: list[tuple[Mapping[str, Any], ToolContext]] = []

    def tool(self) -> Tool:
        def run(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
            self.runs += 1
            return OUT

        def preview(arguments: Mapping[str, Any], context: ToolContext) -> Any:
            self.previews.append((arguments, context))
            if isinstance(self.effect, BaseException):
                raise self.effect
            return self.effect

        implementation = Tool(name=WRITE, run=run)
        implementation.previewer(preview)
        return implementation


def _processor(implementation: Tool) -> ItemProcessor:
    options = ProcessorOptions("exec-1", secrets={"email_provider_db": SECRET})
    return ItemProcessor(implementation, contract(WRITE), options)


def _preview_ledger() -> FakeLedger:
    """Answers the item's lease request with `preview`, and the report with `done`."""

    def answer(request: LeaseRequest) -> LeaseReply:
        if request.preview is not None:
            return reply(LeaseDecision.DONE, request.operation_id, WRITE)
        return reply(LeaseDecision.PREVIEW, request.operation_id, WRITE, arguments=ARGS,
                     fencing_token=None)

    return FakeLedger(answer)


def _previewed(effect: Any, *, delivery: int = 1) -> tuple[str, PreviewReport | None, Recorder]:
    recorder = Recorder(effect)
    ledger = _preview_ledger()
    disposition = process(_processor(recorder.tool()), work_item("h1/op-1", WRITE), ledger,
                          delivery=delivery)
    sent = [r.preview for r in ledger.requests if r.preview is not None]
    assert recorder.runs == 0  # a preview never runs the tool
    return f"{disposition.action.value}:{disposition.reason}", sent[-1] if sent else None, recorder


def test_a_preview_runs_the_hook_with_the_leased_call_and_sends_its_report() -> None:
    effect = {"summary": "send 1 e-mail(s)", "recipients": ["customer-0001@acme.example.test"]}
    outcome, report, recorder = _previewed(effect)
    assert outcome == "ack:previewed"
    assert report is not None and report.effect == effect and report.redactions == []
    assert report.effect_sha256 == sha256_hex(canonical_json(effect))
    [(arguments, context)] = recorder.previews
    assert arguments == ARGS
    assert (context.operation_id, context.tenant) == ("h1/op-1", "acme")


def test_a_preview_is_redacted_like_any_output_and_bound_to_what_the_tool_produced() -> None:
    effect = {"note": f"connected with {SECRET}", "token": "abc", "body": "pay \u202eevil"}
    _, report, _ = _previewed(effect)
    assert report is not None and report.effect is not None
    assert SECRET not in str(report.effect) and "abc" not in str(report.effect)
    assert "\u202e" not in str(report.effect)
    assert sorted(report.redactions) == ["/body", "/note", "/token"]  # said, for approvers
    # A change only in what approvers were not shown still changes the digest.
    _, other, _ = _previewed({**effect, "token": "xyz"})
    assert other is not None and other.effect == report.effect
    assert other.digest() != report.digest()


def test_a_preview_that_cannot_be_shown_is_reported_as_an_error_never_a_trace() -> None:
    assert PREVIEW_MAX_BYTES < 5 * 15_000
    crash = RuntimeError("Traceback (most recent call last): secret internals")
    cases = {
        "PREVIEW_FAILED": crash,
        "PREVIEW_INVALID": ["not", "an", "object"],
        # Each string within the redaction's limit, together over the preview's.
        "PREVIEW_TOO_LARGE": {f"part-{n}": "x" * 15_000 for n in range(5)},
        "RECIPIENT_NOT_FOUND": ToolError(ErrorCategory.NOT_FOUND, "RECIPIENT_NOT_FOUND",
                                         "a recipient does not exist"),
    }
    for code, effect in cases.items():
        outcome, report, _ = _previewed(effect)
        assert outcome == "ack:previewed", code
        assert report is not None and report.error is not None and report.effect is None
        assert report.error.code == code
        assert "Traceback" not in report.error.message


def test_a_transient_preview_failure_is_tried_again_before_it_is_reported() -> None:
    down = ToolError(ErrorCategory.TRANSIENT, "PROVIDER_UNAVAILABLE", "the provider is down")
    outcome, report, _ = _previewed(down, delivery=1)
    assert (outcome, report) == ("nak:preview_retry", None)
    outcome, report, _ = _previewed(down, delivery=5)
    assert outcome == "ack:previewed"
    assert report is not None and report.error is not None
    assert report.error.code == "PROVIDER_UNAVAILABLE"


def test_a_tool_without_a_preview_says_so_instead_of_leaving_approvers_waiting() -> None:
    implementation = Tool(name=WRITE, run=lambda a, c: OUT)
    ledger = _preview_ledger()
    disposition = process(_processor(implementation), work_item("h1/op-1", WRITE), ledger)
    assert disposition.action is ItemAction.ACK
    [report] = [r.preview for r in ledger.requests if r.preview is not None]
    assert report.error is not None and report.error.code == "PREVIEW_UNSUPPORTED"


def _execute(recorder: Recorder, approved: str) -> tuple[str, Any]:
    lease = reply(LeaseDecision.EXECUTE, "h1/op-1", WRITE, arguments=ARGS).model_copy(
        update={"preview_hash": approved}
    )
    disposition = process(_processor(recorder.tool()), work_item("h1/op-1", WRITE),
                          FakeLedger(lease))
    envelope = disposition.envelope
    assert envelope is not None
    return ("ok" if envelope.ok else envelope.error.code if envelope.error else "?"), envelope


def test_a_preview_that_fails_again_at_the_run_never_lets_the_call_run() -> None:
    """Before: an approved report of a failed preview (here: no hook at all) matched the
    same failure at the run, and the tool ran with nothing checked."""
    unsupported = PreviewReport(error=ErrorInfo(
        code="PREVIEW_UNSUPPORTED", category=ErrorCategory.INTERNAL,
        message="this tool has no preview",
    ))
    implementation = Tool(name=WRITE, run=lambda a, c: OUT)
    lease = reply(LeaseDecision.EXECUTE, "h1/op-1", WRITE, arguments=ARGS).model_copy(
        update={"preview_hash": unsupported.digest()}
    )
    disposition = process(_processor(implementation), work_item("h1/op-1", WRITE),
                          FakeLedger(lease))
    assert disposition.envelope is not None and disposition.envelope.error is not None
    assert disposition.envelope.error.code == "PREVIEW_FAILED"
    _, failed, _ = _previewed(RuntimeError("boom"))
    assert failed is not None and failed.error is not None
    crashing = Recorder(RuntimeError("boom"))
    code, _ = _execute(crashing, failed.digest())
    assert (code, crashing.runs) == ("PREVIEW_FAILED", 0)


def test_the_approved_effect_runs_and_a_changed_one_does_not() -> None:
    effect = {"recipients": ["customer-0001@acme.example.test", "customer-0002@acme.example.test"]}
    approved = PreviewReport(
        effect=effect, effect_sha256=sha256_hex(canonical_json(effect))
    ).digest()
    same = Recorder(effect)
    assert _execute(same, approved)[0] == "ok"
    assert (same.runs, len(same.previews)) == (1, 1)
    # One recipient fewer than approved (someone unsubscribed since): nothing runs.
    changed = Recorder({"recipients": effect["recipients"][:1]})
    code, envelope = _execute(changed, approved)
    assert (code, changed.runs) == ("PREVIEW_CHANGED", 0)
    assert envelope.error.category is ErrorCategory.CONFLICT and not envelope.outcome_unknown
    # A preview that cannot run now: nothing runs, and trying again later is safe.
    down = Recorder(ToolError(ErrorCategory.TRANSIENT, "PROVIDER_UNAVAILABLE", "down"))
    code, envelope = _execute(down, approved)
    assert (code, down.runs, envelope.error.retryable) == ("PREVIEW_UNAVAILABLE", 0, True)
