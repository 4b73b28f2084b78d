"""The executor's per-item core against a fake lease responder: no NATS involved."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from executors import (
    ExecutorConfigError,
    ExecutorMetrics,
    ItemAction,
    ItemDisposition,
    ItemProcessor,
    LeaseError,
    Precondition,
    ProcessorOptions,
    Reconciliation,
    Tool,
    ToolContext,
    ToolError,
    tool,
)
from schemas import ErrorCategory, ErrorInfo, LeaseDecision, LeaseRequest, ResultEnvelope
from tests.executors.helpers import FakeLedger, Heartbeats, contract, process, reply, work_item

READ = "search_documents"
WRITE = "send_customer_email"
READ_ARGS = {"query": "refund window", "source_types": ["policy"], "top_k": 3}
WRITE_ARGS = {
    "recipient_ids": ["cus-0001"],
    "template": "support_received",
    "variables": {"ticket_id": "TCK-1"},
}
READ_OUT: dict[str, Any] = {"items": [], "truncated": False, "next_cursor": None}
WRITE_OUT: dict[str, Any] = {
    "accepted_count": 1,
    "rejected_recipient_ids": [],
    "provider_message_ids": ["msg-1"],
}


class Calls:
    """Records what a fake tool was called with."""

    def __init__(self) -> None:
        self.run: list[tuple[Mapping[str, Any], ToolContext]] = []
        self.checks = 0
        self.reconciles: list[str] = []


def returning(name: str, output: Any, calls: Calls | None = None) -> Tool:
    """A tool that returns `output`."""

    def run(arguments: Mapping[str, Any], context: ToolContext) -> Any:
        if calls is not None:
            calls.run.append((arguments, context))
        return output

    return Tool(name=name, run=run)


def raising(name: str, error: BaseException) -> Tool:
    """A tool that raises `error`."""

    def run(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        raise error

    return Tool(name=name, run=run)


def sleeping(name: str, seconds: float, output: dict[str, Any]) -> Tool:
    """An async tool that takes `seconds`."""

    async def run(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        await asyncio.sleep(seconds)
        return output

    return Tool(name=name, run=run)


def processor(implementation: Tool, **options: Any) -> ItemProcessor:
    return ItemProcessor(
        implementation, contract(implementation.name), ProcessorOptions("exec-1", **options)
    )


def execute(
    implementation: Tool,
    arguments: Mapping[str, Any],
    *,
    operation_id: str = "op-1",
    fencing_token: int = 3,
    attempt: int = 1,
    timeout_ms: int | None = None,
    **options: Any,
) -> ItemDisposition:
    ledger = FakeLedger(
        reply(
            LeaseDecision.EXECUTE,
            operation_id,
            implementation.name,
            arguments=arguments,
            fencing_token=fencing_token,
            attempt=attempt,
            timeout_ms=timeout_ms,
        )
    )
    return process(
        processor(implementation, **options), work_item(operation_id, implementation.name), ledger
    )


def envelope_of(disposition: ItemDisposition) -> ResultEnvelope:
    assert disposition.action is ItemAction.PUBLISH
    assert disposition.envelope is not None
    return disposition.envelope


def error_of(disposition: ItemDisposition) -> tuple[ErrorCategory, str, bool, bool]:
    """(category, code, retryable, outcome_unknown) of a failure envelope."""
    envelope = envelope_of(disposition)
    assert not envelope.ok
    assert envelope.data is None
    assert envelope.error is not None
    return (
        envelope.error.category,
        envelope.error.code,
        envelope.error.retryable,
        envelope.outcome_unknown,
    )


# ------------------------------------------------------------ lease decisions


def test_done_acks_without_running_anything() -> None:
    calls = Calls()
    ledger = FakeLedger(reply(LeaseDecision.DONE, "op-1", READ))
    result = process(processor(returning(READ, READ_OUT, calls)), work_item("op-1", READ), ledger)
    assert result == ItemDisposition(ItemAction.ACK, "done")
    assert calls.run == []
    assert ledger.requests == [LeaseRequest(operation_id="op-1", executor="exec-1")]


@pytest.mark.parametrize(
    ("expires_in", "expected"),
    [(timedelta(seconds=10), 10.5), (timedelta(seconds=300), 30.0), (timedelta(seconds=-5), 1.0)],
)
def test_busy_naks_until_the_other_lease_runs_out(expires_in: timedelta, expected: float) -> None:
    now = datetime(2026, 7, 1, 12, 0, tzinfo=UTC)
    calls = Calls()
    ledger = FakeLedger(
        reply(
            LeaseDecision.BUSY, "op-1", READ, fencing_token=None, lease_expires_at=now + expires_in
        )
    )
    result = process(
        processor(returning(READ, READ_OUT, calls), clock=lambda: now),
        work_item("op-1", READ),
        ledger,
    )
    assert result.action is ItemAction.NAK
    assert result.reason == "busy"
    assert result.delay_s == pytest.approx(expected)
    assert calls.run == []


@pytest.mark.parametrize(
    ("not_before_in", "expected"),
    [(timedelta(milliseconds=400), 0.45), (timedelta(seconds=12), 12.05),
     (timedelta(seconds=90), 30.0), (timedelta(seconds=-1), 0.05)],
)
def test_busy_until_a_retrys_backoff_naks_exactly_until_then(
    not_before_in: timedelta, expected: float
) -> None:
    """A scheduled retry is put back until its `not_before` (clamped to the busy bound),
    never asked for again sooner; shorter than the busy floor is not rounded up."""
    now = datetime(2026, 7, 1, 12, 0, tzinfo=UTC)
    calls = Calls()
    ledger = FakeLedger(
        reply(LeaseDecision.BUSY, "op-1", READ, fencing_token=None, not_before=now + not_before_in)
    )
    result = process(
        processor(returning(READ, READ_OUT, calls), clock=lambda: now),
        work_item("op-1", READ),
        ledger,
    )
    assert (result.action, result.reason) == (ItemAction.NAK, "busy")
    assert result.delay_s == pytest.approx(expected)
    assert calls.run == []


def test_busy_without_an_expiry_waits_a_default_delay() -> None:
    ledger = FakeLedger(reply(LeaseDecision.BUSY, "op-1", READ))
    result = process(processor(returning(READ, READ_OUT)), work_item("op-1", READ), ledger)
    assert result.action is ItemAction.NAK
    assert result.delay_s is not None
    assert 1.0 <= result.delay_s <= 30.0


def test_execute_publishes_a_complete_envelope() -> None:
    calls = Calls()
    result = execute(
        returning(
            READ,
            {
                **READ_OUT,
                "items": [
                    {"source_id": "d", "revision": "1", "span_id": "s", "text": "t", "score": 0.5}
                ],
            },
            calls,
        ),
        READ_ARGS,
        operation_id="op-42",
        fencing_token=7,
        attempt=2,
    )
    envelope = envelope_of(result)
    assert result.reason == "executed"
    assert envelope.ok
    assert envelope.operation_id == "op-42"
    assert envelope.fencing_token == 7
    assert envelope.data is not None
    assert envelope.data["items"][0]["text"] == "t"
    assert envelope.error is None
    assert not envelope.outcome_unknown
    assert envelope.redactions == ()
    provenance = envelope.provenance
    assert (provenance.tool, provenance.tool_version) == (READ, contract(READ).version)
    assert provenance.executor == "exec-1"
    assert provenance.attempt == 2
    assert provenance.trust == "untrusted"
    assert provenance.latency_ms >= 0
    assert abs((datetime.now(UTC) - provenance.completed_at).total_seconds()) < 60
    assert len(calls.run) == 1
    arguments, context = calls.run[0]
    assert dict(arguments) == READ_ARGS
    assert (context.tool, context.executor) == (READ, "exec-1")


def test_the_idempotency_key_is_the_operation_id_on_every_attempt() -> None:
    calls = Calls()
    implementation = returning(WRITE, WRITE_OUT, calls)
    execute(implementation, WRITE_ARGS, operation_id="op-7", attempt=1, fencing_token=1)
    execute(implementation, WRITE_ARGS, operation_id="op-7", attempt=2, fencing_token=2)
    keys = [context.idempotency_key for _, context in calls.run]
    assert keys == ["op-7", "op-7"]
    assert [context.attempt for _, context in calls.run] == [1, 2]
    assert [context.fencing_token for _, context in calls.run] == [1, 2]


def test_the_context_carries_the_deadline_and_only_this_executors_secrets() -> None:
    calls = Calls()
    before = datetime.now(UTC)
    execute(
        returning(READ, READ_OUT, calls), READ_ARGS, timeout_ms=1500, secrets={"API_KEY": "x" * 12}
    )
    _, context = calls.run[0]
    assert timedelta(seconds=1) < context.deadline - before < timedelta(seconds=3)
    assert dict(context.secrets) == {"api_key": "x" * 12}
    assert context.secret("API_KEY") == "x" * 12
    with pytest.raises(KeyError, match="'other' is not configured"):
        context.secret("other")
    with pytest.raises(TypeError):
        context.secrets["other"] = "y"  # type: ignore[index]


# ------------------------------------------------------------- preconditions


def test_a_stale_target_is_a_conflict_and_nothing_runs() -> None:
    calls = Calls()
    implementation = returning(WRITE, WRITE_OUT, calls)
    implementation.check_preconditions = lambda a, c: Precondition.stale(
        "invoice changed after approval", code="INVOICE_CHANGED"
    )
    result = execute(implementation, WRITE_ARGS)
    assert error_of(result) == (ErrorCategory.CONFLICT, "INVOICE_CHANGED", False, False)
    assert envelope_of(result).error.message == "invoice changed after approval"  # type: ignore[union-attr]
    assert calls.run == []


def test_an_already_applied_effect_is_reported_as_success_without_running() -> None:
    calls = Calls()
    implementation = returning(WRITE, WRITE_OUT, calls)
    earlier = {**WRITE_OUT, "provider_message_ids": ["msg-first"]}
    implementation.check_preconditions = lambda a, c: Precondition.already_applied(earlier)
    result = execute(implementation, WRITE_ARGS)
    envelope = envelope_of(result)
    assert envelope.ok
    assert envelope.data == earlier
    assert result.reason == "already_applied"
    assert calls.run == []


def test_a_precondition_tool_error_is_a_known_failure() -> None:
    implementation = returning(WRITE, WRITE_OUT)

    def check(arguments: Mapping[str, Any], context: ToolContext) -> Precondition:
        raise ToolError(
            ErrorCategory.NOT_FOUND, "RECIPIENT_NOT_FOUND", "gone", outcome_unknown=True
        )

    implementation.check_preconditions = check
    # A check only reads: even a claimed "unknown" cannot mean an effect happened.
    assert error_of(execute(implementation, WRITE_ARGS)) == (
        ErrorCategory.NOT_FOUND,
        "RECIPIENT_NOT_FOUND",
        False,
        False,
    )


def test_a_precondition_returning_garbage_is_internal() -> None:
    implementation = returning(WRITE, WRITE_OUT)
    implementation.check_preconditions = lambda a, c: True  # type: ignore[assignment,return-value]
    assert error_of(execute(implementation, WRITE_ARGS))[:2] == (
        ErrorCategory.INTERNAL,
        "PRECONDITION_CHECK_FAILED",
    )


def test_async_preconditions_are_awaited() -> None:
    implementation = returning(WRITE, WRITE_OUT)

    async def check(arguments: Mapping[str, Any], context: ToolContext) -> Precondition:
        await asyncio.sleep(0)
        return Precondition.stale("changed")

    implementation.check_preconditions = check
    assert error_of(execute(implementation, WRITE_ARGS))[:2] == (
        ErrorCategory.CONFLICT,
        "PRECONDITION_STALE",
    )


# ------------------------------------------------------------------ failures


def test_a_tool_error_keeps_its_category_and_code() -> None:
    error = ToolError(
        ErrorCategory.TRANSIENT,
        "UPSTREAM_RATE_LIMITED",
        "slow down",
        retry_after_ms=1500,
        safe_details={"limit": 30},
    )
    result = execute(raising(READ, error), READ_ARGS)
    assert error_of(result) == (ErrorCategory.TRANSIENT, "UPSTREAM_RATE_LIMITED", True, False)
    info = envelope_of(result).error
    assert info is not None
    assert info.retry_after_ms == 1500
    assert info.safe_details == {"limit": 30}


def test_the_contract_decides_what_a_declared_code_means() -> None:
    # The contract declares RECIPIENT_NOT_FOUND as NOT_FOUND; the tool's claim loses.
    error = ToolError(ErrorCategory.TRANSIENT, "RECIPIENT_NOT_FOUND", "no such customer")
    assert error_of(execute(raising(WRITE, error), WRITE_ARGS))[:2] == (
        ErrorCategory.NOT_FOUND,
        "RECIPIENT_NOT_FOUND",
    )


def test_a_write_that_may_have_happened_is_unknown() -> None:
    error = ToolError(
        ErrorCategory.TRANSIENT, "PROVIDER_UNAVAILABLE", "no answer", outcome_unknown=True
    )
    assert error_of(execute(raising(WRITE, error), WRITE_ARGS)) == (
        ErrorCategory.TRANSIENT,
        "PROVIDER_UNAVAILABLE",
        True,
        True,
    )


def test_a_crash_is_internal_and_never_leaks_the_exception_text() -> None:
    crash = RuntimeError("password=hunter2 at /srv/secret/path")
    read = execute(raising(READ, crash), READ_ARGS)
    write = execute(raising(WRITE, crash), WRITE_ARGS)
    assert error_of(read) == (ErrorCategory.INTERNAL, "TOOL_CRASHED", False, False)
    # A crashed write may have sent before it broke.
    assert error_of(write) == (ErrorCategory.INTERNAL, "TOOL_CRASHED", False, True)
    for result in (read, write):
        text = envelope_of(result).model_dump_json()
        assert "hunter2" not in text
        assert "/srv/secret" not in text
        assert "RuntimeError" not in text


def test_a_timed_out_write_is_unknown_and_a_timed_out_read_is_retryable() -> None:
    started = time.monotonic()
    write = execute(sleeping(WRITE, 5, WRITE_OUT), WRITE_ARGS, timeout_ms=100)
    read = execute(sleeping(READ, 5, READ_OUT), READ_ARGS, timeout_ms=100)
    assert time.monotonic() - started < 3
    assert error_of(write) == (ErrorCategory.TRANSIENT, "EXECUTION_TIMEOUT", False, True)
    assert error_of(read) == (ErrorCategory.TRANSIENT, "EXECUTION_TIMEOUT", True, False)


def test_a_blocking_plain_tool_times_out_and_does_not_hold_the_process() -> None:
    def blocking(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        time.sleep(3)
        return WRITE_OUT

    started = time.monotonic()
    # `process` runs its own event loop: it returns only once no worker thread is joined.
    result = execute(Tool(name=WRITE, run=blocking), WRITE_ARGS, timeout_ms=100)
    assert time.monotonic() - started < 2
    assert error_of(result) == (ErrorCategory.TRANSIENT, "EXECUTION_TIMEOUT", False, True)


def test_the_contract_timeout_applies_without_one_in_the_lease() -> None:
    # search_documents' contract allows 2000 ms.
    started = time.monotonic()
    result = execute(sleeping(READ, 10, READ_OUT), READ_ARGS, timeout_ms=None)
    elapsed = time.monotonic() - started
    assert error_of(result)[1] == "EXECUTION_TIMEOUT"
    assert 1.5 < elapsed < 6


def test_leased_arguments_that_break_the_input_schema_are_not_run() -> None:
    calls = Calls()
    result = execute(returning(READ, READ_OUT, calls), {"query": "x", "top_k": "ten"})
    category, code, retryable, unknown = error_of(result)
    assert (category, code, retryable, unknown) == (
        ErrorCategory.INVALID_INPUT,
        "ARGUMENTS_INVALID",
        False,
        False,
    )
    issues = envelope_of(result).error.safe_details["issues"]  # type: ignore[union-attr]
    assert {issue["path"] for issue in issues} >= {"/top_k"}
    assert calls.run == []


# ------------------------------------------------------------------- output


def test_output_breaking_the_schema_fails_a_read_and_is_unknown_for_a_write() -> None:
    read = execute(returning(READ, {"items": "nope"}), READ_ARGS)
    write = execute(returning(WRITE, {"accepted_count": -1}), WRITE_ARGS)
    assert error_of(read) == (ErrorCategory.INTERNAL, "OUTPUT_CONTRACT_VIOLATION", False, False)
    assert error_of(write) == (ErrorCategory.INTERNAL, "OUTPUT_CONTRACT_VIOLATION", False, True)


@pytest.mark.parametrize("output", [None, ["a"], "text", {"items": [], "when": object()}])
def test_output_that_is_not_a_json_object_is_refused(output: Any) -> None:
    assert error_of(execute(returning(READ, output), READ_ARGS))[1] == "OUTPUT_CONTRACT_VIOLATION"


@pytest.mark.parametrize("count", [2**53, 2**60], ids=["2**53", "2**60"])
def test_output_no_hash_can_bind_is_refused_before_it_is_published(count: int) -> None:
    """The schema allows any non-negative integer, and orjson writes integers up to
    64 bits; the ledger's canonical hash (RFC 8785) takes none beyond 2**53 - 1.
    Refused as the inputs are, so the ledger never gets an envelope it cannot
    record; the write's outcome is unknown (it may have happened)."""
    output = {"accepted_count": count, "rejected_recipient_ids": [], "provider_message_ids": []}
    write = execute(returning(WRITE, output), WRITE_ARGS)
    assert error_of(write) == (ErrorCategory.INTERNAL, "OUTPUT_CONTRACT_VIOLATION", False, True)
    issues = envelope_of(write).error.safe_details["issues"]  # type: ignore[union-attr]
    assert [(i["path"], i["code"]) for i in issues] == [("/accepted_count", "number_out_of_range")]
    fine = dict(output, accepted_count=2**53 - 1)
    assert envelope_of(execute(returning(WRITE, fine), WRITE_ARGS)).ok


