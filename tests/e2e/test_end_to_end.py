"""End to end on a real nats-server: host → ledger service → executor process → host."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import orjson
import pytest
from jsonschema import Draft202012Validator

from executors.samples.email import count_send_requests, count_sends
from ledger.audit.export import exported_events
from ledger.client import AgentHostClient, RequestRefused
from ledger.nats import NatsServer, connect_as
from schemas import (
    FEED_AUDITOR_CONSUMER,
    FEED_STREAM,
    RESULTS_CONSUMER,
    RESULTS_STREAM,
    SCHEMA_DIR,
    WORK_STREAM,
    LeaseDecision,
    LeaseReply,
    LeaseRequest,
    OperationStatus,
    ProposeReply,
    PullConsumer,
    ResultEnvelope,
    RuntimeContext,
    Subjects,
    ToolProposal,
    work_consumer,
)
from tests.e2e.conftest import ACK_WAIT_S, REDISPATCH_AFTER_S, Stack
from tests.e2e.slow_tool import SLOW_S
from tests.previews import await_preview

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

ALICE = RuntimeContext(
    principal="alice", tenant="acme",
    capabilities=frozenset({"documents:search", "documents:read", "email:send"}),
)


def _proposal(tool: str, arguments: dict[str, Any], operation_id: str) -> ToolProposal:
    return ToolProposal(proposal_id=f"p-{operation_id}", conversation_id="c-1",
                        requested_by_user_id="alice", tool_name=tool, arguments=arguments,
                        operation_id=operation_id)


async def _host(stack: Stack, name: str = "h1") -> AgentHostClient:
    nc = await connect_as(stack.server.url, stack.credentials.host(name))
    return AgentHostClient(nc, name, timeout=5)


async def test_propose_execute_and_deliver_the_outcome(stack: Stack) -> None:
    executor = stack.start_executor("search_documents")
    host = await _host(stack)
    try:
        reply = await host.propose(
            _proposal("search_documents", {"query": "refund policy"}, "op-e2e-1"), ALICE
        )
        assert (reply.operation_id, reply.state, reply.created) == ("op-e2e-1", "ready", True)
        assert reply.decision is not None
        assert reply.decision.outcome.value == "ready"
        status = await host.outcome("op-e2e-1", timeout=30)
    finally:
        await host.close()
    assert status.state == "succeeded", stack.log("exec-search_documents-0.log")
    assert status.result is not None
    assert status.result.ok
    assert status.result.provenance.trust == "untrusted"
    assert status.result.provenance.tool == "search_documents"
    assert status.result.provenance.executor == "search_documents-0"
    assert executor.poll() is None  # a separate, still running process


async def test_schema_invalid_proposal_gets_repair_feedback(stack: Stack) -> None:
    host = await _host(stack)
    try:
        reply = await host.propose(
            _proposal("search_documents", {"query": "x", "top_k": "10"}, "op-bad"), ALICE
        )
    finally:
        await host.close()
    assert reply.state == "rejected"
    assert reply.decision is not None
    assert {(i.code, i.path) for i in reply.decision.issues} == {
        ("length", "/query"), ("wrong_type", "/top_k")
    }
    assert reply.decision.repairable


async def test_killed_executor_converges_on_one_side_effect(stack: Stack) -> None:
    crashing = stack.start_executor("send_customer_email", OPLEDGER_TEST_CRASH_AFTER_SEND="1")
    host = await _host(stack)
    ledger = stack.ledger()
    try:
        arguments = {"recipient_ids": ["cus-0001"], "template": "support_received",
                     "variables": {"ticket_id": "TCK-42"}}
        reply = await host.propose(_proposal("send_customer_email", arguments, "op-mail"), ALICE)
        assert reply.state == "awaiting_approval"
        assert reply.decision is not None
        ledger.approve("h1/op-mail", approver="lead", approver_roles=["support_lead"],
                       proposal_hash=reply.decision.proposal_hash or "",
                       preview_hash=await await_preview(ledger, "h1/op-mail"))
        # The first executor sends, then dies before publishing or acking.
        for _ in range(100):
            if crashing.poll() is not None:
                break
            await asyncio.sleep(0.1)
        assert crashing.returncode == 137, (
            stack.log("exec-send_customer_email-0.log"),
            [(type(e).__name__, getattr(e, "reason", "")) for e in ledger.history("h1/op-mail")],
            count_sends(stack.email_db),
        )
        assert count_sends(stack.email_db, "h1/op-mail") == 1
        # A fresh executor gets the redelivered item; the ledger has it reconcile.
        stack.start_executor("send_customer_email")
        status = await host.outcome("op-mail", timeout=60)
    finally:
        await host.close()
    assert status.state == "succeeded", stack.log("service.log")
    assert count_sends(stack.email_db, "h1/op-mail") == 1
    # The provider deduplicates by key anyway; what matters is that the
    # redelivered item never reached it: the ledger had it reconcile instead.
    assert count_send_requests(stack.email_db, "h1/op-mail") == 1
    history = [type(e).__name__ for e in ledger.history("h1/op-mail")]
    assert "Reconciled" in history
    assert history.count("LeaseClaimed") == 1
    assert ACK_WAIT_S < 5


async def test_the_same_result_twice_is_one_outcome(stack: Stack) -> None:
    stack.start_executor("search_documents")
    host = await _host(stack)
    ledger = stack.ledger()
    try:
        await host.propose(_proposal("search_documents", {"query": "refunds"}, "op-dup"), ALICE)
        status = await host.outcome("op-dup", timeout=30)
        assert status.result is not None
        events = len(ledger.history("h1/op-dup"))
        executor = await connect_as(stack.server.url,
                                    stack.credentials.executor("search_documents"))
        try:
            js = executor.jetstream()
            for suffix in ("a", "b"):  # distinct message IDs: JetStream keeps both
                await js.publish(Subjects.result("search_documents"),
                                 status.result.model_dump_json().encode(),
                                 headers={"Nats-Msg-Id": f"replay-{suffix}"})
        finally:
            await executor.close()
        await _results_drained(stack)
        again = await host.status("op-dup")
    finally:
        await host.close()
    assert again.state == "succeeded"
    assert len(ledger.history("h1/op-dup")) == events
    assert again.outcome == status.outcome


async def test_one_result_published_twice_before_it_is_recorded_is_one_outcome(
    stack: Stack,
) -> None:
    """No executor runs: the test leases the work itself and publishes its result twice."""
    host = await _host(stack)
    ledger = stack.ledger()
    executor = await connect_as(stack.server.url, stack.credentials.executor("search_documents"))
    try:
        await host.propose(_proposal("search_documents", {"query": "refunds"}, "op-dup2"), ALICE)
        request = LeaseRequest(operation_id="h1/op-dup2", executor="test-exec")
        answer = await executor.request(Subjects.lease("search_documents"),
                                        request.model_dump_json().encode(), timeout=10)
        lease = LeaseReply.model_validate_json(answer.data)
        assert lease.decision is LeaseDecision.EXECUTE and lease.fencing_token is not None
        envelope = ResultEnvelope.model_validate({
            "operation_id": "h1/op-dup2", "fencing_token": lease.fencing_token, "ok": True,
            "data": {"items": [], "truncated": False, "next_cursor": None},
            "provenance": {"tool": "search_documents", "tool_version": lease.tool_version,
                           "executor": "test-exec", "attempt": lease.attempt,
                           "latency_ms": 1.0, "completed_at": "2026-11-29T10:00:00Z"},
        })
        js = executor.jetstream()
        acks = [await js.publish(Subjects.result("search_documents"),
                                 envelope.model_dump_json().encode(),
                                 headers={"Nats-Msg-Id": f"twice-{suffix}"})
                for suffix in ("a", "b")]  # distinct message IDs: JetStream keeps both
        assert not any(ack.duplicate for ack in acks)
        status = await host.outcome("op-dup2", timeout=30)
        await _results_drained(stack)
    finally:
        await executor.close()
        await host.close()
    assert status.state == "succeeded", stack.log("service.log")
    history = [type(e).__name__ for e in ledger.history("h1/op-dup2")]
    assert history.count("Succeeded") == 1, history
    assert not {"StaleResultRecorded", "ConflictingOutcomeRecorded"} & set(history), history


async def _results_drained(stack: Stack, timeout: float = 15) -> None:
    """Wait until the ledger's results consumer has taken and acknowledged every result."""
    nc = await connect_as(stack.server.url, stack.credentials.ledger)
    try:
        js = nc.jetstream()
        for _ in range(int(timeout / 0.1)):
            stream = await js.stream_info(RESULTS_STREAM)
            info = await js.consumer_info(RESULTS_STREAM, RESULTS_CONSUMER)
            if (info.num_pending, info.num_ack_pending) == (0, 0) and (
                info.delivered.stream_seq >= stream.state.last_seq
            ):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"results not drained: {info}")
    finally:
        await nc.close()


