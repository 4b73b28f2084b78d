"""The permission matrix, against a real nats-server: each row is (role, action, expected).

A refused row must show both halves of a refusal: the action had no effect
(nothing delivered, stored or fetched, although the setup made sure there was
something to get), and the server reported exactly one permissions violation
naming the expected operation and subject. An allowed row must show the
effect and no violation at all. So no row can pass by merely timing out.

How nats-py surfaces a refusal (nats-py 2.16, nats/aio/client.py `_process_err`,
nats/protocol/parser.py): the server answers `-ERR 'Permissions Violation for
Publish to "<subject>"'` (or `... for Subscription to ...`) and keeps the
connection open; nats-py lowercases that text and passes it to the error
callback as `nats.errors.Error`. The refused publish itself raises nothing, and
a refused request simply gets no answer: `nats.errors.TimeoutError`, not
`NoRespondersError`, because the message never reaches the subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig
from nats.js.errors import NotFoundError

from ledger.nats import Role, flush_all, reply_allowed
from ledger.nats.security import new_user_seed
from schemas import (
    FEED_AUDITOR_CONSUMER,
    FEED_STREAM,
    RESULTS_CONSUMER,
    RESULTS_STREAM,
    WORK_STREAM,
    Subjects,
    work_consumer,
)
from tests.nats.conftest import CALL_TIMEOUT_S, NatsEnv, Probe

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

REFUSAL_WAIT_S = 0.5
"""How long a refused fetch or request waits before it is judged to have got nothing."""
QUIET_S = 0.3
"""How long to watch a subscription for a message that must not arrive."""

SEARCH = "search_documents"
EMAIL = "send_customer_email"


@dataclass
class Ctx:
    """What an action gets: the environment, the actor, a ledger connection, a nonce."""

    env: NatsEnv
    actor: Probe
    ledger: Probe
    nonce: bytes
    helpers: list[Probe]

    @contextlib.asynccontextmanager
    async def other(self, role: Role, name: str) -> AsyncIterator[Probe]:
        """A further connection whose violations the test also checks (there must be none)."""
        async with self.env.connect(role, name) as probe:
            self.helpers.append(probe)
            yield probe


Action = Callable[[Ctx], Awaitable[bool]]


# -- observation helpers --------------------------------------------------------


async def _received(sub: Subscription, nonce: bytes, within: float = QUIET_S) -> bool:
    """Whether a message carrying `nonce` arrives on `sub` within `within` seconds."""
    deadline = asyncio.get_running_loop().time() + within
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        try:
            msg = await sub.next_msg(timeout=left)
        except nats.errors.TimeoutError:
            return False
        if msg.data == nonce:
            return True
    return False


async def _stored(ctx: Ctx, stream: str, subject: str) -> bool:
    """Whether the last message of `subject` in `stream` carries the nonce (ledger reads)."""
    try:
        msg = await ctx.ledger.js.get_last_msg(stream, subject)
    except NotFoundError:
        return False
    return msg.data == ctx.nonce


async def _fetch(probe: Probe, stream: str, consumer: str, nonce: bytes) -> bool:
    """Fetch from an existing consumer, ack what comes (synchronously), and say if `nonce` came.

    `pull_subscribe_bind` looks nothing up: it needs no `$JS.API.CONSUMER.INFO`.
    `ack_sync` waits for the server's confirmation, so an allowed row also proves
    the ack subject (the classic `$JS.ACK.<stream>.<consumer>...` form on 2.15.1).
    """
    sub = await probe.js.pull_subscribe_bind(consumer, stream=stream)
    try:
        try:
            msgs = await sub.fetch(10, timeout=REFUSAL_WAIT_S)
        except nats.errors.TimeoutError:
            return False
        found = False
        for msg in msgs:
            assert msg.reply.startswith(f"$JS.ACK.{stream}.{consumer}.")
            await msg.ack_sync(timeout=CALL_TIMEOUT_S)
            found = found or msg.data == nonce
        return found
    finally:
        await sub.unsubscribe()


async def _js_publish(probe: Probe, subject: str, payload: bytes) -> bool:
    """A JetStream publish; True if a PubAck came back."""
    try:
        await probe.js.publish(subject, payload, timeout=REFUSAL_WAIT_S)
    except nats.errors.TimeoutError:
        return False
    return True


async def _request(probe: Probe, subject: str, payload: bytes) -> bool:
    """A core request; True if the answer echoes `payload`."""
    try:
        reply = await probe.nc.request(subject, payload, timeout=REFUSAL_WAIT_S)
    except nats.errors.TimeoutError:
        return False
    return reply.data == payload


@contextlib.asynccontextmanager
async def _responder(probe: Probe, subject: str, *, check: bool = True) -> AsyncIterator[None]:
    """Answer requests on `subject` by echoing them, as the ledger service would.

    With `check`, only replies `reply_allowed` accepts are answered (what the real
    service must do); without it, any reply subject is answered (the naive service).
    """

    async def answer(msg: Msg) -> None:
        if msg.reply and (not check or reply_allowed(msg.subject, msg.reply)):
            await msg.respond(msg.data)

    sub = await probe.nc.subscribe(subject, cb=answer)
    await flush_all(probe.nc, CALL_TIMEOUT_S)
    try:
        yield
    finally:
        await sub.unsubscribe()


async def _subscription_gets(ctx: Ctx, subject: str, publish: Action) -> bool:
    """The actor subscribes to `subject`; `publish` sends the nonce somewhere it matches."""
    sub = await ctx.actor.nc.subscribe(subject)
    await flush_all(ctx.actor.nc, CALL_TIMEOUT_S)
    await publish(ctx)
    return await _received(sub, ctx.nonce)


async def _core_publish_seen(ctx: Ctx, subject: str, watch: str) -> bool:
    """The actor publishes the nonce to `subject`; does a ledger subscription on `watch` see it?"""
    sub = await ctx.ledger.nc.subscribe(watch)
    await flush_all(ctx.ledger.nc, CALL_TIMEOUT_S)
    await ctx.actor.nc.publish(subject, ctx.nonce)
    await flush_all(ctx.actor.nc, CALL_TIMEOUT_S)
    return await _received(sub, ctx.nonce)


async def _core_publish_stored(ctx: Ctx, subject: str, stream: str) -> bool:
    """The actor publishes the nonce (core NATS) to `subject`; did `stream` store it?"""
    await ctx.actor.nc.publish(subject, ctx.nonce)
    await flush_all(ctx.actor.nc, CALL_TIMEOUT_S)
    return await _stored(ctx, stream, subject)


async def _naive_answer_into_inbox(ctx: Ctx) -> None:
    """Put the nonce on `_INBOX.<nonce>`: a host asks, the (naive) ledger answers there.

    Nobody may publish to `_INBOX.` directly; a reply is the one way a message
    gets there, and it is what a `_INBOX.>` subscriber would be after.
    """
    async with (
        ctx.other(Role.HOST, "h1") as host,
        _responder(ctx.ledger, Subjects.all_proposals(), check=False),
    ):
        reply = f"_INBOX.{ctx.nonce.decode()}"
        await host.nc.publish(Subjects.propose("h1"), ctx.nonce, reply=reply)
        await flush_all(host.nc, CALL_TIMEOUT_S)
        await asyncio.sleep(0.05)  # let the responder's callback run before we look


# -- actions --------------------------------------------------------------------


async def fetch_work(ctx: Ctx, tool: str) -> bool:
    """The ledger queues the nonce for `tool`; the actor fetches from `exec_<tool>`."""
    assert await _js_publish(ctx.ledger, Subjects.work(tool), ctx.nonce)
    return await _fetch(ctx.actor, WORK_STREAM, work_consumer(tool), ctx.nonce)


async def fetch_feed(ctx: Ctx) -> bool:
    """The ledger mirrors an event on the feed; the actor fetches from `feed_auditor`."""
    assert await _js_publish(ctx.ledger, Subjects.feed(SEARCH, "OperationCreated"), ctx.nonce)
    return await _fetch(ctx.actor, FEED_STREAM, FEED_AUDITOR_CONSUMER, ctx.nonce)


async def fetch_results(ctx: Ctx) -> bool:
    """An executor publishes a result; the actor fetches from `ledger_results`."""
    async with ctx.other(Role.EXECUTOR, SEARCH) as executor:
        assert await _js_publish(executor, Subjects.result(SEARCH), ctx.nonce)
    return await _fetch(ctx.actor, RESULTS_STREAM, RESULTS_CONSUMER, ctx.nonce)


async def create_consumer(ctx: Ctx) -> bool:
    """A consumer of its own choosing: with it, one could read any tool's results."""
    name = f"rogue_{ctx.nonce.decode()}"
    config = ConsumerConfig(name=name, durable_name=name, filter_subject=Subjects.result(EMAIL))
    try:
        await ctx.actor.js.add_consumer(RESULTS_STREAM, config, timeout=REFUSAL_WAIT_S)
    except nats.errors.TimeoutError:
        return False
    await ctx.ledger.js.delete_consumer(RESULTS_STREAM, name)
    return True


