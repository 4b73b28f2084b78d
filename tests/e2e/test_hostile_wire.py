"""Nothing a host sends over the wire can stall the pipeline or fail another's proposal.

A real nats-server, the ledger service process on each storage backend and a
search executor process. Each attack is checked by what the other hosts and
the feed then see: their proposals answered and run, the feed still carrying
every stored event. And existence does not leak: one host's IDs are not
another's, one tool's operations are invisible to another tool's executors.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger import OperationNotFound
from ledger.client import AgentHostClient
from ledger.nats import connect_as
from ledger.server.relay import SET_ASIDE_TABLE
from policy.catalog import CATALOG_DIR
from schemas import (
    FEED_STREAM,
    LeaseRequest,
    ProposeReply,
    RuntimeContext,
    StatusRequest,
    Subjects,
    ToolProposal,
)
from tests.e2e.conftest import BackendStack, backend_stack
from tests.feed import feed_messages
from tests.hostile import hostile_json_text, hostile_names, python_values

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

HOSTS = ("h1", "h2")
TOOLS = ("search_documents", "send_customer_email")
ALICE = RuntimeContext(principal="alice", tenant="acme",
                       capabilities=frozenset({"documents:search", "email:send"}))
CONTEXT = {"principal": "alice", "tenant": "acme", "capabilities": ["documents:search"]}
_IDS = itertools.count()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def wire(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[BackendStack]:
    home = tmp_path_factory.mktemp(f"wire-{request.param}")
    # The sample contracts, with search's rate limit lifted: these tests send hundreds.
    contracts = home / "contracts"
    shutil.copytree(CATALOG_DIR, contracts, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    search = contracts / "search_documents.yaml"
    search.write_text(search.read_text().replace(
        "max_per_hour: 600\n  max_per_minute: 30", "max_per_hour: 1000000\n  max_per_minute: 100000"
    ))
    with backend_stack(
        home, request.param, hosts=HOSTS, tools=TOOLS, contracts=contracts,
        service_options=["--ack-wait", "2", "--lease-grace", "1", "--redispatch-after", "0"],
    ) as stack:
        stack.start_executor("search_documents", "--batch", "8")
        yield stack


def _envelope(tool: str = "search_documents", arguments: Any = None, *,
              operation_id: str | None = None) -> dict[str, Any]:
    return {
        "proposal": {
            "proposal_id": "p", "conversation_id": "c", "requested_by_user_id": "alice",
            "tool_name": tool,
            "arguments": {"query": "refund policy"} if arguments is None else arguments,
            "operation_id": operation_id or f"w-{next(_IDS)}",
        },
        "context": CONTEXT,
    }


async def _ask(nc: Any, host: str, payload: bytes) -> dict[str, Any]:
    reply = await nc.request(Subjects.propose(host), payload, timeout=10)
    answer: dict[str, Any] = orjson.loads(reply.data)
    ProposeReply.model_validate(answer)  # every answer is a documented reply
    return answer


async def _feed_has(wire: BackendStack, operation_id: str, version: int) -> bool:
    """Whether event `version` of `operation_id` reaches the feed within 10 s."""
    nc = await connect_as(wire.server.url, wire.credentials.ledger)
    try:
        for _ in range(25):
            messages = await feed_messages(nc.jetstream(), quiet_s=0.3)
            if any(m.headers.get("Nats-Msg-Id") == f"{operation_id}:{version}" for m in messages):
                return True
            await asyncio.sleep(0.1)
        return False
    finally:
        await nc.close()


async def _normal_runs(wire: BackendStack, host: AgentHostClient) -> None:
    """A normal proposal is answered, runs, and its events reach the feed promptly."""
    operation_id = f"normal-{next(_IDS)}"
    reply = await host.propose(
        ToolProposal(proposal_id="p", conversation_id="c", requested_by_user_id="alice",
                     tool_name="search_documents", arguments={"query": "refund policy"},
                     operation_id=operation_id),
        ALICE,
    )
    assert reply.state == "ready"
    assert (await host.outcome(operation_id, timeout=10)).state == "succeeded"
    assert await _feed_has(wire, f"h1/{operation_id}", 3)


def _run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_tool_names_that_are_not_subject_tokens_are_refused_and_nothing_stalls(
    wire: BackendStack,
) -> None:
    """Before: stored (Proposed, Rejected), then the relay failed on the subject forever;
    a normal proposal after it only ran through the 60 s redispatch sweep, and the feed
    and outcome notices stopped for everyone."""

    async def scenario() -> None:
        nc = await connect_as(wire.server.url, wire.credentials.host("h1"))
        host = AgentHostClient(nc, "h1")
        try:
            for name in ("../etc/passwd", "a.b", "ops.exec.x", "a b", "*"):
                answer = await _ask(nc, "h1", orjson.dumps(_envelope(name, operation_id="bad")))
                assert answer["error"]["code"] == "INVALID_MESSAGE", answer
                paths = [e["path"] for e in answer["error"]["safe_details"]["errors"]]
                assert paths == ["/proposal/tool_name"]
            await _normal_runs(wire, host)
        finally:
            await host.close()

    _run(scenario())
    ledger = wire.ledger()
    try:
        with pytest.raises(OperationNotFound):
            ledger.get("h1/bad")
    finally:
        ledger.close()


def _raw_request(subject: bytes, reply: bytes, body: bytes, headers: bytes = b"") -> bytes:
    """A request as a sender's own socket may write it (nats-py cannot encode these)."""
    if not headers:
        return b"PUB %s %s %d\r\n%s\r\n" % (subject, reply, len(body), body)
    return b"HPUB %s %s %d %d\r\n%s%s\r\n" % (
        subject, reply, len(headers), len(headers) + len(body), headers, body
    )