@pytest.mark.parametrize(("progress_every", "redelivered"), [(0.5, False), (30.0, True)])
async def test_work_longer_than_the_ack_wait_is_not_redelivered_while_it_runs(
    stack: Stack, progress_every: float, redelivered: bool
) -> None:
    """In-progress acks hold the item; without them in time, the server redelivers it.

    `--batch 2` keeps a pull open while the one item runs, so a redelivery has
    somewhere to go at once (with one slot, it could wait for the late ack).
    """
    assert SLOW_S > ACK_WAIT_S
    stack.start_executor("query_orders", "--progress-every", str(progress_every),
                         "--batch", "2", spec="tests.e2e.slow_tool:slow_query_orders")
    host = await _host(stack)
    reader = ALICE.model_copy(update={"capabilities": frozenset({"orders:read"})})
    try:
        reply = await host.propose(_proposal("query_orders", {"limit": 10}, "op-slow"), reader)
        assert reply.state == "ready", reply
        status = await host.outcome("op-slow", timeout=30)
    finally:
        await host.close()
    assert status.state == "succeeded", stack.log("exec-query_orders-0.log")
    nc = await connect_as(stack.server.url, stack.credentials.ledger)
    try:
        info = await nc.jetstream().consumer_info(WORK_STREAM, work_consumer("query_orders"))
    finally:
        await nc.close()
    assert (info.delivered.consumer_seq > 1) is redelivered, info.delivered
    history = [type(e).__name__ for e in stack.ledger().history("h1/op-slow")]
    assert history.count("LeaseClaimed") == 1  # a redelivery while it runs finds the lease busy