async def consumer_info(ctx: Ctx, stream: str, consumer: str) -> bool:
    """Look a consumer up (what `pull_subscribe(durable=...)` does first)."""
    try:
        await ctx.actor.js.consumer_info(stream, consumer, timeout=REFUSAL_WAIT_S)
    except nats.errors.TimeoutError:
        return False
    return True


async def stream_info(ctx: Ctx, stream: str) -> bool:
    """Read a stream's configuration and state."""
    try:
        await ctx.actor.nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=REFUSAL_WAIT_S)
    except nats.errors.TimeoutError:
        return False
    return True


async def create_stream(ctx: Ctx) -> bool:
    """Create (and remove again) a stream."""
    name = f"PROBE_{ctx.nonce.decode()}"
    try:
        await ctx.actor.js.add_stream(name=name, subjects=[f"probe.{ctx.nonce.decode()}"])
    except nats.errors.TimeoutError:
        return False
    await ctx.ledger.js.delete_stream(name)
    return True


async def subscribe_all_inboxes(ctx: Ctx) -> bool:
    """Subscribe to `_INBOX.>`: everyone's replies, if it were allowed."""
    return await _subscription_gets(ctx, "_INBOX.>", _as_action(_naive_answer_into_inbox))


def _as_action(fn: Callable[[Ctx], Awaitable[None]]) -> Action:
    async def action(ctx: Ctx) -> bool:
        await fn(ctx)
        return True

    return action