def test_a_request_nats_cannot_decode_is_dropped_and_nothing_stops(wire: BackendStack) -> None:
    """A reply subject or a header status line that is not UTF-8, from a host on its own
    status subject and from an executor on its lease subject: the server passes them
    through as they are. Before, one of them ended the service's NATS read loop (in
    nats-py), and nothing was answered, leased or recorded for about six minutes. Now
    each is dropped, and requests sent right after it are answered and run."""

    async def scenario() -> None:
        nc = await connect_as(wire.server.url, wire.credentials.host("h1"))
        host = AgentHostClient(nc, "h1")
        attacker = await connect_as(wire.server.url, wire.credentials.host("h2"))
        executor = await connect_as(
            wire.server.url, wire.credentials.executor("search_documents")
        )
        status = b'{"operation_id":"x"}'
        lease = b'{"operation_id":"h1/x","executor":"e"}'
        inbox = attacker.new_inbox().encode()
        attacks = (
            (attacker, _raw_request(b"ops.status.h2", b"_INBOX.\xff\xfe", status)),
            (attacker, _raw_request(b"ops.status.h2", inbox, status, b"NATS/1.0 \xff\xfe\r\n\r\n")),
            (executor, _raw_request(b"ops.lease.search_documents",
                                    executor.new_inbox().encode(), lease,
                                    b"NATS/1.0 \xff\xfe\r\n\r\n")),
        )
        try:
            await _normal_runs(wire, host)  # the control: it runs before
            for sender, raw in attacks:
                assert sender._transport is not None
                sender._transport.write(raw)  # the attacker's own bytes, as sent
                await sender.flush()
                await _normal_runs(wire, host)  # and right after each attack
            # The attacker's own next, well-formed request is answered as well.
            reply = await attacker.request(
                Subjects.status("h2"), StatusRequest(operation_id="nobody").model_dump_json()
                .encode(), timeout=10,
            )
            assert orjson.loads(reply.data)["error"]["code"] == "OPERATION_NOT_FOUND"
        finally:
            await host.close()
            await attacker.close()
            await executor.close()

    _run(scenario())


