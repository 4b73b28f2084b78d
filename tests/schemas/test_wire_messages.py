"""Real messages, made by the project's own code, validate against the published schemas.

A host or executor in another language trusts `schemas/json/`; these tests make
sure that what the ledger, the relay and the executor really put on the wire is
what those files say. The ledger service's own request handlers answer (the
bytes they return are the bytes a requester receives), the relay's own builder
makes the feed events, work items and outcome notices, the executor's own core
runs a sample tool and makes its result; requests are written as a host in
another language would write them, as plain JSON.

Every message is checked with a Draft 2020-12 validator over the published file,
`format` asserted: a `date-time` must be RFC 3339 with its offset.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from jsonschema import Draft202012Validator, FormatChecker

from executors import ItemProcessor, LeaseError, ProcessorOptions
from executors.samples.documents import search_documents
from ledger import Ledger, StorageConfig
from ledger.domain.states import TERMINAL_STATES, OperationState
from ledger.domain.values import OutcomeStatus
from ledger.server.app import LedgerService, ServiceOptions, relay_ports
from ledger.server.gateway import LedgerGateway
from ledger.server.relay import messages_for, plan_route
from schemas import (
    CANCELLED_BEFORE_EFFECT,
    RECONCILE_UNSUPPORTED,
    SCHEMA_DIR,
    WIRE_MODELS,
    ApproverRequest,
    ErrorCategory,
    ErrorInfo,
    FeedEvent,
    LeaseDecision,
    LeaseReply,
    LeaseRequest,
    OperationStatus,
    PreviewReport,
    Provenance,
    ResultEnvelope,
)
from schemas._base import WireModel
from tests.ledger.helpers import make_ledger

pytestmark = pytest.mark.anyio

HOST = "h1"
EMAIL = "send_customer_email"
APPROVER = "bob"
OPERATOR = "ops1"
ALICE: dict[str, Any] = {
    "principal": "alice",
    "tenant": "acme",
    "capabilities": ["documents:search", "orders:read", "email:send"],
    "environment": "production",
}
EMAIL_ARGUMENTS: dict[str, Any] = {
    "recipient_ids": ["cus-0001"],
    "template": "support_received",
    "variables": {"ticket_id": "TCK-42"},
}
EMAIL_OUTPUT: dict[str, Any] = {
    "accepted_count": 1,
    "rejected_recipient_ids": [],
    "provider_message_ids": ["msg-1"],
}
_DATE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:\d{2})$")

FORMATS = FormatChecker()
"""jsonschema's own `date-time` check needs a package opledger does not install."""


@FORMATS.checks("date-time")
def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if _DATE_TIME.match(value) is None:
        return False
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def validator(name: str) -> Draft202012Validator:
    """A validator over the published schema `name`, asserting formats."""
    schema = orjson.loads((SCHEMA_DIR / f"{name}.schema.json").read_bytes())
    return Draft202012Validator(schema, format_checker=FORMATS)


def problems(name: str, instance: Any) -> list[str]:
    """What the published schema `name` finds wrong with `instance`."""
    return [
        f"{'/'.join(str(p) for p in error.absolute_path)}: {error.message}"
        for error in validator(name).iter_errors(instance)
    ]


@dataclass
class Wire:
    """Every message seen, by the schema it must match."""

    messages: list[tuple[str, bytes]] = field(default_factory=list)

    def saw(self, name: str, payload: bytes | str) -> Any:
        data = payload.encode() if isinstance(payload, str) else payload
        self.messages.append((name, data))
        return orjson.loads(data)

    def of(self, name: str) -> list[Any]:
        return [orjson.loads(data) for seen, data in self.messages if seen == name]


class Clock:
    """The ledger's clock: now, or later (approvals expire, lookups fall due)."""

    def __init__(self) -> None:
        self.skew = timedelta(0)

    def __call__(self) -> datetime:
        return datetime.now(UTC) + self.skew