async def subscribe_outcomes(ctx: Ctx, host: str) -> bool:
    """Subscribe to `host`'s outcomes; the ledger announces one."""

    async def announce(c: Ctx) -> bool:
        await c.ledger.nc.publish(Subjects.outcome(host, f"op-{c.nonce.decode()}"), c.nonce)
        await flush_all(c.ledger.nc, CALL_TIMEOUT_S)
        return True

    return await _subscription_gets(ctx, Subjects.all_outcomes(host), announce)


async def subscribe_feed_core(ctx: Ctx) -> bool:
    """Read the feed by a plain subscription, bypassing the auditor consumer."""

    async def mirror(c: Ctx) -> bool:
        return await _js_publish(c.ledger, Subjects.feed(SEARCH, "OperationCreated"), c.nonce)

    return await _subscription_gets(ctx, Subjects.all_feed(), mirror)


async def direct_get_last(ctx: Ctx, stream: str) -> bool:
    """Put the nonce into `stream`, then read it back by a direct get of its last message.

    What `ledger.nats.read_feed` starts with (`{"last_by_subj": ...}`). Only
    `OPS_FEED` allows direct gets; on the other two streams the refusal is the
    permission alone (nobody would answer even if it were let through).
    """
    setups = {
        FEED_STREAM: (Subjects.feed(SEARCH, "OperationCreated"), Subjects.all_feed()),
        WORK_STREAM: (Subjects.work(SEARCH), Subjects.all_work()),
        RESULTS_STREAM: (Subjects.result(SEARCH), Subjects.all_results()),
    }
    subject, last_by = setups[stream]
    if stream == RESULTS_STREAM:
        async with ctx.other(Role.EXECUTOR, SEARCH) as executor:
            assert await _js_publish(executor, subject, ctx.nonce)
    else:
        assert await _js_publish(ctx.ledger, subject, ctx.nonce)
    request = json.dumps({"last_by_subj": last_by}).encode()
    try:
        msg = await ctx.actor.nc.request(
            f"$JS.API.DIRECT.GET.{stream}", request, timeout=REFUSAL_WAIT_S
        )
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return False
    return msg.data == ctx.nonce and msg.headers is not None and msg.headers.get(
        "Nats-Stream"
    ) == stream


async def request_served(ctx: Ctx, subject: str, *, check: bool = True) -> bool:
    """A request the ledger serves, checking the reply subject as it must (`check`).

    Refused rows pass `check=False`: then only the server's permissions can keep
    the answer from coming, not the responder's own check.
    """
    async with _responder(ctx.ledger, subject.rsplit(".", 1)[0] + ".*", check=check):
        return await _request(ctx.actor, subject, ctx.nonce)


async def reply_twice(ctx: Ctx) -> bool:
    """The actor answers one request twice; True if the requester got both answers."""
    async with ctx.other(Role.HOST, "h1") as host:
        inbox = host.nc.new_inbox()
        replies = await host.nc.subscribe(inbox)
        requests = await ctx.actor.nc.subscribe(Subjects.all_proposals())
        await flush_all(ctx.actor.nc, CALL_TIMEOUT_S)
        await host.nc.publish(Subjects.propose("h1"), b"first", reply=inbox)
        request = await requests.next_msg(timeout=CALL_TIMEOUT_S)
        await request.respond(b"first")
        await request.respond(ctx.nonce)
        await flush_all(ctx.actor.nc, CALL_TIMEOUT_S)
        assert await _received(replies, b"first")
        return await _received(replies, ctx.nonce)