def test_text_with_control_characters_in_the_context_is_refused(wire: BackendStack) -> None:
    """Before, on PostgreSQL: `"principal": "a\u0000b"` was stored, then the view's TEXT
    column refused it on every catch-up, and the relay, the sweeps and every
    rate-limited proposal of every host stopped, across restarts."""

    async def scenario() -> None:
        nc = await connect_as(wire.server.url, wire.credentials.host("h2"))
        host = AgentHostClient(await connect_as(wire.server.url, wire.credentials.host("h1")),
                               "h1")
        try:
            # JSON escapes, as a host in another language would send them.
            for field, value in (("principal", r"a\u0000b"), ("tenant", r"acme\u0000"),
                                 ("principal", r"line\nbreak")):
                envelope = _envelope(operation_id="nul")
                text = orjson.dumps(envelope).decode().replace(
                    f'"{field}":"{CONTEXT[field]}"', f'"{field}":"{value}"'
                )
                answer = await _ask(nc, "h2", text.encode())
                assert answer["error"]["code"] == "INVALID_MESSAGE", answer
                paths = [e["path"] for e in answer["error"]["safe_details"]["errors"]]
                assert paths == [f"/context/{field}"]
            await _normal_runs(wire, host)
        finally:
            await nc.close()
            await host.close()

    _run(scenario())


def test_a_proposal_just_under_the_message_limit_is_a_finding(wire: BackendStack) -> None:
    """Before: rejected for `length` but stored in full; its feed record was over the
    limit and the relay failed with MaxPayloadError forever."""

    async def scenario() -> None:
        nc = await connect_as(wire.server.url, wire.credentials.host("h1"))
        host = AgentHostClient(nc, "h1")
        try:
            shell = orjson.dumps(_envelope(arguments="", operation_id="near-limit"))
            size = nc.max_payload - 700 - len(shell)
            text = '{"query": "' + "q" * (size - 14) + '"}'
            payload = orjson.dumps(_envelope(arguments=text, operation_id="near-limit"))
            assert nc.max_payload - 800 < len(payload) <= nc.max_payload - 600
            answer = await _ask(nc, "h1", payload)
            assert answer["state"] == "rejected"
            assert [i["code"] for i in answer["decision"]["issues"]] == ["too_large"]
            await _normal_runs(wire, host)
        finally:
            await host.close()

    _run(scenario())
    ledger = wire.ledger()
    try:
        stored = sum(len(r[4]) for r in ledger.stored_rows() if r[1] == "h1/near-limit")
        assert 0 < stored < 32 * 1024
    finally:
        ledger.close()


def test_a_huge_integer_fails_only_its_own_proposal(wire: BackendStack) -> None:
    """Before: `TypeError: Integer exceeds 64-bit range` failed the whole batch: 40 of 40
    normal proposals sent beside it were answered LEDGER_UNAVAILABLE (retryable, and yet
    they would never succeed)."""

    async def scenario() -> list[dict[str, Any]]:
        nc = await connect_as(wire.server.url, wire.credentials.host("h2"))
        try:
            normal = [orjson.dumps(_envelope()) for _ in range(40)]
            poison = json.dumps(_envelope(arguments={"query": "ab", "top_k": 2**70})).encode()
            payloads = [*normal[:20], poison, *normal[20:]]
            return list(await asyncio.gather(*(_ask(nc, "h2", p) for p in payloads)))
        finally:
            await nc.close()

    answers = _run(scenario())
    assert [a["state"] for a in answers[:20] + answers[21:]] == ["ready"] * 40
    assert [i["code"] for i in answers[20]["decision"]["issues"]] == ["number_out_of_range"]


