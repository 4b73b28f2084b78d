"""Ack subjects cannot reach another consumer, in either form: the attack matrix on a real server.

An ack subject that reaches a consumer is a command to it, and `+NXT` on it is
a pull request served to the reply subject (nats-server `consumer.go`,
`processAck`). Every consumer listens on both ack forms whatever the feature
flag (`consumer.go`, where it subscribes `ackSubjOld` and `ackSubj`):

- v1 `$JS.ACK.<stream>.<consumer>.*.*.*.*.*` (exactly 9 tokens),
- v2 `$JS.ACK._.<account hash>.<stream>.<consumer>.*.*.*.*.>` (11 or more),

so one server exercises both routes; the flag only decides which form the
server writes into the replies it sends (checked in the last tests here).

Each row: one attacker (an executor, the auditor, or a test-only twin with the
grant as it was before it was pinned), one other consumer as target, one
verb (`+NXT` with `{"batch":1,"no_wait":true}`, `+ACK`, `-NAK`, `+TERM`,
`+WPI`; the server's NAK is `-NAK`). The target's owner first holds one
message (delivered, not acked: its real numbers go into the crafted
subjects) and more wait undelivered; a legitimate publisher keeps adding
messages while the attacker publishes, with its own inbox as reply:

- to the target's routes, both forms (9, 11 and 12 tokens), with the held
  message's numbers, and with the attacker's own stream and consumer names in
  each pair of the five number positions (the old hole is one of these);
- to the attacker's own routes (9 and 11 tokens) with the target's stream and
  consumer names in each pair of the five number positions (allowed: they
  must stay with the attacker's own consumer).

A row passes when every subject routed to the target was refused with its own
permissions violation, nothing came back on those replies, no target data
reached the attacker, the target consumer's counters did not move (but for
the publisher's new messages), and the owner then gets every message exactly
once, first delivery, with the held one still pending. Control rows (the
twins) must show a breach, so the same checks demonstrably fail against the
old grant: for `+NXT` a stolen message; for the others an ack subject of the
target accepted (and, for `-NAK` and `+WPI`, acknowledged by the target).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import nats
import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerInfo

from ledger.nats import NatsServer, Permissions, Role, flush_all, generate_credentials, security
from ledger.nats.security import LEDGER_ACCOUNT, account_hash
from schemas import (
    FEED_AUDITOR_CONSUMER,
    FEED_STREAM,
    RESULTS_CONSUMER,
    RESULTS_STREAM,
    WORK_STREAM,
    Subjects,
    work_consumer,
)
from tests.nats.conftest import AUDITORS, CALL_TIMEOUT_S, TOOLS, NatsEnv, Probe, declare_as_ledger

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

SEARCH, EMAIL = TOOLS
OLD_EXEC = "old_search"
"""A test-only executor whose grant is the one from before the fix."""
OLD_AUDITOR = "old_auditor"
"""A test-only auditor whose grant is the one from before the fix (account `OLD_AUDIT`)."""
LEDGER_HASH = account_hash(LEDGER_ACCOUNT)
QUIET_S = 0.05
"""After the barrier: time for a pull the target served to deliver, before looking."""
SETTLE_S = 1.0
"""At most this long for a consumer's counters to catch up with what was stored."""
NEXT_REQUEST = b'+NXT {"batch":1,"no_wait":true}'
VERBS = {"NXT": NEXT_REQUEST, "ACK": b"+ACK", "NAK": b"-NAK", "TERM": b"+TERM", "WPI": b"+WPI"}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """Module-wide, so the connections below are opened once for all rows."""
    return "asyncio"


# -- the consumers and how the server routes ack subjects to them --------------