async def publish_to_inbox(ctx: Ctx) -> bool:
    """Publish into a host's private inbox without having been asked."""
    async with ctx.other(Role.HOST, "h1") as host:
        sub = await host.nc.subscribe(f"{host.identity.inbox_prefix}.unsolicited")
        await flush_all(host.nc, CALL_TIMEOUT_S)
        await ctx.actor.nc.publish(f"{host.identity.inbox_prefix}.unsolicited", ctx.nonce)
        await flush_all(ctx.actor.nc, CALL_TIMEOUT_S)
        return await _received(sub, ctx.nonce)


# -- the matrix -----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One row: who, doing what, is allowed or refused (and which violation names it)."""

    role: Role
    name: str
    what: str
    action: Action
    allowed: bool
    violation: str | None = None
    """For a refusal: `publish to "<subject>"` or `subscription to "<subject>"` (fnmatch)."""

    @property
    def id(self) -> str:
        verdict = "allowed" if self.allowed else "refused"
        return f"{self.role.value}:{self.name}-{self.what}-{verdict}"


def ok(role: Role, name: str, what: str, action: Action) -> Case:
    """A row that must succeed without any violation."""
    return Case(role, name, what, action, True)


def no(role: Role, name: str, what: str, action: Action, violation: str) -> Case:
    """A row that must have no effect and exactly the violation given."""
    return Case(role, name, what, action, False, violation)


EXEC, HOST, AUDITOR, LEDGER = Role.EXECUTOR, Role.HOST, Role.AUDITOR, Role.LEDGER
OPERATOR, APPROVER = Role.OPERATOR, Role.APPROVER