async def test_a_lost_work_item_is_published_again_and_a_queued_one_is_not(
    stack: Stack,
) -> None:
    """No executor at first: the item waits in the queue and is not copied; then it is lost."""
    host = await _host(stack)
    ledger_nc = await connect_as(stack.server.url, stack.credentials.ledger)
    js = ledger_nc.jetstream()
    subject = Subjects.work("search_documents")
    try:
        await host.propose(_proposal("search_documents", {"query": "refunds"}, "op-lost"), ALICE)
        await asyncio.sleep(2 * REDISPATCH_AFTER_S + 1)  # sweeps ran after the threshold
        info = await js.stream_info(WORK_STREAM, subjects_filter=subject)
        assert (info.state.subjects or {}).get(subject) == 1  # queued: no copy
        await js.purge_stream(WORK_STREAM, subject=subject)  # lost
        stack.start_executor("search_documents")
        status = await host.outcome("op-lost", timeout=30)
    finally:
        await ledger_nc.close()
        await host.close()
    assert status.state == "succeeded", stack.log("service.log")
    assert "published again: h1/op-lost" in stack.log("service.log")
    history = [type(e).__name__ for e in stack.ledger().history("h1/op-lost")]
    assert history.count("LeaseClaimed") == 1


async def test_a_lost_preview_item_is_sent_again_and_the_call_becomes_approvable(
    stack: Stack,
) -> None:
    """Before: a preview item lost with the work stream left the call unapprovable until
    its approval expired. Now the sweep sends it again (it would be answered `done` had
    the preview come), and the approved e-mail is sent once."""
    host = await _host(stack)
    ledger_nc = await connect_as(stack.server.url, stack.credentials.ledger)
    js = ledger_nc.jetstream()
    subject = Subjects.work("send_customer_email")
    arguments = {"recipient_ids": ["cus-0001"], "template": "support_received",
                 "variables": {"ticket_id": "TCK-7"}}
    try:
        reply = await host.propose(_proposal("send_customer_email", arguments, "op-pv"), ALICE)
        assert reply.state == "awaiting_approval" and reply.decision is not None
        await asyncio.sleep(0.5)  # the relay queued the preview item
        await js.purge_stream(WORK_STREAM, subject=subject)  # lost, before anyone ran it
        stack.start_executor("send_customer_email")
        ledger = stack.ledger()
        shown = await await_preview(ledger, "h1/op-pv", timeout=4 * REDISPATCH_AFTER_S + 30)
        ledger.approve("h1/op-pv", approver="lead", approver_roles=["support_lead"],
                       proposal_hash=reply.decision.proposal_hash or "", preview_hash=shown)
        status = await host.outcome("op-pv", timeout=30)
    finally:
        await ledger_nc.close()
        await host.close()
    assert status.state == "succeeded", stack.log("service.log")
    assert "preview items of 1 call(s) awaiting approval sent again" in stack.log("service.log")
    assert count_sends(stack.email_db, "h1/op-pv") == 1