@dataclass(frozen=True)
class Consumer:
    """A durable consumer, and how its ack subjects look (the server's two patterns)."""

    stream: str
    name: str

    def v1(self, numbers: tuple[str, ...]) -> str:
        return ".".join(("$JS.ACK", self.stream, self.name, *numbers))

    def v2(self, numbers: tuple[str, ...]) -> str:
        return ".".join(("$JS.ACK", "_", LEDGER_HASH, self.stream, self.name, *numbers))

    def receives(self, subject: str) -> bool:
        """Whether the server routes `subject` to this consumer (consumer.go's patterns)."""
        tokens = subject.split(".")
        if tokens[:2] != ["$JS", "ACK"]:
            return False
        if len(tokens) == 9:
            return tokens[2:4] == [self.stream, self.name]
        return len(tokens) >= 11 and tokens[2:6] == ["_", LEDGER_HASH, self.stream, self.name]

    def __str__(self) -> str:
        return f"{self.stream}/{self.name}"


WORK_SEARCH = Consumer(WORK_STREAM, work_consumer(SEARCH))
WORK_EMAIL = Consumer(WORK_STREAM, work_consumer(EMAIL))
RESULTS = Consumer(RESULTS_STREAM, RESULTS_CONSUMER)
FEED = Consumer(FEED_STREAM, FEED_AUDITOR_CONSUMER)
CONSUMERS = (WORK_SEARCH, WORK_EMAIL, RESULTS, FEED)
# Who legitimately publishes into each consumer's stream, and who reads it.
PUBLISHER = {
    WORK_SEARCH: ((Role.LEDGER, "ledger"), Subjects.work(SEARCH)),
    WORK_EMAIL: ((Role.LEDGER, "ledger"), Subjects.work(EMAIL)),
    RESULTS: ((Role.EXECUTOR, EMAIL), Subjects.result(EMAIL)),
    FEED: ((Role.LEDGER, "ledger"), Subjects.feed(SEARCH, "OperationCreated")),
}
OWNER = {
    WORK_SEARCH: (Role.EXECUTOR, SEARCH),
    WORK_EMAIL: (Role.EXECUTOR, EMAIL),
    RESULTS: (Role.LEDGER, "ledger"),
    FEED: (Role.AUDITOR, "auditor"),
}


@dataclass(frozen=True)
class Attacker:
    role: Role
    name: str
    own: Consumer
    old_grant: bool = False

    @property
    def label(self) -> str:
        return f"{'control-old-grant-' if self.old_grant else ''}{self.role.value}:{self.name}"


ATTACKERS = (
    Attacker(Role.EXECUTOR, SEARCH, WORK_SEARCH),
    Attacker(Role.EXECUTOR, EMAIL, WORK_EMAIL),
    Attacker(Role.AUDITOR, "auditor", FEED),
    Attacker(Role.EXECUTOR, OLD_EXEC, Consumer(WORK_STREAM, work_consumer(OLD_EXEC)), True),
    Attacker(Role.AUDITOR, OLD_AUDITOR, FEED, True),
)


@dataclass(frozen=True)
class Row:
    attacker: Attacker
    target: Consumer
    verb: str

    @property
    def id(self) -> str:
        return f"{self.attacker.label}->{self.target}-{self.verb}"


ROWS = [
    Row(attacker, target, verb)
    for attacker in ATTACKERS
    for target in CONSUMERS
    if target != attacker.own
    for verb in VERBS
]


def crafted_subjects(own: Consumer, target: Consumer, numbers: tuple[str, ...]) -> list[str]:
    """Every ack subject of the row (see the module docstring), without duplicates."""

    def with_pair(pair: tuple[str, str], at: int) -> tuple[str, ...]:
        slots = list(numbers)
        slots[at : at + 2] = pair
        return tuple(slots)

    own_names = (own.stream, own.name)
    target_names = (target.stream, target.name)
    slot_fillings = [numbers, *(with_pair(own_names, at) for at in range(4))]
    subjects = []
    for slots in slot_fillings:
        subjects += [target.v1(slots), target.v2(slots), target.v2((*slots, "1"))]
    for at in range(4):
        subjects += [own.v1(with_pair(target_names, at)), own.v2(with_pair(target_names, at))]
    return list(dict.fromkeys(subjects))