def test_a_host_flooding_the_ledger_slows_down_itself_alone(wire: BackendStack) -> None:
    """Before: every host's requests shared one queue in arrival order, so h2's came
    after all of h1's and timed out. Now requests start one requester after another,
    and a requester with too many waiting is answered LEDGER_BUSY at once."""
    flood = 12_000

    async def scenario() -> tuple[dict[str, int], list[float]]:
        h1 = await connect_as(wire.server.url, wire.credentials.host("h1"))
        h2 = await connect_as(wire.server.url, wire.credentials.host("h2"))
        answers: dict[str, int] = {}
        done = asyncio.Event()

        async def answered(msg: Any) -> None:
            body = orjson.loads(msg.data)
            key = body["error"]["code"] if body.get("error") else body["state"]
            answers[key] = answers.get(key, 0) + 1
            if sum(answers.values()) == flood:
                done.set()

        try:
            inbox = h1.new_inbox()  # one reply subject per request, as a client makes them
            await h1.subscribe(f"{inbox}.*", cb=answered, pending_msgs_limit=flood * 2)
            for n in range(flood):  # all at once, none waited for
                await h1.publish(Subjects.propose("h1"), orjson.dumps(_envelope()),
                                 reply=f"{inbox}.{n}")
            await h1.flush()
            latencies: list[float] = []
            # h2 as a host is written: the SDK, its 5 s timeout and its retries of the
            # same operation ID. Its calls must succeed, not merely be answered.
            host = AgentHostClient(h2, "h2")
            for _ in range(15):
                started = asyncio.get_running_loop().time()
                body = _envelope()
                reply = await host.propose(
                    ToolProposal.model_validate(body["proposal"]),
                    RuntimeContext.model_validate(body["context"]),
                )
                latencies.append(asyncio.get_running_loop().time() - started)
                assert reply.state == "ready", reply
                await asyncio.sleep(0.05)
            await asyncio.wait_for(done.wait(), timeout=120)
            return answers, latencies
        finally:
            await h1.close()
            await h2.close()

    answers, latencies = _run(scenario())
    # Figures, not a timed assertion (speed is the benchmarks' business): measured
    # here up to 1 s on SQLite and 3-7 s on PostgreSQL for h2's first call, while
    # the flood's 12,000 requests are still being read; before, h2's calls came
    # after all of h1's and failed even with the SDK's retries.
    print(f"flood answers {answers}; h2 latencies max {max(latencies):.2f} s")
    assert set(answers) <= {"ready", "LEDGER_BUSY"} and answers.get("LEDGER_BUSY", 0) > 0


def test_one_hosts_operation_ids_are_not_another_hosts(wire: BackendStack) -> None:
    """Before: h2 proposing under an ID h1 used got OPERATION_CONFLICT, and so learned
    that the ID was taken; status deliberately hides exactly that."""

    async def scenario() -> None:
        h1 = await connect_as(wire.server.url, wire.credentials.host("h1"))
        h2 = await connect_as(wire.server.url, wire.credentials.host("h2"))
        try:
            first = await _ask(h1, "h1", orjson.dumps(_envelope(operation_id="mine")))
            theirs = _envelope(arguments={"query": "other words"}, operation_id="mine")
            second = await _ask(h2, "h2", orjson.dumps(theirs))
            assert (first["operation_id"], first["created"], first["error"]) == ("mine", True, None)
            assert (second["operation_id"], second["created"], second["error"]) == (
                "mine", True, None
            )
            # h2 asking about an ID only h1 used, and about one nobody used: the same answer.
            only_h1 = await _ask(h1, "h1", orjson.dumps(_envelope(operation_id="only-h1")))
            assert only_h1["created"]

            async def status(operation_id: str) -> bytes:
                body = StatusRequest(operation_id=operation_id).model_dump_json().encode()
                reply = await h2.request(Subjects.status("h2"), body, timeout=5)
                return bytes(reply.data).replace(operation_id.encode(), b"<id>")

            assert await status("only-h1") == await status("nobody-used")
            assert b"OPERATION_NOT_FOUND" in await status("only-h1")
        finally:
            await h1.close()
            await h2.close()

    _run(scenario())


def test_a_lease_for_another_tools_operation_looks_like_one_for_a_made_up_id(
    wire: BackendStack,
) -> None:
    """Before: `refused` for another tool's operation, OPERATION_NOT_FOUND for a made-up
    ID: an executor could tell which IDs other tools' operations have."""

    async def scenario() -> None:
        host = await connect_as(wire.server.url, wire.credentials.host("h1"))
        mail = await connect_as(wire.server.url, wire.credentials.executor("send_customer_email"))
        try:
            await _ask(host, "h1", orjson.dumps(_envelope(operation_id="searched")))

            async def lease(operation_id: str) -> bytes:
                body = LeaseRequest(operation_id=operation_id, executor="mail-1")
                reply = await mail.request(Subjects.lease("send_customer_email"),
                                           body.model_dump_json().encode(), timeout=5)
                return bytes(reply.data).replace(operation_id.encode(), b"<id>")

            foreign, made_up = await lease("h1/searched"), await lease("h1/never-used")
            assert foreign == made_up
            assert b"OPERATION_NOT_FOUND" in foreign
        finally:
            await host.close()
            await mail.close()

    _run(scenario())