class Stack:
    """The ledger service's request handlers over one ledger, without NATS."""

    def __init__(self, ledger: Ledger, wire: Wire, clock: Clock) -> None:
        self.ledger = ledger
        self.wire = wire
        self.clock = clock
        self.service = LedgerService(
            ledger,
            ServiceOptions(
                nats_url="nats://127.0.0.1:1",
                approver_roles={APPROVER: frozenset({"support_lead"})},
            ),
        )
        self.gateway = LedgerGateway(ledger)
        self.service.gateway = self.gateway
        self.relayed = 0
        self.work: list[bytes] = []

    # Requests are plain JSON, as a host in another language writes them.

    async def propose(self, operation_id: str, tool: str, arguments: Any) -> Any:
        envelope = {
            "proposal": {
                "proposal_id": f"p-{operation_id}",
                "conversation_id": "c-1",
                "requested_by_user_id": "alice",
                "tool_name": tool,
                "arguments": arguments,
                "prompt_release": "support-agent-4.1.0",
                "model_snapshot": "model-2026-01",
                "created_at": "2026-11-29T10:00:00.402810Z",
                "operation_id": operation_id,
            },
            "context": ALICE,
        }
        return await self.propose_raw(
            orjson.dumps(self.wire.saw("proposal-envelope", orjson.dumps(envelope)))
        )

    async def propose_raw(self, body: bytes) -> Any:
        return self.wire.saw("propose-reply", await self.service._on_propose(body, HOST))

    async def status(self, operation_id: str) -> Any:
        body = orjson.dumps(
            self.wire.saw("status-request", orjson.dumps({"operation_id": operation_id}))
        )
        return self._status_or_error(await self.service._on_status(body, HOST))

    async def cancel(self, operation_id: str) -> Any:
        request = {"operation_id": operation_id, "reason": "the user changed their mind"}
        body = orjson.dumps(self.wire.saw("cancel-request", orjson.dumps(request)))
        return self._status_or_error(await self.service._on_cancel(body, HOST))

    async def tools(self, request: dict[str, Any]) -> Any:
        body = orjson.dumps(self.wire.saw("tools-request", orjson.dumps(request)))
        answer = await self.service._on_tools(body, HOST)
        return self.wire.saw("tools-reply" if b'"tools"' in answer else "error-envelope", answer)

    async def operate(self, request: dict[str, Any]) -> Any:
        body = orjson.dumps(self.wire.saw("operator-request", orjson.dumps(request)))
        return self._status_or_error(await self.service._on_operate(body, OPERATOR))

    async def decide(self, request: dict[str, Any]) -> Any:
        body = orjson.dumps(self.wire.saw("approver-request", orjson.dumps(request)))
        return self._status_or_error(await self.service._on_approve(body, APPROVER))

    async def plan(self, request: dict[str, Any]) -> Any:
        body = orjson.dumps(self.wire.saw("plan-request", orjson.dumps(request)))
        answer = await self.service._on_plan(body, HOST)
        return self.wire.saw("plan-status" if b'"final"' in answer else "error-envelope", answer)

    async def decide_plan(self, request: dict[str, Any]) -> Any:
        body = orjson.dumps(self.wire.saw("approver-request", orjson.dumps(request)))
        answer = await self.service._on_approve(body, APPROVER)
        return self.wire.saw("plan-status" if b'"final"' in answer else "error-envelope", answer)

    async def lease(self, request: dict[str, Any], tool: str) -> Any:
        body = orjson.dumps(self.wire.saw("lease-request", orjson.dumps(request)))
        answer = await self.service._lease(body, tool)
        kind = "lease-reply" if b'"decision"' in answer else "error-envelope"
        return self.wire.saw(kind, answer)

    async def lease_for(self, request: LeaseRequest) -> LeaseReply:
        """The executor's `LeaseFn`: its request, answered by the service's handler."""
        answer = await self.lease(orjson.loads(request.model_dump_json()), "search_documents")
        if "decision" not in answer:
            raise LeaseError(ErrorInfo.model_validate(answer["error"]))
        return LeaseReply.model_validate(answer)

    async def result(self, envelope: ResultEnvelope) -> None:
        """An executor's result, as published (`model_dump_json`) and then recorded."""
        self.wire.saw("result-envelope", envelope.model_dump_json())
        [disposition] = await self.gateway.record_many([envelope])
        assert not isinstance(disposition, BaseException), disposition

    def _status_or_error(self, answer: bytes) -> Any:
        return self.wire.saw(
            "operation-status" if b'"final"' in answer else "error-envelope", answer
        )

    def relay(self) -> None:
        """What the relay publishes for the events stored since it last looked."""
        ports = relay_ports(self.ledger)
        ports.refresh()
        rows = ports.rows_after(self.relayed, 10_000)
        routes = ports.routes({row[1] for row in rows})

        def final_status(operation_id: str, version: int, host: str, final: bool) -> Any:
            return ports.status(operation_id, version, host)

        for row in rows:
            for message in messages_for(
                row,
                routes[row[1]] if row[1] in routes else plan_route(row[1]),
                limit=1024 * 1024,
                sensitive=ports.sensitive_arguments,
                final_status=final_status,
            ):
                if message.feed:
                    self.wire.saw("feed-event", message.payload)
                elif message.subject.startswith("ops.exec."):
                    self.wire.saw("work-item", message.payload)
                    self.work.append(message.payload)
                else:
                    assert message.subject.startswith("ops.outcome."), message.subject
                    self.wire.saw("operation-status", message.payload)
            self.relayed = row[0]


