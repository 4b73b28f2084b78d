"""Traces: one approved e-mail is one trace, from the host's proposal to the executor.

Every party runs in this process on a real nats-server, each as its own NATS
identity (host, ledger service, approver, executor), so that the SDK's
in-memory exporter sees the spans of all of them; the trace context crosses
only NATS headers and the ledger's store, exactly as between processes.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from executors import ExecutorRunner, ProcessorOptions, RunnerOptions
from executors._main import build_connect_options
from executors._runner import load_contract
from executors.samples import sample_tool
from executors.samples.email import EMAIL_DB_SECRET, count_send_requests
from ledger import StorageConfig
from ledger.bootstrap import build_ledger
from ledger.client import AgentHostClient, ApproverClient
from ledger.nats import (
    CredentialSet,
    NatsServer,
    connect_as,
    connect_options,
    declare_topology,
    generate_credentials,
)
from ledger.server.app import LedgerService, ServiceOptions
from ledger.service import Ledger
from policy.catalog import CATALOG_DIR, sample_plugins
from schemas import (
    TRACEPARENT_PATTERN,
    ProposalEnvelope,
    ProposeReply,
    RuntimeContext,
    Subjects,
    ToolProposal,
    WorkItem,
)
from tests.previews import await_preview

pytestmark = pytest.mark.nats

EMAIL = "send_customer_email"
ALICE = RuntimeContext(principal="alice", tenant="acme", capabilities=frozenset({"email:send"}))



@dataclass
class World:
    """The running parties."""

    host: AgentHostClient
    approver: ApproverClient
    ledger: Ledger
    email_db: Path
    url: str
    creds: CredentialSet


@asynccontextmanager
async def _world(tmp_path: Path) -> AsyncIterator[World]:
    creds = generate_credentials(
        tmp_path / "creds", hosts=["h1"], tools=[EMAIL], approvers=["lead"]
    )
    email_db = tmp_path / "email.db"
    with NatsServer(tmp_path / "nats", authorization=creds.authorization_config) as server:
        resolver, rules = sample_plugins()
        ledger = build_ledger(
            StorageConfig.sqlite(tmp_path / "ledger.db"), resolver=resolver, rules=rules
        )

        async def declare(js: Any) -> None:
            await declare_topology(js, [EMAIL], ack_wait_s=10, max_deliver=5)

        service = LedgerService(
            ledger,
            ServiceOptions(
                nats_url=server.url,
                connect_options=connect_options(creds.ledger),
                declare=declare,
                approver_roles={"lead": frozenset({"support_lead"})},
                redispatch_after=None,
            ),
        )
        await service.start()
        tool = sample_tool(EMAIL)
        runner = ExecutorRunner(
            tool,
            load_contract(CATALOG_DIR, EMAIL, tool.version),
            RunnerOptions(
                ProcessorOptions(executor="email-0", secrets={EMAIL_DB_SECRET: str(email_db)}),
                connect_options=build_connect_options(
                    nats_url=server.url,
                    tool_name=EMAIL,
                    executor="email-0",
                    creds=creds.executor(EMAIL).seed_path,
                ),
            ),
        )
        running = asyncio.create_task(runner.run())
        host = AgentHostClient(await connect_as(server.url, creds.host("h1")), "h1")
        approver_nc = await connect_as(server.url, creds.approver("lead"))
        approver = ApproverClient(approver_nc, "lead")
        try:
            yield World(host, approver, ledger, email_db, server.url, creds)
        finally:
            await host.close()
            await approver.close()
            runner.stop()
            await asyncio.wait_for(running, 10)
            await service.stop()
            ledger.close()


def _email(op: str) -> ToolProposal:
    return ToolProposal(
        proposal_id=f"p-{op}",
        conversation_id="c-1",
        requested_by_user_id="alice",
        tool_name=EMAIL,
        operation_id=op,
        arguments={
            "recipient_ids": ["cus-0001"],
            "template": "support_received",
            "variables": {"ticket_id": "TCK-42"},
        },
    )


_OURS = ("gen_ai", "opledger")


def _tree(spans: list[ReadableSpan]) -> list[str]:
    """The spans as an indented tree, in start order (for the eye, and for the note)."""
    children: dict[int | None, list[ReadableSpan]] = {}
    ids = {span.context.span_id for span in spans if span.context is not None}
    for span in sorted(spans, key=lambda s: s.start_time or 0):
        parent = span.parent.span_id if span.parent is not None else None
        children.setdefault(parent if parent in ids else None, []).append(span)
    lines: list[str] = []

    def walk(parent: int | None, depth: int) -> None:
        for span in children.get(parent, []):
            keys = sorted(
                k for k in (span.attributes or {}) if k.startswith(("gen_ai", "opledger"))
            )
            shown = {k: (span.attributes or {})[k] for k in keys}
            lines.append(f"{'  ' * depth}{span.name} {json.dumps(shown, default=list)}")
            assert span.context is not None
            walk(span.context.span_id, depth + 1)

    walk(None, 0)
    return lines


def _of_trace(exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    return [
        span
        for span in exporter.get_finished_spans()
        if span.context is not None and span.context.trace_id == trace_id
    ]


async def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.05)


@pytest.mark.anyio
async def test_an_approved_email_is_one_trace_from_the_host_to_the_executor(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    spans.clear()
    tracer = trace.get_tracer("an agent host")
    async with _world(tmp_path) as world:
        # The host's own span: everything the ledger does for this call joins its trace.
        with tracer.start_as_current_span("agent turn") as turn:
            reply = await world.host.propose(_email("mail-1"), ALICE)
        trace_id = turn.get_span_context().trace_id
        assert reply.state == "awaiting_approval" and reply.decision is not None
        # The approver works from another trace (their own tool, hours later).
        status = await world.approver.approve(
            "h1/mail-1",
            proposal_hash=reply.decision.proposal_hash or "",
            preview_hash=await await_preview(world.ledger, "h1/mail-1"),
        )
        assert status.state in ("ready", "executing", "succeeded"), status
        outcome = await world.host.outcome("mail-1")
        assert outcome.state == "succeeded"
        await _wait_for(
            lambda: any(s.name == "opledger.record" for s in _of_trace(spans, trace_id))
        )
    traced = _of_trace(spans, trace_id)
    tree = _tree(traced)
    print("\n".join(tree))  # the trace of one approved e-mail, for the eye
    by_name: dict[str, list[ReadableSpan]] = {}
    for span in traced:
        by_name.setdefault(span.name, []).append(span)
    # One trace: the host's turn, the proposal, the check, the approval, the dispatch,
    # the executor's work and tool run, the lease and the record of the result.
    for name in (
        "agent turn",
        "opledger.propose",
        "opledger.check",
        "opledger.approval",
        "opledger.dispatch",
        "opledger.work",
        "opledger.lease",
        f"execute_tool {EMAIL}",
        "opledger.record",
    ):
        assert name in by_name, (name, tree)
    (tool_span,) = by_name[f"execute_tool {EMAIL}"]
    attributes = dict(tool_span.attributes or {})
    assert attributes["gen_ai.operation.name"] == "execute_tool"
    assert attributes["gen_ai.tool.name"] == EMAIL
    assert attributes["gen_ai.tool.call.id"] == "mail-1"
    assert attributes["opledger.outcome"] == "succeeded"
    # Argument values only when asked for.
    assert "gen_ai.tool.call.arguments" not in attributes
    (check,) = by_name["opledger.check"]
    check_attributes = dict(check.attributes or {})
    assert check_attributes["opledger.decision"] == "needs_approval"
    assert check_attributes["opledger.operation.id"] == "h1/mail-1"
    assert check_attributes["opledger.risk"] in ("medium", "high", "critical")
    (approval,) = by_name["opledger.approval"]
    assert dict(approval.attributes or {})["opledger.approval.approver"] == "lead"
    # The approval names the preview the approver saw (the e-mail's contract asks for one).
    assert len(str(dict(approval.attributes or {})["opledger.approval.preview_hash"])) == 64
    assert "preview" in {dict(s.attributes or {}).get("opledger.purpose") for s in traced}
    # Parentage: the tool ran inside the executor's work on the item the relay dispatched.
    parent_of = {s.context.span_id: s for s in traced if s.context is not None}
    work = parent_of[tool_span.parent.span_id] if tool_span.parent else None
    assert work is not None and work.name == "opledger.work"
    dispatch = parent_of[work.parent.span_id] if work.parent else None
    assert dispatch is not None and dispatch.name == "opledger.dispatch"
    assert count_send_requests(world.email_db, "h1/mail-1") == 1


@pytest.mark.anyio
async def test_a_replayed_item_and_an_idempotent_retry_run_no_tool_span(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    spans.clear()
    async with _world(tmp_path) as world:
        reply = await world.host.propose(_email("mail-2"), ALICE)
        assert reply.decision is not None
        await world.approver.approve(
            "h1/mail-2",
            proposal_hash=reply.decision.proposal_hash or "",
            preview_hash=await await_preview(world.ledger, "h1/mail-2"),
        )
        assert (await world.host.outcome("mail-2")).state == "succeeded"
        # The same call again (a host retrying a lost reply): no new operation, no run.
        again = await world.host.propose(_email("mail-2"), ALICE)
        assert again.created is False
        # A redelivered work item for the settled operation: the lease says done.
        nc = await connect_as(world.url, world.creds.ledger)
        try:
            js = nc.jetstream()
            item = WorkItem(
                operation_id="h1/mail-2",
                tool=EMAIL,
                tool_version=world.ledger.get("h1/mail-2").tool_version or "",
                attempt=1,
            )
            await js.publish(Subjects.work(EMAIL), item.model_dump_json().encode())
        finally:
            await nc.close()
        await _wait_for(
            lambda: sum(s.name == "opledger.work" for s in spans.get_finished_spans()) >= 2
        )
    finished = spans.get_finished_spans()
    works = [s for s in finished if s.name == "opledger.work"]
    assert [dict(s.attributes or {}).get("opledger.outcome") for s in works][-1] == "done"
    assert sum(s.name == f"execute_tool {EMAIL}" for s in finished) == 1
    assert count_send_requests(world.email_db, "h1/mail-2") == 1


@pytest.mark.anyio
@pytest.mark.parametrize(
    "headers",
    [
        {"traceparent": "not-a-traceparent"},
        {"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"},  # all-zero IDs: invalid
        {"traceparent": "ff-" + "a" * 32 + "-" + "b" * 16 + "-01", "tracestate": "x" * 4000},
    ],
)
async def test_a_forged_trace_header_costs_the_host_only_its_trace(
    tmp_path: Path, spans: InMemorySpanExporter, headers: dict[str, str]
) -> None:
    async with _world(tmp_path) as world:
        envelope = ProposalEnvelope(proposal=_email("mail-3"), context=ALICE)
        nc = await connect_as(world.url, world.creds.host("h1"))
        try:
            answer = await nc.request(
                Subjects.propose("h1"), envelope.model_dump_json().encode(), 5, headers=headers
            )
        finally:
            await nc.close()
        reply = ProposeReply.model_validate_json(answer.data)
        assert reply.error is None and reply.state == "awaiting_approval"
        # What the ledger keeps is its own well-formed context, never the sender's text.
        kept = world.ledger.get("h1/mail-3").trace_parent
        assert kept is None or re.fullmatch(TRACEPARENT_PATTERN.strip("^$"), kept)
        assert headers["traceparent"] != kept