def test_output_is_redacted_and_the_pointers_reported() -> None:
    item = {
        "source_id": "d",
        "revision": "1",
        "span_id": "s",
        "text": "use Authorization: Bearer abcdefghijklmnopqrstuvwxyz0123<script>x()</script>",
        "score": 0.9,
    }
    envelope = envelope_of(execute(returning(READ, {**READ_OUT, "items": [item]}), READ_ARGS))
    assert envelope.ok
    assert envelope.data is not None
    text = envelope.data["items"][0]["text"]
    assert "abcdefghijklmnop" not in text
    assert "<script>" not in text
    assert envelope.redactions == ("/data/items/0/text",)


def test_the_executors_own_secrets_never_leave_in_a_result() -> None:
    secret = "sqlite:///var/lib/mail/provider-7f3a.db"
    item = {"source_id": "d", "revision": "1", "span_id": "s", "text": f"db {secret}", "score": 0.1}
    envelope = envelope_of(
        execute(returning(READ, {**READ_OUT, "items": [item]}), READ_ARGS, secrets={"db": secret})
    )
    assert secret not in envelope.model_dump_json()
    assert envelope.redactions == ("/data/items/0/text",)


def test_error_messages_and_details_are_redacted_too() -> None:
    error = ToolError(
        ErrorCategory.TRANSIENT,
        "UPSTREAM_TIMEOUT",
        'Traceback (most recent call last):\n  File "x.py", line 1\nboom',
        safe_details={"upstream": "https://user:pw@search.internal/q", "token": "abc"},
    )
    envelope = envelope_of(execute(raising(READ, error), READ_ARGS))
    assert envelope.error is not None
    assert envelope.error.message == "[REDACTED:stack_trace]"
    assert "pw@" not in envelope.model_dump_json()
    assert set(envelope.redactions) == {
        "/error/message",
        "/error/safe_details/upstream",
        "/error/safe_details/token",
    }


