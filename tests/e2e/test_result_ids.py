"""An executor of one tool cannot make another tool's result disappear.

JetStream deduplicates by `Nats-Msg-Id` across the whole results stream,
every tool's subject. Result IDs used to be `<operation>:<attempt>:<token>`:
predictable, so the executor of another tool could publish first under the
ID of a result yet to come, and the real one was dropped as its duplicate
(the operation ended `outcome_unknown`). Each result ID now ends in a random
nonce.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.client import AgentHostClient
from ledger.nats import connect_as
from schemas import RESULTS_STREAM, RuntimeContext, Subjects, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack

pytestmark = [pytest.mark.nats, pytest.mark.timeout(120)]

ALICE = RuntimeContext(principal="alice", tenant="acme",
                       capabilities=frozenset({"documents:search"}))


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path, "sqlite", hosts=["h1"],
                       tools=["search_documents", "query_orders"]) as running:
        yield running


def test_deduplication_spans_every_tools_results_stream(stack: BackendStack) -> None:
    """The premise, on the real server: the same ID on another tool's subject is dropped."""

    async def scenario() -> tuple[bool, bool]:
        orders = await connect_as(stack.server.url, stack.credentials.executor("query_orders"))
        search = await connect_as(stack.server.url,
                                  stack.credentials.executor("search_documents"))
        try:
            first = await orders.jetstream().publish(
                Subjects.result("query_orders"), b"{}", stream=RESULTS_STREAM,
                headers={"Nats-Msg-Id": "guessed-id"})
            second = await search.jetstream().publish(
                Subjects.result("search_documents"), b"{}", stream=RESULTS_STREAM,
                headers={"Nats-Msg-Id": "guessed-id"})
            return bool(first.duplicate), bool(second.duplicate)
        finally:
            await orders.close()
            await search.close()

    assert asyncio.run(scenario()) == (False, True)


def test_another_tools_executor_cannot_preempt_a_result(stack: BackendStack) -> None:
    """Before: the search result was dropped as a duplicate of the attacker's junk."""
    victim = "victim"

    async def scenario() -> str:
        attacker = await connect_as(stack.server.url,
                                    stack.credentials.executor("query_orders"))
        nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
        host = AgentHostClient(nc, "h1")
        try:
            js = attacker.jetstream()
            # Every ID it could predict, the old form and the new one without the nonce.
            for attempt in (1, 2):
                for token in (1, 2, 3):
                    for guess in (f"h1/{victim}:{attempt}:{token}",
                                  f"search_documents:h1/{victim}:{attempt}:{token}"):
                        await js.publish(Subjects.result("query_orders"), b"junk",
                                         stream=RESULTS_STREAM, headers={"Nats-Msg-Id": guess})
            stack.start_executor("search_documents")
            await host.propose(
                ToolProposal(proposal_id="p", conversation_id="c", requested_by_user_id="alice",
                             tool_name="search_documents", arguments={"query": "refunds"},
                             operation_id=victim),
                ALICE,
            )
            return (await host.outcome(victim, timeout=30)).state
        finally:
            await attacker.close()
            await host.close()

    assert asyncio.run(scenario()) == "succeeded"