def _envelope(
    lease: Any,
    *,
    ok: bool,
    data: dict[str, Any] | None = None,
    error: ErrorInfo | None = None,
    unknown: bool = False,
    lookup: int | None = None,
) -> ResultEnvelope:
    """A result envelope as an executor builds one, for the lease `lease`."""
    return ResultEnvelope(
        operation_id=lease["operation_id"],
        fencing_token=lease["fencing_token"],
        ok=ok,
        data=data,
        error=error,
        outcome_unknown=unknown,
        provenance=Provenance(
            tool=lease["tool"],
            tool_version=lease["tool_version"],
            executor="exec-a1",
            attempt=lease["attempt"],
            latency_ms=12.4,
            completed_at=datetime.now(UTC),
        ),
        lookup=lookup,
    )


@pytest.fixture
def wire() -> Wire:
    return Wire()


@pytest.fixture
async def stack(tmp_path: Path, wire: Wire) -> AsyncIterator[Stack]:
    clock = Clock()
    ledger = make_ledger(StorageConfig.sqlite(tmp_path / "ledger.db"), clock=clock)
    stack = Stack(ledger, wire, clock)
    stack.gateway.start()
    try:
        yield stack
    finally:
        await stack.gateway.stop()
        ledger.close()


async def _approve(stack: Stack, operation_id: str) -> Any:
    reply = await stack.propose(operation_id, "send_customer_email", EMAIL_ARGUMENTS)
    assert reply["state"] == "awaiting_approval", reply
    # The e-mail's contract asks for the tool's preview first: the executor runs it
    # and sends it back, and the approval names its digest.
    ledger_id = f"{HOST}/{operation_id}"
    asked = await stack.lease({"operation_id": ledger_id, "executor": "exec-m1"}, tool=EMAIL)
    assert asked["decision"] == "preview" and asked["arguments"], asked
    report = {"effect": {"summary": "send 1 e-mail(s)", "recipients": ["cus-0001"]}}
    sent = {"operation_id": ledger_id, "executor": "exec-m1", "preview": report}
    assert (await stack.lease(sent, tool=EMAIL))["decision"] == "done"
    return await stack.decide(
        {
            "command": "approve",
            "operation_id": ledger_id,
            "proposal_hash": reply["decision"]["proposal_hash"],
            "preview_hash": PreviewReport.model_validate(report).digest(),
        }
    )