def test_crafted_subjects_cover_both_forms_and_every_open_position() -> None:
    """The generator itself: 15 subjects routed to the target, 8 to the attacker's own
    consumer, the old hole among the first, and the route model agrees with both."""
    numbers = ("1", "7", "3", "1700000000000000000", "2")
    subjects = crafted_subjects(WORK_SEARCH, FEED, numbers)
    to_target = [s for s in subjects if FEED.receives(s)]
    to_own = [s for s in subjects if WORK_SEARCH.receives(s)]
    assert (len(to_target), len(to_own), len(subjects)) == (15, 8, 23)
    assert sorted({len(s.split(".")) for s in to_target}) == [9, 11, 12]
    assert "$JS.ACK.OPS_FEED.feed_auditor.OPS_WORK.exec_search_documents.3.1700000000000000000.2" \
        in to_target
    for crafted in subjects:
        # Each reaches exactly one consumer: the target or the attacker's own.
        assert [c for c in CONSUMERS if c.receives(crafted)] in ([FEED], [WORK_SEARCH])


# -- the environment: real identities, and twins with the old grant --------------


def _old_ack_grant(stream: str, consumer: str) -> tuple[str, str]:
    """`_ack_subjects` as it was: a trailing `>`, and two wildcards in front."""
    return f"$JS.ACK.{stream}.{consumer}.>", f"$JS.ACK.*.*.{stream}.{consumer}.>"


_pinned_permissions_for = security.permissions_for
_pinned_account_of = security.account_of


def _permissions_with_old_grant(role: Role, name: str) -> Permissions:
    perms = _pinned_permissions_for(role, name)
    if name not in (OLD_EXEC, OLD_AUDITOR):
        return perms
    own = (
        (FEED_STREAM, FEED_AUDITOR_CONSUMER)
        if role is Role.AUDITOR
        else (WORK_STREAM, work_consumer(name))
    )
    publish = [s for s in perms.publish if not s.startswith("$JS.ACK.")]
    publish[1:1] = _old_ack_grant(*own)  # where they were: right after the pull subject
    return replace(perms, publish=tuple(publish))


def _account_of_twins(role: Role, name: str) -> str:
    # The twin auditor in an account of its own: the real auditors' AUDIT account
    # must not import the old, wider subjects.
    return "OLD_AUDIT" if name == OLD_AUDITOR else _pinned_account_of(role, name)


ACK_V2_FLAG = "feature_flags { js_ack_fc_v2: true }"
"""nats-server's `FeatureFlagJsAckFormatV2` (server/feature_flags.go): replies in the v2 form."""


