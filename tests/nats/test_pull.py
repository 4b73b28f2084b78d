"""`PullConsumer` on a real nats-server: credit, renewal, recovery and hand-back at stop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from ledger.nats import NatsServer
from schemas import PullConsumer
from tests.ports import free_port

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

STREAM = "PULLTEST"
CONSUMER = "workers"
SUBJECT = "pulltest.items"
NEXT = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{CONSUMER}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A plain server: pulling is about JetStream, not permissions (see test_permissions)."""
    with NatsServer(Path(tmp_path_factory.mktemp("pull")) / "server") as running:
        yield running


class CountingConnection:
    """A real connection that counts the pull requests sent through it."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.pulls: list[dict[str, Any]] = []

    def new_inbox(self) -> str:
        return self.nc.new_inbox()

    async def subscribe(self, subject: str, **kwargs: Any) -> Any:
        return await self.nc.subscribe(subject, **kwargs)

    async def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        if subject == NEXT:
            import orjson

            self.pulls.append(orjson.loads(payload))
        await self.nc.publish(subject, payload, reply=reply)


@pytest.fixture
async def nc(server: NatsServer) -> AsyncIterator[Client]:
    """A connection with a fresh stream and durable consumer (ack wait 30 s)."""
    connection = await nats.connect(server.url, allow_reconnect=False, connect_timeout=2)
    js = connection.jetstream(timeout=2)
    await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT]))
    await js.add_consumer(
        STREAM,
        ConsumerConfig(durable_name=CONSUMER, ack_policy=AckPolicy.EXPLICIT, ack_wait=30),
    )
    try:
        yield connection
    finally:
        await js.delete_stream(STREAM)
        await connection.close()


async def _started(connection: Any, **options: Any) -> PullConsumer:
    """A `PullConsumer` of the test consumer, its inbox subscribed."""
    consumer = PullConsumer(connection, STREAM, CONSUMER, **options)
    await consumer.start()
    return consumer


async def _publish(nc: Client, *names: str) -> None:
    js = nc.jetstream(timeout=2)
    for name in names:
        await js.publish(SUBJECT, name.encode())


async def test_items_arrive_one_by_one_with_a_pull_request_per_several(nc: Client) -> None:
    counting = CountingConnection(nc)
    consumer = await _started(counting)
    received: list[bytes] = []
    with anyio.fail_after(10):
        for index in range(24):
            await _publish(nc, f"item-{index}")
            (message,) = await consumer.take(8, timeout=2)
            received.append(message.data)
            await message.ack()
            assert consumer.credit + consumer.held <= 8
    assert received == [f"item-{index}".encode() for index in range(24)]
    # fetch() sent two pull requests per item at this pace; here a new one goes
    # out only when half of what the caller can take (7 // 2) is missing.
    assert 1 < len(counting.pulls) <= 24 // 3 + 1
    assert all(pull["batch"] <= 8 and pull["idle_heartbeat"] > 0 for pull in counting.pulls)
    await consumer.stop()


async def test_never_more_delivered_than_the_caller_can_take(nc: Client) -> None:
    await _publish(nc, *(f"item-{index}" for index in range(10)))
    consumer = await _started(nc)
    with anyio.fail_after(10):
        first = await consumer.take(3, timeout=2)
        await asyncio.sleep(0.3)  # anything over-delivered would arrive by now
        info = await nc.jetstream(timeout=2).consumer_info(STREAM, CONSUMER)
        assert 1 <= len(first) <= 3
        assert info.num_ack_pending <= 3
        assert len(first) + consumer.held <= 3
    held = await consumer.stop()
    for message in [*first, *held]:
        await message.nak()


async def test_an_expired_pull_is_renewed_while_a_take_waits(nc: Client) -> None:
    counting = CountingConnection(nc)
    consumer = await _started(counting, expires_s=0.3, heartbeat_s=0.1)
    with anyio.fail_after(10):
        waiting = asyncio.ensure_future(consumer.take(4, timeout=5))
        await asyncio.sleep(1.0)  # three expiries
        assert not waiting.done()
        await _publish(nc, "late")
        (message,) = await waiting
    assert message.data == b"late"
    assert len(counting.pulls) >= 3
    await message.ack()
    await consumer.stop()


async def test_a_recreated_consumer_is_pulled_from_again(nc: Client) -> None:
    js = nc.jetstream(timeout=2)
    consumer = await _started(nc)
    # Well inside the heartbeat fallback (over 10 s): the 409 itself is understood.
    with anyio.fail_after(5):
        assert await consumer.take(4, timeout=0.3) == []  # a pull request is open
        # The server ends that pull with a 409 (consumer deleted).
        await js.delete_consumer(STREAM, CONSUMER)
        await js.add_consumer(
            STREAM, ConsumerConfig(durable_name=CONSUMER, ack_policy=AckPolicy.EXPLICIT)
        )
        await _publish(nc, "after")
        taken: list[Any] = []
        while not taken:
            taken = await consumer.take(4, timeout=0.5)
    assert [message.data for message in taken] == [b"after"]
    await taken[0].ack()
    await consumer.stop()


async def test_lost_pull_requests_show_as_missing_heartbeats(nc: Client) -> None:
    class Deaf(CountingConnection):
        """Sends pull requests that never reach the server, as after a lost connection."""

        async def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
            if subject == NEXT and len(self.pulls) == 0:
                self.pulls.append({"lost": True})
                return
            await super().publish(subject, payload, reply)

    deaf = Deaf(nc)
    consumer = await _started(deaf, heartbeat_s=0.1)
    with anyio.fail_after(10):
        assert await consumer.take(4, timeout=0.2) == []
        await _publish(nc, "found")
        await asyncio.sleep(1.5)  # more than two heartbeats and a second of silence
        (message,) = await consumer.take(4, timeout=2)
    assert message.data == b"found"
    assert deaf.pulls[0] == {"lost": True} and len(deaf.pulls) >= 2
    await message.ack()
    await consumer.stop()


async def test_stop_hands_back_what_arrived_and_nothing_is_lost(nc: Client) -> None:
    await _publish(nc, *(f"item-{index}" for index in range(5)))
    consumer = await _started(nc)
    with anyio.fail_after(10):
        taken = await consumer.take(5, timeout=2)
        await asyncio.sleep(0.3)  # the rest of the credit arrives meanwhile
        held = await consumer.stop()
        assert len(taken) + len(held) == 5
        for message in held:
            await message.nak()
        for message in taken:
            await message.ack()
        # A fresh consumer gets exactly the handed-back items, at once (no ack wait).
        again = await _started(nc)
        seen: list[bytes] = []
        while len(seen) < len(held):
            batch = await again.take(5, timeout=2)
            assert batch, "a handed-back item was not redelivered at once"
            seen.extend(message.data for message in batch)
            for message in batch:
                await message.ack()
        await again.stop()
    assert sorted(seen) == sorted(message.data for message in held)
    assert sorted([*seen, *(m.data for m in taken)]) == [f"item-{i}".encode() for i in range(5)]


async def test_a_capacity_below_one_is_refused(nc: Client) -> None:
    consumer = await _started(nc)
    with pytest.raises(ValueError, match="capacity"):
        await consumer.take(0)
    await consumer.stop()


async def test_after_a_server_crash_pulling_resumes_at_once(tmp_path: Path) -> None:
    port = free_port()
    home = tmp_path / "server"
    first = NatsServer(home, port=port).start()
    consumer: PullConsumer | None = None
    reconnected = asyncio.Event()

    async def on_reconnected() -> None:
        assert consumer is not None
        consumer.reset()  # what the executors and the ledger service do
        reconnected.set()

    nc = await nats.connect(
        first.url,
        reconnect_time_wait=0.1,
        max_reconnect_attempts=-1,
        reconnected_cb=on_reconnected,
    )
    second: NatsServer | None = None
    try:
        js = nc.jetstream(timeout=2)
        await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT]))
        await js.add_consumer(
            STREAM, ConsumerConfig(durable_name=CONSUMER, ack_policy=AckPolicy.EXPLICIT)
        )
        consumer = await _started(nc)  # heartbeats every 5 s: silence shows after 11 s
        # Well inside those 11 s: the reconnect itself must bring the pulling back.
        with anyio.fail_after(6):
            waiting = asyncio.ensure_future(consumer.take(4, timeout=5))
            await asyncio.sleep(0.3)  # its pull request is open on the server
            assert first.pid is not None
            os.kill(first.pid, signal.SIGKILL)  # no goodbye (no 409) to the pull request
            first.stop()
            second = NatsServer(home, port=port).start()  # same port, same store
            await reconnected.wait()
            assert await waiting == []  # the reset woke it
            await _publish(nc, "after-crash")
            taken = await consumer.take(4, timeout=3)
        assert [message.data for message in taken] == [b"after-crash"]
        await taken[0].ack()
        await consumer.stop()
    finally:
        await nc.close()
        for server in (first, second):
            if server is not None:
                server.stop()


@pytest.mark.parametrize("max_bytes", [120, 1_000_000], ids=["bytes-used-up", "batch-completed"])
async def test_pull_requests_with_max_bytes_end_without_a_pause(
    nc: Client, max_bytes: int, caplog: pytest.LogCaptureFixture
) -> None:
    """With `max_bytes` the server ends a pull request with a 409 ("Message Size Exceeds
    MaxBytes" when its bytes ran out, "Batch Completed" when its batch was delivered
    with bytes left): not a refusal. Taken for one, each ended the results consumer's
    pulls with a second of pause (the pause for refused pulls).

    What shows it is the refusal's warning, which a refusal always logs; the
    waits only confirm it, with room for a busy machine below the second's pause.
    """
    caplog.set_level(logging.WARNING, logger="schemas._pull")
    js = nc.jetstream(timeout=2)
    consumer = await _started(nc, max_bytes=max_bytes)
    loop = asyncio.get_running_loop()
    try:
        waits = []
        for n in range(6):
            await js.publish(SUBJECT, b"x" * 40)
            started = loop.time()
            with anyio.fail_after(5):
                taken = await consumer.take(1 if n % 2 else 3, timeout=3)
            waits.append(loop.time() - started)
            # Failed once under load with 3 taken (not reproduced in 25 loaded runs):
            # say which stream sequences and deliveries they were, and what the stream
            # held, so that the next failure explains itself.
            assert len(taken) == 1, (
                n,
                [(m.metadata.sequence, m.metadata.num_delivered) for m in taken],
                (await js.stream_info(STREAM)).state,
            )
            await taken[0].ack()
    finally:
        await consumer.stop()
    refusals = [r.getMessage() for r in caplog.records if r.name == "schemas._pull"]
    assert refusals == []
    assert max(waits) < 0.9, waits  # a refusal's pause is 1 s