def test_a_result_too_large_to_deliver_is_not_published_as_success() -> None:
    items = [
        {"source_id": "d", "revision": "1", "span_id": f"s{n}", "text": "x" * 1900, "score": 0.1}
        for n in range(20)
    ]
    result = execute(
        returning(READ, {**READ_OUT, "items": items}), READ_ARGS, max_result_bytes=10_000
    )
    assert error_of(result) == (ErrorCategory.INTERNAL, "RESULT_TOO_LARGE", False, False)


def test_failed_postconditions_make_a_write_unknown() -> None:
    implementation = returning(WRITE, WRITE_OUT)
    seen: list[Mapping[str, Any]] = []

    def post(
        arguments: Mapping[str, Any], output: Mapping[str, Any], context: ToolContext
    ) -> Sequence[str]:
        seen.append(output)
        return ["the message was sent to another recipient"]

    implementation.check_postconditions = post
    assert error_of(execute(implementation, WRITE_ARGS)) == (
        ErrorCategory.INTERNAL,
        "POSTCONDITION_FAILED",
        False,
        True,
    )
    assert seen == [WRITE_OUT]


def test_passing_postconditions_let_the_result_through() -> None:
    implementation = returning(WRITE, WRITE_OUT)
    implementation.check_postconditions = lambda a, o, c: []
    assert envelope_of(execute(implementation, WRITE_ARGS)).ok