@pytest.fixture(scope="module", params=["v1-replies", "v2-replies"])
def ack_env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NatsEnv]:
    """The production accounts block, plus the two twins rendered by the same code
    with the old ack grant (so their exports and imports are the old ones too).

    Twice: the server routes both forms either way, but the flag decides which
    form the owners' own acks (and the numbers in the crafted subjects) take.
    """
    base: Path = tmp_path_factory.mktemp("acks")
    credentials = generate_credentials(base / "creds", hosts=(), tools=TOOLS, auditors=AUDITORS)
    twins = generate_credentials(
        base / "twins", hosts=(), tools=(OLD_EXEC,), auditors=(OLD_AUDITOR,)
    )
    everyone = [
        *credentials.identities,
        *(identity for identity in twins.identities if identity.role is not Role.LEDGER),
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(security, "permissions_for", _permissions_with_old_grant)
        patch.setattr(security, "account_of", _account_of_twins)
        authorization = security.authorization_config(everyone)
    assert '"$JS.ACK.*.*.OPS_WORK.exec_old_search.>"' in authorization
    extra = [ACK_V2_FLAG] if request.param == "v2-replies" else []
    with NatsServer(
        base / "server", authorization=authorization, monitor=False, extra_config=extra
    ) as server:
        asyncio.run(declare_as_ledger(server.url, credentials.ledger))
        yield NatsEnv(server, credentials, twins)


@dataclass
class Connections:
    """One connection per attacker, and one per helper identity (owners, publishers)."""

    attackers: dict[Attacker, Probe] = field(default_factory=dict)
    helpers: dict[tuple[Role, str], Probe] = field(default_factory=dict)


@pytest.fixture(scope="module")
async def connections(ack_env: NatsEnv) -> AsyncIterator[Connections]:
    async with AsyncExitStack() as stack:
        conns = Connections()
        for attacker in ATTACKERS:
            conns.attackers[attacker] = await stack.enter_async_context(
                ack_env.connect(attacker.role, attacker.name, legacy=attacker.old_grant)
            )
        for key in {*OWNER.values(), *(who for who, _ in PUBLISHER.values())}:
            conns.helpers[key] = await stack.enter_async_context(ack_env.connect(*key))
        yield conns


# -- one row ---------------------------------------------------------------------


@dataclass
class Observation:
    """What one attack did; `breaches` lists every sign that it reached the target."""

    to_target: list[str]
    to_own: list[str]
    refused: set[str]
    accepted: list[str] = field(default_factory=list)
    """Subjects routed to the target that the server let through."""
    breaches: list[str] = field(default_factory=list)
    stolen: list[Msg] = field(default_factory=list)


def _counters(info: ConsumerInfo) -> dict[str, int | None]:
    delivered, floor = info.delivered, info.ack_floor
    return {
        "delivered.consumer_seq": delivered.consumer_seq if delivered else None,
        "delivered.stream_seq": delivered.stream_seq if delivered else None,
        "ack_floor.consumer_seq": floor.consumer_seq if floor else None,
        "num_ack_pending": info.num_ack_pending,
        "num_redelivered": info.num_redelivered,
    }


async def _pull(probe: Probe, consumer: Consumer, count: int) -> list[Msg]:
    """Up to `count` messages for `probe` from `consumer`, none waited for.

    A raw `no_wait` pull without `expires`: the server answers at once with what
    it has (and `404 No Messages` if that is less), and leaves no request
    behind that could catch the next row's messages.
    """
    inbox = probe.nc.new_inbox()
    sub = await probe.nc.subscribe(inbox)
    try:
        request = json.dumps({"batch": count, "no_wait": True}).encode()
        await probe.nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{consumer.stream}.{consumer.name}", request, reply=inbox
        )
        got: list[Msg] = []
        while len(got) < count:
            msg = await sub.next_msg(timeout=CALL_TIMEOUT_S)
            if msg.headers and msg.headers.get("Status"):
                break  # 404 No Messages: that was all
            got.append(msg)
        return got
    finally:
        await sub.unsubscribe()


def _refused_subjects(probe: Probe) -> set[str]:
    prefix = 'nats: permissions violation for publish to "'
    return {v[len(prefix) : -1] for v in probe.violations if v.startswith(prefix)}


async def _settled(
    ledger: Probe, consumer: Consumer, ready: Callable[[ConsumerInfo], bool]
) -> ConsumerInfo:
    """The consumer's info once `ready` holds for it, or after `SETTLE_S` anyway.

    A PubAck comes once the stream stored a message; the consumer counts it in
    `num_pending` a moment later, so counters are read once they add up.
    """
    deadline = asyncio.get_running_loop().time() + SETTLE_S
    while True:
        info: ConsumerInfo = await ledger.js.consumer_info(consumer.stream, consumer.name)
        if ready(info) or asyncio.get_running_loop().time() > deadline:
            return info
        await asyncio.sleep(0.005)