async def _scenario(stack: Stack) -> None:
    """Every message type, every state a host can see, every lease decision."""
    clock = stack.clock
    # The tools a caller may be offered, in each format.
    for fmt in ("openai", "anthropic", "mcp"):
        offered = await stack.tools({"format": fmt, "capabilities": ["documents:search"]})
        assert offered["format"] == fmt and offered["tools"]
    # A read, arguments as JSON text, run by the executor's own core and sample tool.
    reply = await stack.propose(
        "op-read", "search_documents", '{"query": "refund policy", "top_k": 5}'
    )
    assert (reply["state"], reply["created"]) == ("ready", True)
    # A retry: the same arguments as an object, other order and spacing: the same call.
    again = await stack.propose(
        "op-read", "search_documents", {"top_k": 5, "query": "refund policy"}
    )
    assert (again["state"], again["created"], again["decision"]) == ("ready", False, None)
    conflict = await stack.propose("op-read", "search_documents", {"query": "shipping"})
    assert conflict["error"]["code"] == "OPERATION_CONFLICT"
    stack.relay()
    catalog = stack.ledger.checker.catalog
    processor = ItemProcessor(
        search_documents, catalog["search_documents"], ProcessorOptions("search_documents-a1")
    )

    async def beat() -> None:
        return None

    disposition = await processor.process(stack.work[-1], lease=stack.lease_for, heartbeat=beat)
    assert disposition.envelope is not None and disposition.envelope.ok
    await stack.result(disposition.envelope)
    status = await stack.status("op-read")
    assert status["state"] == "succeeded" and status["result"]["data"]["items"]
    done = await stack.lease(
        {"operation_id": "h1/op-read", "executor": "exec-a2"}, "search_documents"
    )
    assert done["decision"] == "done"

    # Refusals, each in its reply's shape.
    await stack.propose("op-bad", "search_documents", {"query": "refunds", "top_k": 50})  # rejected
    await stack.propose("op-which", "query_orders", {"customer_id": "cus-0700"})  # a question
    invalid = await stack.propose_raw(b'{"proposal": 1}')
    assert invalid["error"]["code"] == "INVALID_MESSAGE"
    missing = await stack.status("op-nobody")
    assert missing["error"]["code"] == "OPERATION_NOT_FOUND"
    other_tool = await stack.lease({"operation_id": "h1/op-read", "executor": "e"}, "query_orders")
    assert other_tool["error"]["code"] == "OPERATION_NOT_FOUND"

    # Cancelled before it ran; cancel requested while it runs, then stopped in time.
    await stack.propose("op-cancel", "search_documents", {"query": "refunds"})
    assert (await stack.cancel("op-cancel"))["state"] == "cancelled"
    await stack.propose("op-stop", "search_documents", {"query": "refunds"})
    lease = await stack.lease(
        {"operation_id": "h1/op-stop", "executor": "exec-a1"}, "search_documents"
    )
    assert lease["decision"] == "execute"
    assert (await stack.status("op-stop"))["state"] == "executing"
    busy = await stack.lease(
        {"operation_id": "h1/op-stop", "executor": "exec-a2"}, "search_documents"
    )
    assert busy["decision"] == "busy"
    assert (await stack.cancel("op-stop"))["cancel"] == "requested"
    check_in = {
        "operation_id": "h1/op-stop",
        "executor": "exec-a1",
        "holding": lease["fencing_token"],
    }
    assert (await stack.lease(check_in, "search_documents"))["decision"] == "cancel"
    stopped = ErrorInfo(
        code=CANCELLED_BEFORE_EFFECT,
        category=ErrorCategory.CONFLICT,
        message="cancelled before any effect",
    )
    await stack.result(_envelope(lease, ok=False, error=stopped))

    # Failed, then a cancel too late for it.
    await stack.propose("op-fail", "search_documents", {"query": "refunds"})
    lease = await stack.lease(
        {"operation_id": "h1/op-fail", "executor": "exec-a1"}, "search_documents"
    )
    invalid_query = ErrorInfo(
        code="INVALID_QUERY",
        category=ErrorCategory.INVALID_INPUT,
        message="the query has no searchable words",
    )
    await stack.result(_envelope(lease, ok=False, error=invalid_query))
    assert (await stack.cancel("op-fail"))["cancel"] == "too_late"

    # Approvals: granted, then an unknown outcome looked up (reconcile); denied; expired.
    assert (await _approve(stack, "op-mail"))["state"] == "ready"
    refused = await stack.decide(
        {"command": "approve", "operation_id": "h1/op-mail", "proposal_hash": "0" * 64}
    )
    assert refused["error"]["code"] in ("APPROVAL_REFUSED", "ILLEGAL_TRANSITION")
    lease = await stack.lease(
        {"operation_id": "h1/op-mail", "executor": "exec-m1"}, "send_customer_email"
    )
    timeout = ErrorInfo(
        code="PROVIDER_UNAVAILABLE",
        category=ErrorCategory.TRANSIENT,
        message="the mail provider did not confirm the send",
        retryable=True,
    )
    await stack.result(_envelope(lease, ok=False, error=timeout, unknown=True))
    assert (await stack.status("op-mail"))["state"] == "outcome_unknown"
    clock.skew += timedelta(seconds=5)
    lookup = await stack.lease(
        {"operation_id": "h1/op-mail", "executor": "exec-m1"}, "send_customer_email"
    )
    assert lookup["decision"] == "reconcile", lookup
    assert (await stack.status("op-mail"))["state"] == "reconciling"
    await stack.result(_envelope(lookup, ok=True, data=EMAIL_OUTPUT, lookup=lookup["lookup"]))
    assert (await stack.status("op-mail"))["outcome"]["reconciled"] is True

    # An unknown outcome its executor cannot look up: a person settles it.
    await _approve(stack, "op-mail-2")
    lease = await stack.lease(
        {"operation_id": "h1/op-mail-2", "executor": "exec-m1"}, "send_customer_email"
    )
    await stack.result(_envelope(lease, ok=False, error=timeout, unknown=True))
    clock.skew += timedelta(seconds=5)
    lookup = await stack.lease(
        {"operation_id": "h1/op-mail-2", "executor": "exec-m1"}, "send_customer_email"
    )
    unsupported = ErrorInfo(
        code=RECONCILE_UNSUPPORTED,
        category=ErrorCategory.INTERNAL,
        message="this executor cannot look the outcome up",
    )
    await stack.result(
        _envelope(lookup, ok=False, error=unsupported, unknown=True, lookup=lookup["lookup"])
    )
    assert (await stack.status("op-mail-2"))["state"] == "needs_resolution"
    stack.relay()  # the notice that a person must act
    wrong = await stack.operate(
        {"command": "resolve", "operation_id": "h1/op-read", "applied": True, "reason": "checked"}
    )
    assert wrong["error"]["code"] == "ILLEGAL_TRANSITION"
    settled = await stack.operate(
        {
            "command": "resolve",
            "operation_id": "h1/op-mail-2",
            "applied": False,
            "reason": "the provider says it never left",
        }
    )
    assert settled["state"] == "failed"

    await stack.propose("op-deny", "send_customer_email", EMAIL_ARGUMENTS)
    denied = await stack.decide({"command": "deny", "operation_id": "h1/op-deny", "reason": "no"})
    assert denied["state"] == "approval_denied"
    await stack.propose("op-late", "send_customer_email", EMAIL_ARGUMENTS)
    clock.skew += timedelta(hours=1)
    stack.ledger.expire_approvals()
    assert (await stack.status("op-late"))["state"] == "approval_expired"
    stack.relay()
    await _plan_scenario(stack)