_ENVELOPES = st.one_of(
    st.builds(lambda args: ("api", args), python_values()),
    st.builds(lambda text: ("text", text), hostile_json_text()),
    st.builds(lambda name: ("tool", name), hostile_names()),
    st.builds(lambda name: ("id", name), hostile_names()),
    st.builds(lambda name: ("principal", name), hostile_names()),
    st.builds(lambda name: ("tenant", name), hostile_names()),
    st.builds(lambda data: ("bytes", data), st.binary(max_size=64)),
)


def _hostile_payload(kind: str, value: Any) -> bytes | None:
    """What a careless or hostile host would put on the wire; None if unsendable."""
    if kind == "bytes":
        return bytes(value)
    if kind == "tool":
        envelope = _envelope(value)
    elif kind == "id":
        envelope = _envelope(operation_id=value)
    elif kind in ("principal", "tenant"):
        envelope = _envelope()
        envelope["context"] = {**CONTEXT, kind: value}
    elif kind == "text":
        envelope = _envelope(arguments=value)
    else:
        envelope = _envelope(arguments={"query": "refunds", "x": value})
    try:
        # The standard library writes what orjson refuses: huge integers, NaN, surrogates.
        return json.dumps(envelope, allow_nan=True).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, RecursionError):
        return None


def test_property_nothing_a_host_sends_fails_another_hosts_proposal(wire: BackendStack) -> None:
    """Hypothesis over the wire: each example sends hostile messages from h2 at the same
    moment as normal proposals from h1. Every message gets a documented answer in time;
    every normal proposal is stored and answered `ready`; afterwards every normal one has
    succeeded and the feed carries every stored event (nothing set aside)."""
    loop = asyncio.new_event_loop()
    normal_ids: list[str] = []

    async def connect() -> tuple[Any, Any]:
        return (await connect_as(wire.server.url, wire.credentials.host("h1")),
                await connect_as(wire.server.url, wire.credentials.host("h2")))

    h1, h2 = loop.run_until_complete(connect())

    async def example(hostile: list[tuple[str, Any]]) -> None:
        sends = []
        for kind, value in hostile:
            payload = _hostile_payload(kind, value)
            if payload is not None and len(payload) <= h2.max_payload:
                sends.append(_ask(h2, "h2", payload))
        ids = [f"prop-{next(_IDS)}" for _ in range(2)]
        normal_ids.extend(ids)
        normal = [_ask(h1, "h1", orjson.dumps(_envelope(operation_id=i))) for i in ids]
        answers = await asyncio.gather(*normal, *sends)
        assert [(a["state"], a["created"]) for a in answers[:2]] == [("ready", True)] * 2
        for answer in answers[2:]:
            assert (answer["error"] is None) != (answer["decision"] is None) or (
                answer["error"] is None and answer["created"] is False
            ), answer

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(_ENVELOPES, min_size=1, max_size=4))
    def property_(hostile: list[tuple[str, Any]]) -> None:
        loop.run_until_complete(example(hostile))

    try:
        property_()
        client = AgentHostClient(h1, "h1")
        for operation_id in normal_ids:
            status = loop.run_until_complete(client.outcome(operation_id, timeout=30))
            assert status.state == "succeeded", (operation_id, status)
    finally:
        loop.run_until_complete(h1.close())
        loop.run_until_complete(h2.close())
        loop.close()
    ledger = wire.ledger()
    try:
        stored = {(row[1], row[2]) for row in ledger.stored_rows()}
        assert ledger.db.query(f"SELECT COUNT(*) FROM {SET_ASIDE_TABLE}")[0][0] == 0
    finally:
        ledger.close()
    assert _run(_feed_keys(wire, len(stored))) >= stored


async def _feed_keys(wire: BackendStack, expected: int) -> set[tuple[str, int]]:
    """Every (operation, version) on the feed, once the relay has caught up."""
    nc = await connect_as(wire.server.url, wire.credentials.ledger)
    try:
        js = nc.jetstream()
        for _ in range(50):
            if (await js.stream_info(FEED_STREAM)).state.messages >= expected:
                break
            await asyncio.sleep(0.2)
        records = [orjson.loads(msg.data) for msg in await feed_messages(js)]
        return {(record["operation_id"], record["version"]) for record in records}
    finally:
        await nc.close()