async def test_an_auditor_reads_every_event_from_the_feed_as_the_ledger_stored_it(
    stack: Stack,
) -> None:
    """The auditor's own identity and consumer; each record valid, chained, as in the ledger."""
    stack.start_executor("search_documents")
    host = await _host(stack)
    try:
        await host.propose(_proposal("search_documents", {"query": "refunds"}, "op-f1"), ALICE)
        await host.propose(_proposal("search_documents", {"query": ""}, "op-f2"), ALICE)
        assert (await host.outcome("op-f1", timeout=30)).state == "succeeded"
    finally:
        await host.close()
    ledger = stack.ledger()
    stored = ledger.stored_rows_after(0, 1_000)
    contracts = {"search_documents": ledger.checker.catalog["search_documents"]}
    expected = {(record["operation_id"], record["version"]): record
                for record in exported_events(stored, contracts)}
    validator = Draft202012Validator(
        orjson.loads((SCHEMA_DIR / "feed-event.schema.json").read_bytes()))
    auditor = await connect_as(stack.server.url, stack.credentials.auditor())
    feed = PullConsumer(auditor, FEED_STREAM, FEED_AUDITOR_CONSUMER)
    await feed.start()
    seen: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        for _ in range(50):
            for message in await feed.take(100, timeout=0.2):
                record = orjson.loads(message.data)
                validator.validate(record)
                assert message.subject == Subjects.feed("search_documents", record["type"])
                seen[(record["operation_id"], record["version"])] = record
                await message.ack()
            if len(seen) >= len(expected):
                break
    finally:
        await feed.stop()
        await auditor.close()
    assert seen == expected
    for (operation_id, version), record in seen.items():
        if version > 1:  # each event names the hash of its operation's previous one
            assert record["prev_hash"] == seen[(operation_id, version - 1)]["event_hash"]
    assert {key[0] for key in seen} == {"h1/op-f1", "h1/op-f2"}


async def test_raw_nats_host_without_the_sdk(stack: Stack) -> None:
    """A host in another language: plain JSON on the documented subjects."""
    envelope_schema = orjson.loads((SCHEMA_DIR / "proposal-envelope.schema.json").read_bytes())
    reply_schema = orjson.loads((SCHEMA_DIR / "propose-reply.schema.json").read_bytes())
    message = {
        "proposal": {
            "proposal_id": "p-raw", "conversation_id": "c-raw", "requested_by_user_id": "bob",
            "tool_name": "search_documents", "arguments": '{"query": "holiday policy"}',
            "operation_id": "op-raw-1",
        },
        "context": {"principal": "bob", "tenant": "acme",
                    "capabilities": ["documents:search"]},
    }
    Draft202012Validator(envelope_schema).validate(message)
    nc = await connect_as(stack.server.url, stack.credentials.host("h2"))
    try:
        raw = await nc.request("ops.propose.h2", orjson.dumps(message), timeout=5)
        answer = orjson.loads(raw.data)
        Draft202012Validator(reply_schema).validate(answer)
        assert (answer["operation_id"], answer["state"]) == ("op-raw-1", "ready")
        broken = await nc.request("ops.propose.h2", b'{"proposal": 1}', timeout=5)
        error = orjson.loads(broken.data)["error"]
        assert (error["code"], error["category"]) == ("INVALID_MESSAGE", "INVALID_INPUT")
        # Another host's operation is invisible.
        status = await nc.request("ops.status.h2", b'{"operation_id": "op-raw-1"}', timeout=5)
        assert OperationStatus.model_validate_json(status.data).state == "ready"
    finally:
        await nc.close()
    other = await _host(stack, "h1")
    try:
        with pytest.raises(RequestRefused) as foreign:
            await other.status("op-raw-1")
        with pytest.raises(RequestRefused) as missing:
            await other.status("op-raw-2")
    finally:
        await other.close()
    # Another host's operation is indistinguishable from one that does not exist.
    assert foreign.value.info.model_dump(exclude={"safe_details"}) == missing.value.info.model_dump(
        exclude={"safe_details"}
    )
    assert foreign.value.info.code == "OPERATION_NOT_FOUND"
    assert set(foreign.value.info.safe_details) == set(missing.value.info.safe_details)
    assert ProposeReply.model_validate(answer).decision is not None