async def _plan_scenario(stack: Stack) -> None:
    """Plans: proposed, refused, approved as a whole, asked about and cancelled."""
    search = {"query": "refund policy"}
    steps = [
        {"step": "find", "operation_id": "op-plan-find", "tool_name": "search_documents",
         "arguments": search},
        {"step": "tell", "operation_id": "op-plan-tell", "tool_name": EMAIL,
         "arguments": EMAIL_ARGUMENTS, "depends_on": ["find"]},
    ]
    plan = {"plan_id": "plan-1", "conversation_id": "c-1", "requested_by_user_id": "alice",
            "steps": steps}
    proposed = await stack.plan({"command": "propose", "plan": plan, "context": ALICE})
    assert proposed["state"] == "awaiting_approval", proposed
    cycle = {**plan, "plan_id": "plan-cycle",
             "steps": [{**steps[0], "operation_id": "op-c1", "depends_on": ["find"]}]}
    refused = await stack.plan({"command": "propose", "plan": cycle, "context": ALICE})
    assert refused["state"] == "rejected" and refused["issues"][0]["code"] == "plan_cycle"
    approved = await stack.decide_plan(
        {"command": "approve", "plan_id": "h1/plan-1", "proposal_hash": proposed["plan_hash"]}
    )
    assert approved["state"] == "running", approved
    asked = await stack.plan({"command": "status", "plan_id": "plan-1"})
    assert [row["state"] for row in asked["steps"]] == ["ready", "waiting"]
    cancelled = await stack.plan({"command": "cancel", "plan_id": "plan-1", "reason": "done"})
    assert cancelled["cancel_requested"] is True
    unknown = await stack.plan({"command": "status", "plan_id": "no-such-plan"})
    assert unknown["error"]["code"] == "PLAN_NOT_FOUND"
    stack.relay()  # the plans' events on the feed


async def test_every_message_the_code_sends_matches_its_published_schema(
    stack: Stack, wire: Wire
) -> None:
    await _scenario(stack)
    for name, payload in wire.messages:
        instance = orjson.loads(payload)
        assert not problems(name, instance), (name, problems(name, instance), instance)