# ---------------------------------------------------------------- reconcile


def reconcile(
    implementation: Tool, *, delivery: int = 1, fencing_token: int = 4
) -> ItemDisposition:
    ledger = FakeLedger(
        reply(
            LeaseDecision.RECONCILE,
            "op-9",
            implementation.name,
            fencing_token=fencing_token,
            attempt=2,
        )
    )
    return process(
        processor(implementation), work_item("op-9", implementation.name), ledger, delivery=delivery
    )


def with_reconcile(
    name: str, answer: Reconciliation | Exception, calls: Calls | None = None
) -> Tool:
    calls = calls or Calls()
    implementation = returning(name, WRITE_OUT, calls)

    def look(operation_id: str, context: ToolContext) -> Reconciliation:
        calls.reconciles.append(operation_id)
        if isinstance(answer, Exception):
            raise answer
        return answer

    implementation.reconcile = look
    return implementation


def test_reconcile_applied_reports_what_the_provider_saw() -> None:
    calls = Calls()
    result = reconcile(with_reconcile(WRITE, Reconciliation.applied(WRITE_OUT), calls))
    envelope = envelope_of(result)
    assert envelope.ok
    assert envelope.data == WRITE_OUT
    assert envelope.fencing_token == 4
    assert result.reason == "reconciled"
    assert calls.reconciles == ["op-9"]
    assert calls.run == []