async def attack(conns: Connections, row: Row, env_form: str) -> Observation:
    """Set the target up, run the row's attack, observe, and leave the target clean."""
    actor = conns.attackers[row.attacker]
    actor.errors.clear()
    ledger = conns.helpers[(Role.LEDGER, "ledger")]
    owner = conns.helpers[OWNER[row.target]]
    publisher_key, subject = PUBLISHER[row.target]
    publisher = conns.helpers[publisher_key]
    target = row.target
    sent: list[bytes] = []

    async def publish() -> None:
        data = f"{row.id}-{env_form}#{len(sent) + 1}".encode()
        await publisher.js.publish(subject, data, timeout=CALL_TIMEOUT_S)
        sent.append(data)

    start = await ledger.js.consumer_info(target.stream, target.name)
    assert (start.num_pending, start.num_ack_pending) == (0, 0), f"left over: {start}"
    # The target holds one message delivered to its owner (its real numbers go
    # into the crafted subjects) and has more waiting: there is something to
    # steal, ack, nak or terminate.
    for _ in range(3):
        await publish()
    # A PubAck means stored; the consumer counts a message a moment later, and a
    # no_wait pull before that finds nothing (seen under load): wait for all three.
    await _settled(ledger, target, lambda i: i.num_pending == 3)
    (held,) = await _pull(owner, target, 1)
    obs = Observation(to_target=[], to_own=[], refused=set())
    try:
        assert held.data == sent[0]
        assert ack_form(held.reply) == (target, env_form), held.reply
        before = await _settled(ledger, target, lambda i: i.num_pending == 2)
        assert (before.num_ack_pending, before.num_pending) == (1, 2), before
        numbers = tuple(held.reply.split(".")[-5:])
        subjects = crafted_subjects(row.attacker.own, target, numbers)
        assert len({s.lower() for s in subjects}) == len(subjects)
        obs.to_target = [s for s in subjects if target.receives(s)]
        obs.to_own = [s for s in subjects if row.attacker.own.receives(s)]

        # One subscription per crafted subject: a pulled message keeps the
        # subject it was stored under, so only the subscription it came on says
        # which crafted subject it answered.
        inbox = actor.nc.new_inbox()
        replies = [await actor.nc.subscribe(f"{inbox}.{i}") for i in range(len(subjects))]
        await flush_all(actor.nc, CALL_TIMEOUT_S)
        for index, crafted in enumerate(subjects):
            await actor.nc.publish(crafted, VERBS[row.verb], reply=f"{inbox}.{index}")
            if index % 4 == 0:
                # The legitimate publisher keeps going while the attack runs.
                await flush_all(actor.nc, CALL_TIMEOUT_S)
                await publish()
        await flush_all(actor.nc, CALL_TIMEOUT_S)
        # A barrier: the server hands ack subjects to the consumer as it routes
        # them (the attacker's flush is done), and the consumer works through
        # them in order, so once it answers the owner's `+WPI` on the held
        # message it has handled every crafted one routed to it. Only what a
        # pull request delivers comes a moment later.
        await owner.nc.request(held.reply, b"+WPI", timeout=CALL_TIMEOUT_S)
        if row.verb == "NXT":
            await asyncio.sleep(QUIET_S)
        # Whatever the attack did, pending plus ack-pending add up to what is not
        # acked: a steal moves one from the first to the second.
        assert before.num_pending is not None and before.num_ack_pending is not None
        total = before.num_pending + before.num_ack_pending + len(sent) - 3
        after = await _settled(
            ledger,
            target,
            lambda i: cast(int, i.num_pending) + cast(int, i.num_ack_pending) == total,
        )
        answers: list[tuple[int, Msg]] = []
        for index, sub in enumerate(replies):
            while True:
                try:
                    answers.append((index, await sub.next_msg(timeout=0.005)))
                except nats.errors.TimeoutError:
                    break
            await sub.unsubscribe()
        legit = await _pull(owner, target, len(sent))

        obs.refused = _refused_subjects(actor)
        for crafted in obs.to_target:
            if crafted.lower() not in obs.refused:
                obs.accepted.append(crafted)
                obs.breaches.append(f"accepted {crafted}")
        for index, answer in answers:
            crafted = subjects[index]
            if answer.subject != f"{inbox}.{index}":
                # A pulled message: it keeps the subject it was stored under, and
                # its reply (an ack subject) names the consumer that sent it.
                route = "target" if crafted in obs.to_target else "own"
                obs.breaches.append(
                    f"delivered to the attacker in answer to {crafted} ({route} route):"
                    f" {answer.subject} {answer.data!r} reply={answer.reply}"
                    f" refused={crafted.lower() in obs.refused}"
                )
                obs.stolen.append(answer)
            elif crafted in obs.to_target:
                obs.breaches.append(f"answered by {target}: {crafted}")
        was, now = _counters(before), _counters(after)
        moved = {k: (v, now[k]) for k, v in was.items() if now[k] != v}
        if moved:
            obs.breaches.append(f"{target} counters moved: {moved}")
        published_during = len(sent) - 3
        if after.num_pending != before.num_pending + published_during:
            obs.breaches.append(
                f"{target} num_pending {before.num_pending} -> {after.num_pending},"
                f" {published_during} published meanwhile"
            )
        if [m.data for m in legit] != sent[1:]:
            obs.breaches.append(f"owner got {[m.data for m in legit]}, not {sent[1:]}")
        if any(m.metadata.num_delivered != 1 for m in legit):
            obs.breaches.append("owner got a redelivery")
        for msg in legit:
            await msg.ack_sync(timeout=CALL_TIMEOUT_S)
        return obs
    finally:
        # Leave the target as we found it, whatever happened above: the next
        # row starts from nothing pending.
        await held.ack_sync(timeout=CALL_TIMEOUT_S)
        for msg in obs.stolen:
            # Control rows: the ledger may ack anything.
            await ledger.nc.request(msg.reply, b"+ACK", timeout=CALL_TIMEOUT_S)
        for msg in await _pull(owner, target, 100):
            await msg.ack_sync(timeout=CALL_TIMEOUT_S)