CASES: list[Case] = [
    # executor of search_documents
    ok(EXEC, SEARCH, "fetch-own-work", lambda c: fetch_work(c, SEARCH)),
    no(EXEC, SEARCH, "fetch-other-tools-work", lambda c: fetch_work(c, EMAIL),
       f'publish to "$js.api.consumer.msg.next.ops_work.{work_consumer(EMAIL)}"'),
    ok(EXEC, SEARCH, "publish-own-result",
       lambda c: _js_publish(c.actor, Subjects.result(SEARCH), c.nonce)),
    no(EXEC, SEARCH, "publish-other-tools-result",
       lambda c: _js_publish(c.actor, Subjects.result(EMAIL), c.nonce),
       f'publish to "{Subjects.result(EMAIL)}"'),
    ok(EXEC, SEARCH, "request-own-lease", lambda c: request_served(c, Subjects.lease(SEARCH))),
    no(EXEC, SEARCH, "request-other-tools-lease",
       lambda c: request_served(c, Subjects.lease(EMAIL), check=False),
       f'publish to "{Subjects.lease(EMAIL)}"'),
    no(EXEC, SEARCH, "read-feed", fetch_feed,
       'publish to "$js.api.consumer.msg.next.ops_feed.feed_auditor"'),
    no(EXEC, SEARCH, "create-consumer", create_consumer,
       'publish to "$js.api.consumer.create.ops_results.rogue_*.ops.result.send_customer_email"'),
    no(EXEC, SEARCH, "look-up-own-consumer",
       lambda c: consumer_info(c, WORK_STREAM, work_consumer(SEARCH)),
       f'publish to "$js.api.consumer.info.ops_work.{work_consumer(SEARCH)}"'),
    no(EXEC, SEARCH, "subscribe-all-inboxes", subscribe_all_inboxes,
       'subscription to "_inbox.>"'),
    no(EXEC, SEARCH, "queue-work-itself",
       lambda c: _core_publish_stored(c, Subjects.work(SEARCH), WORK_STREAM),
       f'publish to "{Subjects.work(SEARCH)}"'),
    no(EXEC, SEARCH, "direct-get-feed", lambda c: direct_get_last(c, FEED_STREAM),
       'publish to "$js.api.direct.get.ops_feed"'),
    # agent host h1
    ok(HOST, "h1", "publish-own-proposal",
       lambda c: _core_publish_seen(c, Subjects.propose("h1"), Subjects.all_proposals())),
    ok(HOST, "h1", "request-own-proposal", lambda c: request_served(c, Subjects.propose("h1"))),
    ok(HOST, "h1", "request-own-status", lambda c: request_served(c, Subjects.status("h1"))),
    ok(HOST, "h1", "request-own-cancel", lambda c: request_served(c, Subjects.cancel("h1"))),
    ok(HOST, "h1", "request-own-tools", lambda c: request_served(c, Subjects.tools("h1"))),
    no(HOST, "h1", "tools-as-another-host",
       lambda c: request_served(c, Subjects.tools("other"), check=False),
       'publish to "ops.tools.other"'),
    no(EXEC, SEARCH, "tools-as-a-host",
       lambda c: request_served(c, Subjects.tools("h1"), check=False),
       'publish to "ops.tools.h1"'),
    no(HOST, "h1", "operate-as-an-operator",
       lambda c: request_served(c, Subjects.operate("ops-lead"), check=False),
       'publish to "ops.operate.ops-lead"'),
    # operator ops-lead: its own request subject, nothing else
    ok(OPERATOR, "ops-lead", "request-own-operate",
       lambda c: request_served(c, Subjects.operate("ops-lead"))),
    no(OPERATOR, "ops-lead", "operate-as-another-operator",
       lambda c: request_served(c, Subjects.operate("other-op"), check=False),
       'publish to "ops.operate.other-op"'),
    no(OPERATOR, "ops-lead", "propose-as-a-host",
       lambda c: request_served(c, Subjects.propose("h1"), check=False),
       'publish to "ops.propose.h1"'),
    no(OPERATOR, "ops-lead", "lease-as-an-executor",
       lambda c: request_served(c, Subjects.lease(SEARCH), check=False),
       f'publish to "{Subjects.lease(SEARCH)}"'),
    no(OPERATOR, "ops-lead", "subscribe-all-inboxes", subscribe_all_inboxes,
       'subscription to "_inbox.>"'),
    no(OPERATOR, "ops-lead", "read-stream-info", lambda c: stream_info(c, FEED_STREAM),
       'publish to "$js.api.stream.info.ops_feed"'),
    # approver lead: its own decision subject, nothing else; nobody else may use it
    ok(APPROVER, "lead", "request-own-approve",
       lambda c: request_served(c, Subjects.approve("lead"))),
    no(APPROVER, "lead", "approve-as-another-approver",
       lambda c: request_served(c, Subjects.approve("other-ap"), check=False),
       'publish to "ops.approve.other-ap"'),
    no(APPROVER, "lead", "operate-as-an-operator",
       lambda c: request_served(c, Subjects.operate("ops-lead"), check=False),
       'publish to "ops.operate.ops-lead"'),
    no(APPROVER, "lead", "propose-as-a-host",
       lambda c: request_served(c, Subjects.propose("h1"), check=False),
       'publish to "ops.propose.h1"'),
    no(APPROVER, "lead", "subscribe-all-inboxes", subscribe_all_inboxes,
       'subscription to "_inbox.>"'),
    no(APPROVER, "lead", "read-stream-info", lambda c: stream_info(c, FEED_STREAM),
       'publish to "$js.api.stream.info.ops_feed"'),
    no(HOST, "h1", "approve-as-an-approver",
       lambda c: request_served(c, Subjects.approve("lead"), check=False),
       'publish to "ops.approve.lead"'),
    no(OPERATOR, "ops-lead", "approve-as-an-approver",
       lambda c: request_served(c, Subjects.approve("lead"), check=False),
       'publish to "ops.approve.lead"'),
    no(EXEC, SEARCH, "approve-as-an-approver",
       lambda c: request_served(c, Subjects.approve("lead"), check=False),
       'publish to "ops.approve.lead"'),
    no(HOST, "h1", "cancel-as-another-host",
       lambda c: request_served(c, Subjects.cancel("other"), check=False),
       'publish to "ops.cancel.other"'),
    no(EXEC, SEARCH, "cancel-as-a-host",
       lambda c: request_served(c, Subjects.cancel("h1"), check=False),
       'publish to "ops.cancel.h1"'),
    ok(HOST, "h1", "request-own-plan", lambda c: request_served(c, Subjects.plan("h1"))),
    no(HOST, "h1", "plan-as-another-host",
       lambda c: request_served(c, Subjects.plan("other"), check=False),
       'publish to "ops.plan.other"'),
    no(APPROVER, "lead", "plan-as-a-host",
       lambda c: request_served(c, Subjects.plan("h1"), check=False),
       'publish to "ops.plan.h1"'),
    ok(HOST, "h1", "subscribe-own-outcomes", lambda c: subscribe_outcomes(c, "h1")),
    no(HOST, "h1", "publish-other-hosts-proposal",
       lambda c: _core_publish_seen(c, Subjects.propose("other"), Subjects.all_proposals()),
       'publish to "ops.propose.other"'),
    no(HOST, "h1", "subscribe-other-hosts-outcomes", lambda c: subscribe_outcomes(c, "other"),
       'subscription to "ops.outcome.other.>"'),
    no(HOST, "h1", "queue-work",
       lambda c: _core_publish_stored(c, Subjects.work(SEARCH), WORK_STREAM),
       f'publish to "{Subjects.work(SEARCH)}"'),
    no(HOST, "h1", "read-stream-info", lambda c: stream_info(c, FEED_STREAM),
       'publish to "$js.api.stream.info.ops_feed"'),
    no(HOST, "h1", "subscribe-all-inboxes", subscribe_all_inboxes,
       'subscription to "_inbox.>"'),
    no(HOST, "h1", "direct-get-feed", lambda c: direct_get_last(c, FEED_STREAM),
       'publish to "$js.api.direct.get.ops_feed"'),
    # auditor
    ok(AUDITOR, "auditor", "fetch-feed", fetch_feed),
    ok(AUDITOR, "auditor", "direct-get-feed", lambda c: direct_get_last(c, FEED_STREAM)),
    no(AUDITOR, "auditor", "direct-get-work", lambda c: direct_get_last(c, WORK_STREAM),
       'publish to "$js.api.direct.get.ops_work"'),
    no(AUDITOR, "auditor", "direct-get-results", lambda c: direct_get_last(c, RESULTS_STREAM),
       'publish to "$js.api.direct.get.ops_results"'),
    no(AUDITOR, "auditor", "read-stream-info", lambda c: stream_info(c, FEED_STREAM),
       'publish to "$js.api.stream.info.ops_feed"'),
    no(AUDITOR, "auditor", "publish-proposal",
       lambda c: _core_publish_seen(c, "ops.propose.x", Subjects.all_proposals()),
       'publish to "ops.propose.x"'),
    no(AUDITOR, "auditor", "publish-work",
       lambda c: _core_publish_stored(c, "ops.exec.x", WORK_STREAM),
       'publish to "ops.exec.x"'),
    no(AUDITOR, "auditor", "publish-feed",
       lambda c: _core_publish_stored(c, "ops.feed.x.y", FEED_STREAM),
       'publish to "ops.feed.x.y"'),
    no(AUDITOR, "auditor", "fetch-work", lambda c: fetch_work(c, SEARCH),
       f'publish to "$js.api.consumer.msg.next.ops_work.{work_consumer(SEARCH)}"'),
    no(AUDITOR, "auditor", "subscribe-feed-directly", subscribe_feed_core,
       'subscription to "ops.feed.>"'),
    # ledger service
    ok(LEDGER, "ledger", "create-stream", create_stream),
    ok(LEDGER, "ledger", "queue-work",
       lambda c: _js_publish(c.actor, Subjects.work(EMAIL), c.nonce)),
    ok(LEDGER, "ledger", "mirror-feed",
       lambda c: _js_publish(c.actor, Subjects.feed(EMAIL, "OperationCreated"), c.nonce)),
    ok(LEDGER, "ledger", "fetch-results", fetch_results),
    no(LEDGER, "ledger", "forge-result",
       lambda c: _js_publish(c.actor, Subjects.result(SEARCH), c.nonce),
       f'publish to "{Subjects.result(SEARCH)}"'),
    no(LEDGER, "ledger", "answer-a-request-twice", reply_twice,
       'publish to "_inbox_host_h1.*"'),
    no(LEDGER, "ledger", "publish-into-host-inbox-unasked", publish_to_inbox,
       'publish to "_inbox_host_h1.unsolicited"'),
    no(LEDGER, "ledger", "subscribe-all-inboxes", subscribe_all_inboxes,
       'subscription to "_inbox.>"'),
]