def test_reconcile_not_applied_is_a_retryable_failure() -> None:
    result = reconcile(with_reconcile(WRITE, Reconciliation.not_applied()))
    assert error_of(result) == (ErrorCategory.TRANSIENT, "NOT_APPLIED", True, False)


def test_reconcile_unknown_stays_unknown() -> None:
    result = reconcile(with_reconcile(WRITE, Reconciliation.unknown("provider has no lookup")))
    assert error_of(result)[3] is True


def test_reconcile_with_applied_but_invalid_data_stays_unknown() -> None:
    result = reconcile(with_reconcile(WRITE, Reconciliation.applied({"bogus": 1})))
    assert error_of(result) == (ErrorCategory.INTERNAL, "OUTPUT_CONTRACT_VIOLATION", False, True)


def test_a_write_without_reconcile_is_unknown_and_a_read_is_not_applied() -> None:
    write = reconcile(returning(WRITE, WRITE_OUT))
    read = reconcile(returning(READ, READ_OUT))
    assert error_of(write) == (ErrorCategory.INTERNAL, "RECONCILE_UNSUPPORTED", False, True)
    assert error_of(read) == (ErrorCategory.TRANSIENT, "NOT_APPLIED", True, False)


def test_a_failing_lookup_is_tried_again_then_handed_to_a_human() -> None:
    implementation = with_reconcile(WRITE, ConnectionError("provider down"))
    early = reconcile(implementation, delivery=1)
    assert early.action is ItemAction.NAK
    assert early.reason == "reconcile_failed"
    late = reconcile(implementation, delivery=5)
    assert error_of(late) == (ErrorCategory.TRANSIENT, "RECONCILE_FAILED", False, True)


