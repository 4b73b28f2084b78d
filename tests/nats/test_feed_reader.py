"""`read_feed` against a real server, as the auditor identity: order, batches, gaps, errors."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from ledger.nats import (
    FeedAccessDenied,
    FeedMessage,
    FeedReadError,
    FeedReadTimeout,
    NatsServer,
    Role,
    connect_as,
    generate_credentials,
    read_feed,
)
from ledger.nats.feed_reader import MAX_BATCH
from schemas import FEED_STREAM, Subjects
from tests.nats.conftest import CALL_TIMEOUT_S, NatsEnv, Probe, declare_as_ledger

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


def _record(n: int, tag: str) -> tuple[str, dict[str, str], bytes]:
    """A feed record as the relay publishes it: subject, `Nats-Msg-Id`, JSON body."""
    operation = f"h1/op-{tag}-{n}"
    body = {
        "position": n,
        "operation_id": operation,
        "version": 1,
        "type": "OperationCreated",
        "event_hash": f"{n:064x}",
        "prev_hash": None,
        "event": {"n": n},
    }
    headers = {"Nats-Msg-Id": f"{operation}:1"}
    return Subjects.feed("search_documents", "OperationCreated"), headers, json.dumps(body).encode()


async def _publish_records(ledger: Probe, count: int, tag: str) -> list[tuple[int, str, bytes]]:
    """Publish `count` records; (stream sequence, message ID, body) of each."""
    stored = []
    for n in range(1, count + 1):
        subject, headers, body = _record(n, tag)
        ack = await ledger.js.publish(subject, body, headers=headers, timeout=CALL_TIMEOUT_S)
        stored.append((ack.seq, headers["Nats-Msg-Id"], body))
    return stored


async def _collect(it: AsyncIterator[FeedMessage]) -> list[FeedMessage]:
    return [message async for message in it]


class _CountingPublish:
    """Wraps a client's `publish` to record every direct get `read_feed` sends."""

    def __init__(self, publish: Any) -> None:
        self.publish = publish
        self.requests: list[dict[str, Any]] = []

    async def __call__(self, subject: str, payload: bytes = b"", **kwargs: Any) -> None:
        if subject == f"$JS.API.DIRECT.GET.{FEED_STREAM}":
            self.requests.append(json.loads(payload))
        await self.publish(subject, payload, **kwargs)