def test_matrix_has_both_verdicts_for_every_role() -> None:
    """No role is only ever refused or only ever allowed: neither half can pass vacuously."""
    for role in Role:
        verdicts = {case.allowed for case in CASES if case.role is role}
        assert verdicts == {True, False}, role
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids))
    allowed = sum(case.allowed for case in CASES)
    refused = len(CASES) - allowed
    print(f"permission matrix: {len(CASES)} rows ({allowed} allowed, {refused} refused)")


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
async def test_permission(nats_env: NatsEnv, case: Case) -> None:
    """One row of the matrix (see the module docstring for what each verdict requires)."""
    helpers: list[Probe] = []
    with anyio.fail_after(10):
        async with (
            nats_env.connect(case.role, case.name) as actor,
            nats_env.connect(Role.LEDGER, "ledger") as ledger,
        ):
            ctx = Ctx(nats_env, actor, ledger, uuid.uuid4().hex.encode(), helpers)
            effect = await case.action(ctx)
            # A PING/PONG round trip behind everything sent so far: any -ERR the
            # server sent for our operations arrives before the PONG, so the
            # error list is complete afterwards (nats-py runs the error callback
            # in its read loop, before it handles the PONG).
            await flush_all(actor.nc, CALL_TIMEOUT_S)
            await flush_all(ledger.nc, CALL_TIMEOUT_S)
            # A violation does not cost the connection: the server keeps it open.
            assert actor.nc.is_connected
    bystanders = [v for probe in [ledger, *helpers] for v in probe.violations]
    if case.allowed:
        assert effect, f"{case.id}: the action had no effect"
        assert actor.violations == [], actor.violations
    else:
        assert not effect, f"{case.id}: the action took effect although it must be refused"
        assert case.violation is not None
        expected = f"nats: permissions violation for {case.violation}"
        assert len(actor.violations) == 1, actor.violations
        assert fnmatch.fnmatchcase(actor.violations[0], expected), (actor.violations, expected)
    assert bystanders == [], bystanders