async def test_the_scenario_covers_every_message_state_and_decision(
    stack: Stack, wire: Wire
) -> None:
    await _scenario(stack)
    seen = {name for name, _ in wire.messages}
    parts = {"proposal", "runtime-context", "decision", "validation-issue", "plan-proposal"}
    assert set(WIRE_MODELS) - parts <= seen
    statuses = wire.of("operation-status")
    states = {s["state"] for s in statuses} | {r["state"] for r in wire.of("propose-reply")}
    # `proposed` and `validated` last only inside one append: no message ever shows them.
    assert states - {None} == {s.value for s in OperationState} - {"proposed", "validated"}
    assert {s["outcome"]["status"] for s in statuses if s["outcome"]} == {
        s.value for s in OutcomeStatus
    }
    assert {s["cancel"] for s in statuses} == {None, "requested", "too_late"}
    assert {r["decision"] for r in wire.of("lease-reply")} == {d.value for d in LeaseDecision}
    assert {w["purpose"] for w in wire.of("work-item")} == {"execute", "reconcile", "preview"}
    outcomes = [
        m for m in wire.of("operation-status") if m["final"] or m["state"] == "needs_resolution"
    ]
    assert outcomes  # relay notices are among them


@pytest.mark.parametrize("state", list(OperationState), ids=str)
def test_a_status_in_any_state_matches_the_published_schema(state: OperationState) -> None:
    status = OperationStatus(
        operation_id="op-7f3c2a",
        state=state.value,
        final=state in TERMINAL_STATES,
        tool="search_documents",
        tool_version="2.1.0",
    )
    assert not problems("operation-status", orjson.loads(status.model_dump_json()))


def test_a_feed_event_of_any_type_matches_the_published_schema() -> None:
    from ledger.domain.event_kinds import event_types

    for kind in sorted(event.__name__ for event in event_types()):
        record = FeedEvent(
            position=1,
            operation_id="h1/op-1",
            version=1,
            type=kind,
            timestamp="2026-11-29T10:00:01.402810Z",
            event_hash="a" * 64,
            prev_hash="0" * 64,
            event={},
        )
        assert not problems("feed-event", orjson.loads(record.model_dump_json())), kind


def _timestamps(node: Any, found: Callable[[str], None]) -> None:
    """Call `found` with every string in `node` that starts like a date-time."""
    if isinstance(node, dict):
        for key, value in node.items():
            # A feed record's `event` is the stored event, an open object the schema does
            # not type (its `LeaseClaimed.checked.approval_valid_until` is isoformat's).
            if key != "event":
                _timestamps(value, found)
    elif isinstance(node, list):
        for value in node:
            _timestamps(value, found)
    elif isinstance(node, str) and re.match(r"^\d{4}-\d{2}-\d{2}T", node):
        found(node)


async def test_the_ledger_writes_timestamps_in_utc_with_z(stack: Stack, wire: Wire) -> None:
    """What the docs promise: `Z`, never `+00:00`; microseconds unless they are zero."""
    await _scenario(stack)
    stamps: list[str] = []
    for _, payload in wire.messages:
        _timestamps(orjson.loads(payload), stamps.append)
    assert stamps
    for stamp in stamps:
        assert re.match(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{6})?Z$", stamp), stamp


def test_fields_a_later_release_added_are_left_out_while_none_and_written_when_set() -> None:
    # A reader of the release before forbids fields it does not know: a message that
    # does not use the addition must read as it always did.
    digest = "b" * 64
    report = PreviewReport(effect={"recipients": 1})
    cases: list[tuple[WireModel, WireModel, str]] = [
        (LeaseRequest(operation_id="op-1", executor="e1"),
         LeaseRequest(operation_id="op-1", executor="e1", preview=report), "preview"),
        (LeaseReply(decision=LeaseDecision.EXECUTE, operation_id="h1/op-1"),
         LeaseReply(decision=LeaseDecision.EXECUTE, operation_id="h1/op-1", preview_hash=digest),
         "preview_hash"),
        (ApproverRequest(command="deny", operation_id="h1/op-1"),
         ApproverRequest(command="approve", plan_id="h1/plan-1", proposal_hash=digest),
         "plan_id"),
        (ApproverRequest(command="approve", operation_id="h1/op-1", proposal_hash=digest),
         ApproverRequest(command="approve", operation_id="h1/op-1", proposal_hash=digest,
                         preview_hash=digest), "preview_hash"),
    ]
    for without, with_it, name in cases:
        assert name not in orjson.loads(without.model_dump_json()), name
        assert name not in without.model_dump(mode="json"), name
        assert name in orjson.loads(with_it.model_dump_json()), name
    # Every other field that is None is still written, as null: only additions are left out.
    assert orjson.loads(cases[0][0].model_dump_json())["holding"] is None
    assert orjson.loads(cases[1][0].model_dump_json())["fencing_token"] is None
