"""The agent-host SDK's outcome waiting, against a real server with real permissions.

A stand-in ledger (the ledger identity, plain nats-py) answers proposals and
status requests and counts them, so the tests can tell what the SDK asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import cast

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from ledger.client import AgentHostClient, RequestRefused
from ledger.nats import Role
from schemas import (
    ErrorCategory,
    ErrorEnvelope,
    ErrorInfo,
    OperationStatus,
    ProposeReply,
    RuntimeContext,
    StatusRequest,
    Subjects,
    ToolProposal,
)
from tests.nats.conftest import NatsEnv

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

HOST = "h1"
ALICE = RuntimeContext(principal="alice", tenant="acme", environment="prod")


def _status(operation_id: str, state: str, final: bool) -> OperationStatus:
    return OperationStatus(
        operation_id=operation_id,
        state=state,
        final=final,
        tool="search_documents",
        tool_version="1.0.0",
        attempts=1 if final else 0,
    )


@dataclass
class StandIn:
    """Answers `ops.propose.h1` and `ops.status.h1`; `states` says what status reports."""

    nc: Client
    states: dict[str, OperationStatus] = field(default_factory=dict)
    errors: dict[str, ErrorInfo] = field(default_factory=dict)
    old_errors: dict[str, ErrorInfo] = field(default_factory=dict)
    """Answered as a ledger before the error envelope did: `ProposeReply(error=...)`."""
    status_requests: list[str] = field(default_factory=list)

    async def on_propose(self, message: Msg) -> None:
        reply = ProposeReply(operation_id="op-1", state="ready", created=True)
        await self.nc.publish(message.reply, reply.model_dump_json().encode())

    async def on_status(self, message: Msg) -> None:
        operation_id = StatusRequest.model_validate_json(message.data).operation_id
        self.status_requests.append(operation_id)
        if operation_id in self.errors:  # answered as the service does: the error envelope
            refusal = ErrorEnvelope(error=self.errors[operation_id])
            await self.nc.publish(message.reply, refusal.model_dump_json().encode())
            return
        if operation_id in self.old_errors:
            old = ProposeReply(operation_id=operation_id, error=self.old_errors[operation_id])
            await self.nc.publish(message.reply, old.model_dump_json().encode())
            return
        status = self.states.get(operation_id, _status(operation_id, "ready", False))
        await self.nc.publish(message.reply, status.model_dump_json().encode())

    async def announce(self, operation_id: str) -> None:
        final = _status(operation_id, "succeeded", True)
        self.states[operation_id] = final
        subject = Subjects.outcome(HOST, operation_id)
        await self.nc.publish(subject, final.model_dump_json().encode())


@asynccontextmanager
async def _parties(nats_env: NatsEnv) -> AsyncIterator[tuple[StandIn, AgentHostClient]]:
    async with (
        nats_env.connect(Role.LEDGER, "ledger") as ledger,
        nats_env.connect(Role.HOST, HOST) as host,
    ):
        stand_in = StandIn(ledger.nc)
        await ledger.nc.subscribe(Subjects.propose(HOST), cb=stand_in.on_propose)
        await ledger.nc.subscribe(Subjects.status(HOST), cb=stand_in.on_status)
        await ledger.nc.flush()
        yield stand_in, AgentHostClient(host.nc, HOST, timeout=2, poll_interval=0.3)


def _search(operation_id: str) -> ToolProposal:
    return ToolProposal(
        proposal_id=f"p-{operation_id}",
        conversation_id="c-1",
        requested_by_user_id="u-1",
        operation_id=operation_id,
        tool_name="search_documents",
        arguments={"query": "refund policy"},
    )


async def test_an_outcome_of_its_own_proposal_needs_no_status_request(
    nats_env: NatsEnv,
) -> None:
    async with _parties(nats_env) as (stand_in, client):
        await client.propose(_search("op-1"), ALICE)
        waiting = asyncio.create_task(client.outcome("op-1", timeout=5))
        await asyncio.sleep(0.1)
        await stand_in.announce("op-1")
        status = await waiting
        assert (status.state, status.final) == ("succeeded", True)
        assert stand_in.status_requests == []


async def test_an_outcome_announced_before_it_is_asked_for_is_kept(nats_env: NatsEnv) -> None:
    async with _parties(nats_env) as (stand_in, client):
        await client.propose(_search("op-1"), ALICE)
        await stand_in.announce("op-1")
        await asyncio.sleep(0.1)
        status = await client.outcome("op-1", timeout=5)
        assert status.final
        assert stand_in.status_requests == []


async def test_a_lost_announcement_is_made_up_for_by_asking(nats_env: NatsEnv) -> None:
    async with _parties(nats_env) as (stand_in, client):
        await client.propose(_search("op-1"), ALICE)
        # The operation finishes, but its notice never arrives (core NATS may drop it).
        stand_in.states["op-1"] = _status("op-1", "succeeded", True)
        status = await client.outcome("op-1", timeout=5)
        assert status.final
        assert stand_in.status_requests == ["op-1"]


async def test_an_operation_it_did_not_propose_is_asked_for_first(nats_env: NatsEnv) -> None:
    async with _parties(nats_env) as (stand_in, client):
        stand_in.states["op-old"] = _status("op-old", "succeeded", True)
        status = await client.outcome("op-old", timeout=5)
        assert status.final
        assert stand_in.status_requests == ["op-old"]


async def test_an_error_answer_to_status_is_raised_whatever_its_text(nats_env: NatsEnv) -> None:
    """Told apart from a status by its `error`, not by the keys somewhere in it."""
    async with _parties(nats_env) as (stand_in, client):
        stand_in.errors["op-err"] = ErrorInfo(
            code="OPERATION_NOT_FOUND", category=ErrorCategory.NOT_FOUND,
            message="no such operation", safe_details={"final": False},
        )
        with pytest.raises(RequestRefused) as refused:
            await client.status("op-err")
        assert refused.value.code == "OPERATION_NOT_FOUND"
        stand_in.states["op-ok"] = _status("op-ok", "succeeded", True)
        assert (await client.status("op-ok")).final


async def test_a_status_with_an_error_of_its_own_is_a_status(nats_env: NatsEnv) -> None:
    """A failed operation's status may carry its `error`: that is an answer, not a refusal."""
    async with _parties(nats_env) as (stand_in, client):
        failure = ErrorInfo(code="UPSTREAM_DOWN", category=ErrorCategory.TRANSIENT, message="x")
        stand_in.states["op-failed"] = _status("op-failed", "failed", True).model_copy(
            update={"error": failure}
        )
        status = await client.status("op-failed")
        assert (status.state, status.error) == ("failed", failure)