async def test_reads_every_stored_message_in_order_across_batches_and_gaps(
    nats_env: NatsEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More messages than one batch; deleted ones (the first of a batch, one inside,
    and the newest) are skipped; headers and bodies come back as published."""
    with anyio.fail_after(20):
        async with (
            nats_env.connect(Role.LEDGER, "ledger") as ledger,
            nats_env.connect(Role.AUDITOR, "auditor") as auditor,
        ):
            stored = await _publish_records(ledger, 11, "gaps")
            first = stored[0][0]
            deleted = {first + 4, first + 6, first + 10}  # a batch start, inside, the newest
            for seq in sorted(deleted):
                assert await ledger.js.delete_msg(FEED_STREAM, seq)
            counting = _CountingPublish(auditor.nc.publish)
            monkeypatch.setattr(auditor.nc, "publish", counting)
            got = await _collect(read_feed(auditor.nc, start_seq=first, batch=4, timeout=2))
            assert auditor.violations == []
    expected = [
        FeedMessage(seq, Subjects.feed("search_documents", "OperationCreated"), msg_id, body)
        for seq, msg_id, body in stored
        if seq not in deleted
    ]
    assert got == expected
    assert [json.loads(m.data)["position"] for m in got] == [1, 2, 3, 4, 6, 8, 9, 10]
    # The newest message was deleted: the last sequence is that of the last one stored.
    assert counting.requests[0] == {"last_by_subj": Subjects.all_feed()}
    batches = counting.requests[1:]
    assert all(0 < request["batch"] <= 4 for request in batches), batches
    # The second asks from a deleted sequence: the server steps over it, and the
    # batch reaches the last message, so there is no third.
    assert [(r["seq"], r["batch"]) for r in batches] == [(first, 4), (first + 4, 4)]


async def test_reads_from_the_first_message_by_default_and_stops_at_the_last_at_call_time(
    nats_env: NatsEnv,
) -> None:
    with anyio.fail_after(20):
        async with (
            nats_env.connect(Role.LEDGER, "ledger") as ledger,
            nats_env.connect(Role.AUDITOR, "auditor") as auditor,
        ):
            stored = await _publish_records(ledger, 3, "bounds")
            last = stored[-1][0]
            reader = cast(
                "AsyncGenerator[FeedMessage, None]", read_feed(auditor.nc, batch=2, timeout=2)
            )
            async with aclosing(reader) as feed:
                seen = [await anext(feed)]
                assert seen[0].seq == (await ledger.js.stream_info(FEED_STREAM)).state.first_seq
                # Stored after the read began: not part of it.
                later = await _publish_records(ledger, 2, "later")
                seen += [message async for message in feed]
            assert [m.seq for m in seen][-3:] == [seq for seq, _, _ in stored]
            assert seen[-1].seq == last < later[0][0]
            assert [m.seq for m in seen] == sorted({m.seq for m in seen})
            # Read again from one past the end: exactly what came since.
            again = await _collect(read_feed(auditor.nc, start_seq=last + 1, timeout=2))
            assert [(m.seq, m.msg_id) for m in again] == [(s, i) for s, i, _ in later]
            assert await _collect(read_feed(auditor.nc, start_seq=later[-1][0] + 1)) == []
            assert auditor.violations == []


@pytest.mark.parametrize(("role", "name"), [(Role.EXECUTOR, "search_documents"), (Role.HOST, "h1")])
async def test_other_identities_are_refused_at_once(
    nats_env: NatsEnv, role: Role, name: str
) -> None:
    """A refusal is reported as such, without waiting out the timeout."""
    with anyio.fail_after(2):
        async with nats_env.connect(role, name) as probe:
            with pytest.raises(FeedAccessDenied, match=r"DIRECT\.GET\.OPS_FEED") as raised:
                await _collect(read_feed(probe.nc, timeout=30))
    assert raised.value.code == "NATS_FEED_ACCESS_DENIED"
    assert len(probe.violations) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start_seq": 0}, "start_seq"),
        ({"batch": 0}, "batch"),
        ({"batch": MAX_BATCH + 1}, "batch"),
        ({"timeout": 0}, "timeout"),
    ],
)
async def test_bad_arguments(nats_env: NatsEnv, kwargs: dict[str, Any], match: str) -> None:
    async with nats_env.connect(Role.AUDITOR, "auditor") as auditor:
        with pytest.raises(ValueError, match=match):
            await _collect(read_feed(auditor.nc, **kwargs))


@pytest.fixture
def lone_server(tmp_path: Path) -> Iterator[tuple[NatsServer, Any]]:
    """A server of its own (a test here stops it, or declares no topology)."""
    credentials = generate_credentials(tmp_path / "creds", hosts=(), tools=("search_documents",))
    with NatsServer(
        tmp_path / "server",
        authorization=credentials.authorization_config,
        monitor=False,
        probe_identity=credentials.ledger,
    ) as server:
        yield server, credentials


async def test_an_empty_feed_reads_nothing_and_a_feed_without_direct_get_is_an_error(
    lone_server: tuple[NatsServer, Any],
) -> None:
    server, credentials = lone_server
    with anyio.fail_after(10):
        ledger = await connect_as(server.url, credentials.ledger, allow_reconnect=False)
        auditor = await connect_as(server.url, credentials.auditor(), allow_reconnect=False)
        try:
            js = ledger.jetstream(timeout=CALL_TIMEOUT_S)
            # The feed as a server of an earlier version has it: no direct gets.
            await js.add_stream(name=FEED_STREAM, subjects=[Subjects.all_feed()])
            await js.publish(Subjects.feed("search_documents", "OperationCreated"), b"{}")
            with pytest.raises(FeedReadError, match="direct gets") as raised:
                await _collect(read_feed(auditor, timeout=2))
            assert type(raised.value) is FeedReadError
            await js.delete_stream(FEED_STREAM)
            await declare_as_ledger(server.url, credentials.ledger)
            assert await _collect(read_feed(auditor, timeout=2)) == []
        finally:
            await auditor.close()
            await ledger.close()


async def test_a_server_that_stops_answering_is_a_timeout_not_a_hang(
    lone_server: tuple[NatsServer, Any],
) -> None:
    server, credentials = lone_server
    await declare_as_ledger(server.url, credentials.ledger)
    auditor = await connect_as(server.url, credentials.auditor(), allow_reconnect=False)
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)  # alive, connected, and silent
    try:
        with anyio.fail_after(3), pytest.raises(FeedReadTimeout) as raised:
            await _collect(read_feed(auditor, timeout=0.5))
        assert raised.value.retryable
    finally:
        os.kill(server.pid, signal.SIGCONT)
        await auditor.close()