def ack_form(reply: str) -> tuple[Consumer | None, str]:
    """The consumer an ack reply the server wrote belongs to, and its form.

    Also what pins the grants to the server: a v2 reply has exactly 11 tokens,
    `_` as domain and our `account_hash(LEDGER)` as account token.
    """
    tokens = reply.split(".")
    consumers: list[Consumer | None] = [c for c in CONSUMERS if c.receives(reply)]
    numeric = all(t.isdigit() for t in tokens[-5:])
    if len(tokens) == 9 and numeric:
        return (consumers or [None])[0], "v1"
    if len(tokens) == 11 and numeric and tokens[2:4] == ["_", LEDGER_HASH]:
        return (consumers or [None])[0], "v2"
    return None, "unknown"


def _form(env: NatsEnv) -> str:
    return "v2" if ACK_V2_FLAG in env.server.config_path.read_text() else "v1"


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
async def test_ack_subjects_cannot_reach_another_consumer(
    connections: Connections, ack_env: NatsEnv, row: Row
) -> None:
    """One row of the attack matrix (see the module docstring)."""
    obs = await asyncio.wait_for(attack(connections, row, _form(ack_env)), timeout=10)
    bystanders = [v for probe in connections.helpers.values() for v in probe.violations]
    assert bystanders == []
    if row.attacker.old_grant:
        # The control: the same checks catch the old grant. It lets exactly the
        # old hole through, the target's v1 route with the attacker's own names
        # where the delivery count and stream sequence go...
        own = row.attacker.own
        assert [(len(s.split(".")), s.split(".")[4:6]) for s in obs.accepted] == [
            (9, [own.stream, own.name])
        ], obs.breaches
        # ...and what the target does with it shows: a pull served to the
        # attacker, a NAK or progress acknowledged to it. (+ACK and +TERM then
        # carry no usable sequence, so only their acceptance shows.)
        if row.verb == "NXT":
            assert len(obs.stolen) == 1, obs.breaches
            assert any("counters moved" in b for b in obs.breaches), obs.breaches
        if row.verb in ("NAK", "WPI"):
            assert any(b.startswith("answered by") for b in obs.breaches), obs.breaches
        return
    assert obs.breaches == []
    # Exactly the subjects routed to the target were refused, each with its own
    # violation; those routed to the attacker's own consumer were not.
    assert obs.refused == {s.lower() for s in obs.to_target}
    assert len(connections.attackers[row.attacker].violations) == len(obs.to_target)