async def _messages(ctx: Ctx, stream: str) -> int:
    return int((await ctx.ledger.js.stream_info(stream)).state.messages)


async def _pull_with_reply(ctx: Ctx, stream: str, consumer: str, reply: str) -> None:
    """Ask `consumer` for one message, to be delivered at `reply` (a raw pull request)."""
    await ctx.actor.nc.publish(
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}",
        b'{"batch": 1, "expires": 500000000}',
        reply=reply,
    )


@dataclass(frozen=True)
class Trick:
    """Put something in a stream (`setup`), then try to get it written into `target`."""

    setup: Action
    act: Callable[[Ctx], Awaitable[None]]
    target: str


WORK_INTO_FEED = Trick(
    lambda c: _js_publish(c.ledger, Subjects.work(SEARCH), c.nonce),
    lambda c: _pull_with_reply(c, WORK_STREAM, work_consumer(SEARCH), "ops.feed.x.Injected"),
    FEED_STREAM,
)
PUBACK_INTO_WORK = Trick(
    lambda c: _js_publish(c.ledger, Subjects.work(SEARCH), c.nonce),  # (only to match)
    lambda c: c.actor.nc.publish(Subjects.result(SEARCH), c.nonce, reply=Subjects.work(EMAIL)),
    WORK_STREAM,
)
FEED_INTO_WORK = Trick(
    lambda c: _js_publish(c.ledger, Subjects.feed(SEARCH, "OperationCreated"), c.nonce),
    lambda c: _pull_with_reply(c, FEED_STREAM, FEED_AUDITOR_CONSUMER, Subjects.work(EMAIL)),
    WORK_STREAM,
)
DIRECT_GET_INTO_WORK = Trick(
    lambda c: _js_publish(c.ledger, Subjects.feed(SEARCH, "OperationCreated"), c.nonce),
    lambda c: c.actor.nc.publish(
        f"$JS.API.DIRECT.GET.{FEED_STREAM}", b'{"seq": 1, "batch": 2}', reply=Subjects.work(EMAIL)
    ),
    WORK_STREAM,
)


@pytest.mark.parametrize("legacy", [False, True], ids=["own-account", "control-one-account"])
@pytest.mark.parametrize(
    ("role", "name", "trick"),
    [
        (EXEC, SEARCH, WORK_INTO_FEED),
        (EXEC, SEARCH, PUBACK_INTO_WORK),
        (AUDITOR, "auditor", FEED_INTO_WORK),
        (AUDITOR, "auditor", DIRECT_GET_INTO_WORK),
    ],
    ids=[
        "exec-work-into-feed",
        "exec-puback-into-work",
        "auditor-feed-into-work",
        "auditor-direct-get-into-work",
    ],
)
async def test_a_reply_subject_cannot_write_into_a_stream(
    nats_env: NatsEnv, role: Role, name: str, trick: Trick, legacy: bool
) -> None:
    """The server does not check reply subjects, and JetStream answers at the reply.

    Executors and auditors live in accounts of their own, so whatever reply
    they name, the answer stays in their account, where no stream listens.
    Each action is allowed (no violation); what it must not do is write. The
    control: a twin with the same permissions in the streams' account (the
    layout before accounts) does write, so each row could see a write.
    """
    writes = legacy
    with anyio.fail_after(10):
        async with (
            nats_env.connect(role, name, legacy=legacy) as actor,
            nats_env.connect(Role.LEDGER, "ledger") as ledger,
        ):
            ctx = Ctx(nats_env, actor, ledger, uuid.uuid4().hex.encode(), [])
            assert await trick.setup(ctx)
            before = await _messages(ctx, trick.target)
            await trick.act(ctx)
            await flush_all(actor.nc, CALL_TIMEOUT_S)
            await asyncio.sleep(QUIET_S)
            after = await _messages(ctx, trick.target)
    # A batch of two answers with two messages and an end-of-batch status.
    expected = 3 if trick is DIRECT_GET_INTO_WORK else 1
    assert after == before + (expected if writes else 0)
    assert actor.violations == ledger.violations == []


