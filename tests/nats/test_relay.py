"""The relay against a real server, on both storage backends.

One relay holds the lease at a time; the holder keeps its position in memory
and writes it when it stops, so the next holder continues exactly there:
nothing is published twice and nothing is skipped.
"""

from __future__ import annotations

from typing import Any

import pytest

from ledger import Ledger, StorageConfig
from ledger.nats import Role
from ledger.server.gateway import LedgerGateway
from ledger.server.relay import Relay
from schemas import FEED_STREAM, WORK_STREAM
from tests.ledger.helpers import ALICE, make_ledger, search
from tests.nats.conftest import NatsEnv

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


class RecordingRelay(Relay):
    """A relay that also notes the message ID (or, for a notice, the subject) it publishes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.published: list[str] = []

    async def _publish(self, messages: list[Any]) -> None:
        await super()._publish(messages)
        self.published.extend(message.message_id or message.subject for message in messages)


async def _stored(js: Any, stream: str) -> int:
    return int((await js.stream_info(stream)).state.messages)


async def test_one_relay_at_a_time_and_the_next_continues_where_the_last_stopped(
    nats_env: NatsEnv, storage: StorageConfig
) -> None:
    ledger: Ledger = make_ledger(storage)
    # Message IDs are operation IDs: unique per backend, or JetStream's
    # duplicate window would drop the second run's publishes.
    ids = [f"op-relay-{n}-{'pg' if storage.is_postgres else 'lite'}" for n in (1, 2, 3)]
    gateway = LedgerGateway(ledger)
    async with nats_env.connect(Role.LEDGER, "ledger") as probe:
        js = probe.nc.jetstream()
        first = RecordingRelay(gateway, probe.nc)
        second = RecordingRelay(gateway, probe.nc)
        feed, work = await _stored(js, FEED_STREAM), await _stored(js, WORK_STREAM)

        ledger.submit(search(ids[0]), ALICE)  # proposed, validated, readied
        assert await first.pump() is False  # a short batch: caught up
        assert len(first.published) == 4  # three feed events and the work item
        assert await _stored(js, FEED_STREAM) == feed + 3
        assert await _stored(js, WORK_STREAM) == work + 1

        # The first holds the lease: the second publishes nothing.
        ledger.submit(search(ids[1]), ALICE)
        assert await second.pump() is False
        assert second.published == []
        await first.pump()
        assert len(first.published) == 8

        # The first stops; the second takes over from the saved position.
        await first.stop()
        await second.pump()
        assert second.published == []  # nothing again
        ledger.submit(search(ids[2]), ALICE)
        await second.pump()
        assert len(second.published) == 4
        assert sorted(second.published) == sorted(
            [f"{ids[2]}:{version}" for version in (1, 2, 3)] + [f"{ids[2]}:3"]
        )  # its three events and the work item (which carries the Readied event's ID)
        assert not any(ids[2] in published for published in first.published)
        assert len(set(first.published + second.published)) == 9  # no event twice
        assert await _stored(js, FEED_STREAM) == feed + 9
        assert await _stored(js, WORK_STREAM) == work + 3
    ledger.close()