# ----------------------------------------------------------- broken items


def test_a_malformed_item_is_terminated_without_a_lease() -> None:
    ledger = FakeLedger(reply(LeaseDecision.EXECUTE, "op-1", READ, arguments=READ_ARGS))
    for payload in (b"not json", b'{"operation_id": "op 1", "tool": "x"}'):
        assert (
            process(processor(returning(READ, READ_OUT)), payload, ledger).action is ItemAction.TERM
        )
    assert ledger.requests == []


def test_an_item_of_another_tool_is_terminated() -> None:
    ledger = FakeLedger(reply(LeaseDecision.EXECUTE, "op-1", READ, arguments=READ_ARGS))
    result = process(processor(returning(READ, READ_OUT)), work_item("op-1", WRITE), ledger)
    assert result == ItemDisposition(ItemAction.TERM, "wrong_tool")
    assert ledger.requests == []


def test_an_item_of_another_contract_version_is_left_for_its_executor() -> None:
    ledger = FakeLedger(reply(LeaseDecision.EXECUTE, "op-1", READ, arguments=READ_ARGS))
    result = process(
        processor(returning(READ, READ_OUT)), work_item("op-1", READ, version="9.9.9"), ledger
    )
    assert result.action is ItemAction.NAK
    assert result.reason == "version_mismatch"
    assert ledger.requests == []


def test_no_lease_answer_naks_and_runs_nothing() -> None:
    calls = Calls()

    async def silent(request: LeaseRequest) -> Any:
        raise TimeoutError

    result = asyncio.run(
        processor(returning(READ, READ_OUT, calls)).process(
            work_item("op-1", READ), lease=silent, heartbeat=Heartbeats()
        )
    )
    assert (result.action, result.reason) == (ItemAction.NAK, "lease_unavailable")
    assert calls.run == []


@pytest.mark.parametrize(
    ("category", "delivery", "expected"),
    [
        (ErrorCategory.NOT_FOUND, 1, (ItemAction.NAK, "lease_error")),
        (ErrorCategory.NOT_FOUND, 5, (ItemAction.TERM, "lease_refused")),
        (ErrorCategory.TRANSIENT, 50, (ItemAction.NAK, "lease_error")),
    ],
)
def test_a_lease_error_is_retried_then_given_up_unless_transient(
    category: ErrorCategory, delivery: int, expected: tuple[ItemAction, str]
) -> None:
    calls = Calls()

    async def erroring(request: LeaseRequest) -> Any:
        raise LeaseError(ErrorInfo(code="OPERATION_NOT_FOUND", category=category, message="x"))

    result = asyncio.run(
        processor(returning(READ, READ_OUT, calls)).process(
            work_item("op-1", READ), lease=erroring, heartbeat=Heartbeats(), delivery=delivery
        )
    )
    assert (result.action, result.reason) == expected
    assert calls.run == []


def test_a_lease_for_another_operation_is_not_used() -> None:
    calls = Calls()
    ledger = FakeLedger(reply(LeaseDecision.EXECUTE, "op-2", READ, arguments=READ_ARGS))
    result = process(processor(returning(READ, READ_OUT, calls)), work_item("op-1", READ), ledger)
    assert (result.action, result.reason) == (ItemAction.NAK, "lease_invalid")
    assert calls.run == []