async def test_a_refusal_from_a_ledger_before_the_error_envelope_is_still_a_refusal(
    nats_env: NatsEnv,
) -> None:
    """An SDK upgraded before its ledger reads the old refusal shape, not a validation error."""
    async with _parties(nats_env) as (stand_in, client):
        stand_in.old_errors["op-old-err"] = ErrorInfo(
            code="OPERATION_NOT_FOUND", category=ErrorCategory.NOT_FOUND, message="no such"
        )
        with pytest.raises(RequestRefused) as refused:
            await client.status("op-old-err")
        assert refused.value.code == "OPERATION_NOT_FOUND"


async def test_on_outcome_hears_each_final_status_as_it_comes(nats_env: NatsEnv) -> None:
    """A host handling outcomes as events: each announcement of its own reaches
    `on_outcome` (a notice that a person is needed is not an outcome), and
    `outcome()` still returns it without asking."""
    heard: list[OperationStatus] = []
    async with _parties(nats_env) as (stand_in, client):
        client = AgentHostClient(client._nc, HOST, timeout=2, poll_interval=0.3,
                                 on_outcome=heard.append)
        await client.listen()
        await stand_in.announce("op-1")  # proposed by another process of this host
        await client.propose(_search("op-2"), ALICE)
        notice = _status("op-2", "needs_resolution", False)
        await stand_in.nc.publish(Subjects.outcome(HOST, "op-2"),
                                  notice.model_dump_json().encode())
        await stand_in.announce("op-2")
        assert (await client.outcome("op-2", timeout=5)).final
        await asyncio.sleep(0.1)
    assert [(s.operation_id, s.state) for s in heard] == [
        ("op-1", "succeeded"), ("op-2", "succeeded")
    ]
    assert stand_in.status_requests == []


def test_an_async_hook_is_refused_rather_than_never_awaited() -> None:
    """Found in review: an `async def` hook was accepted, called, and its coroutine
    never awaited: the host heard nothing."""

    async def heard(status: OperationStatus) -> None:
        pass

    nc = cast("Client", object())
    with pytest.raises(TypeError, match="on_outcome is called, not awaited"):
        AgentHostClient(nc, HOST, on_outcome=heard)
    with pytest.raises(TypeError, match="on_attention is called, not awaited"):
        AgentHostClient(nc, HOST, on_attention=heard)