OWN = [attacker for attacker in ATTACKERS if not attacker.old_grant]


@pytest.mark.parametrize("attacker", OWN, ids=[a.label for a in OWN])
async def test_own_pull_and_ack_still_work(
    connections: Connections, ack_env: NatsEnv, attacker: Attacker
) -> None:
    """The control the other way: each role still pulls and acks its own consumer,
    the way production code does (`pull_subscribe_bind`, `ack_sync`), in the
    form the server uses, and the consumer's ack floor moves."""
    probe = connections.attackers[attacker]
    probe.errors.clear()
    ledger = connections.helpers[(Role.LEDGER, "ledger")]
    own = attacker.own
    subject = Subjects.work(attacker.name) if own is not FEED else Subjects.feed(SEARCH, "Own")
    data = f"own-{attacker.label}-{_form(ack_env)}".encode()
    await ledger.js.publish(subject, data, timeout=CALL_TIMEOUT_S)
    before = await ledger.js.consumer_info(own.stream, own.name)
    sub = await probe.js.pull_subscribe_bind(own.name, stream=own.stream)
    try:
        (msg,) = await sub.fetch(1, timeout=CALL_TIMEOUT_S)
        assert msg.data == data
        assert ack_form(msg.reply) == (own, _form(ack_env)), msg.reply
        await msg.ack_sync(timeout=CALL_TIMEOUT_S)
    finally:
        await sub.unsubscribe()
    after = await ledger.js.consumer_info(own.stream, own.name)
    assert after.ack_floor is not None and before.ack_floor is not None
    assert after.ack_floor.stream_seq > before.ack_floor.stream_seq
    assert (after.num_ack_pending, after.num_pending) == (0, 0)
    await flush_all(probe.nc, CALL_TIMEOUT_S)
    assert probe.violations == []


async def test_v2_reply_names_the_global_accounts_hash(tmp_path: Path) -> None:
    """`account_hash` against the server for a second account (`$G`, a server without users)."""
    with NatsServer(tmp_path / "plain", monitor=False, extra_config=[ACK_V2_FLAG]) as server:
        nc = await nats.connect(server.url, allow_reconnect=False, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=CALL_TIMEOUT_S)
            await js.add_stream(name="S", subjects=["s"])
            await js.add_consumer("S", durable_name="c", ack_policy=AckPolicy.EXPLICIT)
            await js.publish("s", b"x")
            sub = await js.pull_subscribe_bind("c", stream="S")
            (msg,) = await sub.fetch(1, timeout=CALL_TIMEOUT_S)
            assert msg.reply.split(".")[:6] == ["$JS", "ACK", "_", account_hash("$G"), "S", "c"]
            assert len(msg.reply.split(".")) == 11
        finally:
            await nc.close()


def test_matrix_size() -> None:
    """Printed for the record; the controls are one in three rows or more."""
    controls = sum(row.attacker.old_grant for row in ROWS)
    per_row = len(crafted_subjects(WORK_SEARCH, FEED, ("1",) * 5))
    print(f"ack route matrix: {len(ROWS)} rows ({len(ROWS) - controls} pinned, {controls}"
          f" controls), {per_row} crafted subjects each")
    assert len(ROWS) == 16 * len(VERBS)