def test_a_lease_without_a_fencing_token_is_not_used() -> None:
    calls = Calls()
    ledger = FakeLedger(
        reply(LeaseDecision.EXECUTE, "op-1", READ, arguments=READ_ARGS, fencing_token=None)
    )
    result = process(processor(returning(READ, READ_OUT, calls)), work_item("op-1", READ), ledger)
    assert (result.action, result.reason) == (ItemAction.NAK, "lease_invalid")
    assert calls.run == []


def test_a_lease_for_another_version_fails_without_running() -> None:
    calls = Calls()
    ledger = FakeLedger(
        reply(LeaseDecision.EXECUTE, "op-1", READ, arguments=READ_ARGS, version="0.0.1")
    )
    result = process(processor(returning(READ, READ_OUT, calls)), work_item("op-1", READ), ledger)
    assert error_of(result)[:2] == (ErrorCategory.INTERNAL, "LEASE_MISMATCH")
    assert calls.run == []


# --------------------------------------------------- heartbeat and metrics


def test_long_work_sends_in_progress_acks() -> None:
    beats = Heartbeats()
    ledger = FakeLedger(
        reply(LeaseDecision.EXECUTE, "op-1", READ, arguments=READ_ARGS, timeout_ms=5000)
    )
    result = process(
        processor(sleeping(READ, 0.35, READ_OUT), heartbeat_interval_s=0.1),
        work_item("op-1", READ),
        ledger,
        heartbeat=beats,
    )
    assert envelope_of(result).ok
    assert beats.count >= 2


def test_a_failing_heartbeat_does_not_fail_the_item() -> None:
    async def broken() -> None:
        raise ConnectionError

    ledger = FakeLedger(reply(LeaseDecision.EXECUTE, "op-1", READ, arguments=READ_ARGS))
    result = asyncio.run(
        processor(sleeping(READ, 0.25, READ_OUT), heartbeat_interval_s=0.05).process(
            work_item("op-1", READ), lease=ledger, heartbeat=broken
        )
    )
    assert envelope_of(result).ok


def test_in_progress_acks_go_on_after_one_fails() -> None:
    """A failed ack is logged and the next one comes an interval later: were the acks to
    stop, long work would be redelivered to a second executor."""
    calls: list[float] = []

    async def first_fails() -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise ConnectionError

    ledger = FakeLedger(
        reply(LeaseDecision.EXECUTE, "op-1", READ, arguments=READ_ARGS, timeout_ms=5000)
    )
    result = asyncio.run(
        processor(sleeping(READ, 0.3, READ_OUT), heartbeat_interval_s=0.05).process(
            work_item("op-1", READ), lease=ledger, heartbeat=first_fails
        )
    )
    assert envelope_of(result).ok
    assert len(calls) >= 3


def test_a_slow_in_progress_ack_is_never_overlapped_nor_outlives_the_item() -> None:
    """One ack at a time, the next an interval after the last one ended; an ack under
    way when the item is done is cancelled, and none starts after it."""
    spans: list[list[float]] = []

    async def slow() -> None:
        spans.append([time.monotonic()])
        try:
            await asyncio.sleep(0.08)  # longer than the interval
        finally:
            spans[-1].append(time.monotonic())

    async def run() -> tuple[Any, int]:
        ledger = FakeLedger(
            reply(LeaseDecision.EXECUTE, "op-1", READ, arguments=READ_ARGS, timeout_ms=5000)
        )
        disposition = await processor(
            sleeping(READ, 0.4, READ_OUT), heartbeat_interval_s=0.05
        ).process(work_item("op-1", READ), lease=ledger, heartbeat=slow)
        started = len(spans)
        await asyncio.sleep(0.3)
        return disposition, started

    result, started = asyncio.run(run())
    assert envelope_of(result).ok
    assert started >= 2 and len(spans) == started  # none began after the item was done
    assert all(len(span) == 2 for span in spans)  # each ended, the last one cancelled
    for earlier, later in itertools.pairwise(spans):
        assert later[0] >= earlier[1]  # never two at once


def test_an_executor_stopping_while_an_ack_ends_is_not_swallowed() -> None:
    """Found in review: stopping the acks awaited the cancelled ack under
    `suppress(CancelledError)`, which also swallowed a cancel of the item's own task
    arriving meanwhile (the executor stopping): the item ran on as if not cancelled."""

    async def run() -> bool:
        ending = asyncio.Event()

        async def stubborn() -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                ending.set()
                await asyncio.sleep(0.2)  # takes its time to end
                raise

        ledger = FakeLedger(
            reply(LeaseDecision.EXECUTE, "op-1", READ, arguments=READ_ARGS, timeout_ms=5000)
        )
        item = asyncio.create_task(
            processor(sleeping(READ, 0.08, READ_OUT), heartbeat_interval_s=0.05).process(
                work_item("op-1", READ), lease=ledger, heartbeat=stubborn
            )
        )
        await ending.wait()  # the item is done; its acks are being stopped
        item.cancel()
        try:
            await item
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(run())