async def test_after_nats_crashes_and_restarts_operations_flow_again(stack: Stack) -> None:
    stack.start_executor("search_documents")
    host = await _host(stack)
    try:
        await host.propose(_proposal("search_documents", {"query": "refund"}, "op-e2e-c1"), ALICE)
        assert (await host.outcome("op-e2e-c1", timeout=30)).state == "succeeded"
    finally:
        await host.close()
    # The service's and the executor's pull requests die with the server, without
    # a word to them. The restarted server (same port, same store) must not have
    # to wait for missed heartbeats (over 10 s) to be pulled from again.
    crashed = stack.server
    assert crashed.pid is not None
    os.kill(crashed.pid, signal.SIGKILL)
    crashed.stop()
    stack.server = NatsServer(
        crashed.work_dir, authorization=crashed.authorization, port=crashed.port
    ).start()
    await asyncio.sleep(2.5)  # nats-py reconnects every 2 s
    host = await _host(stack)
    try:
        started = asyncio.get_running_loop().time()
        await host.propose(_proposal("search_documents", {"query": "refund"}, "op-e2e-c2"), ALICE)
        status = await host.outcome("op-e2e-c2", timeout=30)
        took = asyncio.get_running_loop().time() - started
    finally:
        await host.close()
    assert status.state == "succeeded", stack.log("service.log")
    assert took < 8, f"{took:.1f} s: pulling resumed only when heartbeats were missed"


async def test_a_lost_lookup_item_is_published_again(stack: Stack) -> None:
    """Found in review: only ready operations were redispatched, so an unknown outcome
    whose lookup item was lost (or ran out of deliveries) waited for good."""
    host = await _host(stack)
    ledger_nc = await connect_as(stack.server.url, stack.credentials.ledger)
    executor = await connect_as(stack.server.url, stack.credentials.executor("search_documents"))
    js = ledger_nc.jetstream()
    subject = Subjects.work("search_documents")
    try:
        await host.propose(_proposal("search_documents", {"query": "refunds"}, "op-lookup"),
                           ALICE)
        request = LeaseRequest(operation_id="h1/op-lookup", executor="vanishing-executor")
        await executor.request(Subjects.lease("search_documents"),
                               request.model_dump_json().encode(), timeout=10)
        for _ in range(100):  # the lease runs out, is swept, and a lookup item is queued
            if (await host.status("op-lookup")).state == "outcome_unknown":
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1)
        await js.purge_stream(WORK_STREAM, subject=subject)  # the item and the lookup: lost
        stack.start_executor("search_documents")
        status = await host.outcome("op-lookup", timeout=60)
    finally:
        await executor.close()
        await ledger_nc.close()
        await host.close()
    log = stack.log("service.log")
    assert "published again: h1/op-lookup" in log, log
    history = [type(e).__name__ for e in stack.ledger().history("h1/op-lookup")]
    # Looked up (a read changed nothing: not applied), then retried once and run.
    assert "Reconciled" in history and status.state == "succeeded", history
    assert status.attempts == 2