async def test_each_role_lands_in_its_account_and_only_ledger_has_jetstream(
    nats_env: NatsEnv,
) -> None:
    """What the server itself reports about the accounts (its monitoring endpoints)."""
    expected = {
        (Role.LEDGER, "ledger"): "LEDGER",
        (Role.HOST, "h1"): "LEDGER",
        (Role.EXECUTOR, SEARCH): f"EXEC_{SEARCH}",
        (Role.EXECUTOR, EMAIL): f"EXEC_{EMAIL}",
        (Role.AUDITOR, "auditor"): "AUDIT",
    }
    monitor = nats_env.server.monitor_url
    assert monitor is not None
    async with contextlib.AsyncExitStack() as stack:
        for role, name in expected:
            await stack.enter_async_context(nats_env.connect(role, name))
        connections = json.loads(await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"{monitor}/connz?auth=true", timeout=5).read()))
    accounts = {conn["name"]: conn["account"] for conn in connections["connections"]}
    for (role, name), account in expected.items():
        assert accounts[f"opledger-{role.value}-{name}"] == account
    jsz = json.loads(urllib.request.urlopen(f"{monitor}/jsz?accounts=true", timeout=5).read())
    assert [detail["name"] for detail in jsz["account_details"]] == ["LEDGER"]


async def test_unknown_key_cannot_connect(nats_env: NatsEnv, tmp_path: Path) -> None:
    """A valid NKey the server was not told about is turned away at connect time."""
    seed = tmp_path / "stranger.nk"
    seed.write_bytes(new_user_seed())
    with anyio.fail_after(5), pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
        await nats.connect(
            nats_env.server.url,
            nkeys_seed=str(seed),
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=2,
        )


async def test_reply_subject_is_not_checked_by_the_server(nats_env: NatsEnv) -> None:
    """Why the ledger must check reply subjects itself (`reply_allowed`).

    The server lets a host put any reply subject on its request, and
    `allow_responses` lets the ledger publish its answer there. A naive ledger
    thus publishes, with its own authority, onto another host's outcome
    subject; the checking responder does not.
    """
    nonce = uuid.uuid4().hex.encode()
    forged = Subjects.outcome("other", f"op-{nonce.decode()}")
    with anyio.fail_after(10):
        async with (
            nats_env.connect(Role.LEDGER, "ledger") as ledger,
            nats_env.connect(Role.HOST, "h1") as h1,
            nats_env.connect(Role.HOST, "other") as other,
        ):
            outcomes = await other.nc.subscribe(Subjects.all_outcomes("other"))
            await flush_all(other.nc, CALL_TIMEOUT_S)
            for check, arrives in ((True, False), (False, True)):
                async with _responder(ledger, Subjects.all_proposals(), check=check):
                    await h1.nc.publish(Subjects.propose("h1"), nonce, reply=forged)
                    await flush_all(h1.nc, CALL_TIMEOUT_S)
                    assert await _received(outcomes, nonce) is arrives, f"check={check}"
    assert h1.violations == ledger.violations == other.violations == []


@pytest.mark.parametrize(
    ("subject", "reply", "allowed"),
    [
        ("ops.propose.h1", "_INBOX_host_h1.abc.def", True),
        ("ops.status.h1", "_INBOX_host_h1.abc", True),
        ("ops.lease.search_documents", "_R_.46ToQw.U92lZ6", True),
        ("ops.lease.search_documents", "_INBOX_exec_search_documents.x.y", False),
        ("ops.lease.search_documents", "_R_", False),
        ("ops.lease.search_documents", "_R_.abc.>", False),
        ("ops.lease.search_documents", "ops.exec.send_customer_email", False),
        ("ops.propose.h1", "_R_.46ToQw.U92lZ6", False),
        ("ops.propose.h1", "_INBOX_host_other.abc", False),
        ("ops.propose.h1", "_INBOX_host_h1", False),
        ("ops.propose.h1", "_INBOX_host_h1.", False),
        ("ops.propose.h1", "_INBOX_host_h10.abc", False),
        ("ops.propose.h1", "ops.outcome.other.op-1", False),
        ("ops.propose.h1", "ops.exec.search_documents", False),
        ("ops.propose.h1", "$JS.API.STREAM.DELETE.OPS_FEED", False),
        ("ops.propose.h1", "_INBOX.abc", False),
        ("ops.propose.h1", None, False),
        ("ops.lease.search_documents", "_INBOX_host_search_documents.x", False),
        ("ops.exec.search_documents", "_INBOX_exec_search_documents.x", False),
        ("ops.propose.h1.extra", "_INBOX_host_h1.x", False),
    ],
)
def test_reply_allowed(subject: str, reply: str | None, allowed: bool) -> None:
    """Only the requesting identity's own inbox, or for a lease its import's reply."""
    assert reply_allowed(subject, reply) is allowed