def test_metrics_count_outcomes_without_operation_labels() -> None:
    metrics = ExecutorMetrics()
    implementation = returning(READ, READ_OUT)
    execute(implementation, READ_ARGS, operation_id="op-a", metrics=metrics)
    execute(
        raising(READ, ToolError(ErrorCategory.TRANSIENT, "UPSTREAM_TIMEOUT", "x")),
        READ_ARGS,
        metrics=metrics,
    )
    ledger = FakeLedger(reply(LeaseDecision.BUSY, "op-b", READ))
    process(processor(implementation, metrics=metrics), work_item("op-b", READ), ledger, delivery=2)
    registry = metrics.registry
    assert (
        registry.get_sample_value("tool_executions_total", {"tool": READ, "outcome": "succeeded"})
        == 1
    )
    assert (
        registry.get_sample_value("tool_executions_total", {"tool": READ, "outcome": "failed"}) == 1
    )
    assert registry.get_sample_value("tool_execution_retries_total", {"reason": "busy"}) == 1
    assert registry.get_sample_value("tool_execution_retries_total", {"reason": "redelivered"}) == 1
    assert registry.get_sample_value("tool_execution_duration_seconds_count", {"tool": READ}) == 2
    labels = {
        value
        for family in registry.collect()
        for sample in family.samples
        for value in sample.labels.values()
    }
    assert not {value for value in labels if value.startswith("op-")}


def test_unknown_outcomes_are_counted() -> None:
    metrics = ExecutorMetrics()
    execute(sleeping(WRITE, 5, WRITE_OUT), WRITE_ARGS, timeout_ms=50, metrics=metrics)
    assert metrics.registry.get_sample_value("tool_operations_unknown_total", {"tool": WRITE}) == 1
    assert (
        metrics.registry.get_sample_value(
            "tool_executions_total", {"tool": WRITE, "outcome": "unknown"}
        )
        == 1
    )


# ----------------------------------------------------------- configuration


def test_an_executor_runs_only_its_own_tool_and_pinned_version() -> None:
    with pytest.raises(ExecutorConfigError, match="cannot run"):
        ItemProcessor(returning(READ, READ_OUT), contract(WRITE), ProcessorOptions("e"))
    pinned = Tool(name=READ, run=lambda a, c: READ_OUT, version="1.0.0")
    with pytest.raises(ExecutorConfigError, match="implements version"):
        ItemProcessor(pinned, contract(READ), ProcessorOptions("e"))


def test_the_decorator_builds_a_tool() -> None:
    @tool("search_documents", version="2.1.0", required_secrets=("API_KEY",))
    def search(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        return READ_OUT

    @search.precondition
    def check(arguments: Mapping[str, Any], context: ToolContext) -> Precondition:
        return Precondition.ok()

    @search.reconciler
    def look(operation_id: str, context: ToolContext) -> Reconciliation:
        return Reconciliation.not_applied()

    assert isinstance(search, Tool)
    assert search.check_preconditions is check
    assert search.reconcile is look
    assert search.required_secrets == ("api_key",)
    with pytest.raises(ExecutorConfigError, match="api_key"):
        ItemProcessor(search, contract(READ), ProcessorOptions("e"))
    assert ItemProcessor(search, contract(READ), ProcessorOptions("e", secrets={"api_key": "k"}))


_SET_BY_A_HOOK: contextvars.ContextVar[str] = contextvars.ContextVar("set_by_a_hook", default="")


def test_what_a_hook_sets_in_its_context_stays_its_own() -> None:
    """Each hook runs in a task of its own, as `run` does: a context variable (or an
    OpenTelemetry context left attached) that a precondition sets is not the run's, nor
    the rest of the item's, whose result carries trace headers from its context. Found in
    review, when hooks stopped running under `wait_for` (which made them a task)."""
    seen: list[str] = []

    async def run(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        seen.append(_SET_BY_A_HOOK.get())
        return READ_OUT

    checked = Tool(name=READ, run=run)

    @checked.precondition
    async def _check(arguments: Mapping[str, Any], context: ToolContext) -> Precondition:
        _SET_BY_A_HOOK.set("the precondition's")
        return Precondition.ok()

    lease = reply(LeaseDecision.EXECUTE, "op-1", READ, arguments=READ_ARGS, fencing_token=4)
    process(ItemProcessor(checked, contract(READ), ProcessorOptions("exec-1")),
            work_item("op-1", READ), FakeLedger(lease))
    assert seen == [""]
