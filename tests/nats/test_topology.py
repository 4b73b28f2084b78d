"""`declare_topology`: creates, leaves alone, updates, and refuses what cannot be updated."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import anyio
import nats
import nats.errors
import pytest
from nats.js.api import RetentionPolicy

from ledger.nats import ClusterOptions, NatsServer, TopologyError, declare_topology
from schemas import (
    FEED_AUDITOR_CONSUMER,
    FEED_STREAM,
    RESULTS_CONSUMER,
    RESULTS_STREAM,
    WORK_STREAM,
    Subjects,
    work_consumer,
)
from tests.nats.conftest import TOOLS
from tests.ports import free_port

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

ALL = (
    WORK_STREAM,
    RESULTS_STREAM,
    FEED_STREAM,
    *(f"{WORK_STREAM}/{work_consumer(tool)}" for tool in TOOLS),
    f"{RESULTS_STREAM}/{RESULTS_CONSUMER}",
    f"{FEED_STREAM}/{FEED_AUDITOR_CONSUMER}",
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    """A plain server (no users): topology is about JetStream, not permissions."""
    with NatsServer(tmp_path / "server") as running:
        yield running


async def test_declare_is_idempotent_and_updates_what_changed(server: NatsServer) -> None:
    with anyio.fail_after(10):
        nc = await nats.connect(server.url, allow_reconnect=False, connect_timeout=2)
        js = nc.jetstream(timeout=1)
        try:
            first = await declare_topology(js, TOOLS, ack_wait_s=30, max_deliver=5)
            assert first.created == ALL
            again = await declare_topology(js, TOOLS, ack_wait_s=30, max_deliver=5)
            assert again.unchanged == ALL and not again.created and not again.updated
            changed = await declare_topology(
                js, TOOLS, ack_wait_s=10, max_deliver=7, duplicate_window_s=60
            )
            assert changed.updated == ALL

            work = await js.stream_info(WORK_STREAM)
            assert work.config.retention == RetentionPolicy.WORK_QUEUE
            assert work.config.subjects == [Subjects.all_work()]
            assert work.config.duplicate_window == 60
            feed = await js.stream_info(FEED_STREAM)
            assert feed.config.retention == RetentionPolicy.LIMITS
            assert feed.config.subjects == [Subjects.all_feed()]
            consumer = await js.consumer_info(WORK_STREAM, work_consumer("search_documents"))
            assert consumer.config.filter_subject == "ops.exec.search_documents"
            assert consumer.config.ack_policy == "explicit"
            assert (consumer.config.ack_wait, consumer.config.max_deliver) == (10, 7)
            assert consumer.config.deliver_subject is None  # a pull consumer
        finally:
            await nc.close()


async def test_an_existing_feed_gets_direct_gets_and_nothing_else_does(server: NatsServer) -> None:
    """A deployment from before `allow_direct`: its feed is updated in place, its data kept."""
    with anyio.fail_after(10):
        nc = await nats.connect(server.url, allow_reconnect=False, connect_timeout=2)
        js = nc.jetstream(timeout=1)
        try:
            await js.add_stream(
                name=FEED_STREAM,
                subjects=[Subjects.all_feed()],
                duplicate_window=120,
                storage="file",
            )
            await js.publish("ops.feed.search_documents.OperationCreated", b"kept")
            assert (await js.stream_info(FEED_STREAM)).config.allow_direct is False
            done = await declare_topology(js, TOOLS, ack_wait_s=30, max_deliver=5)
            assert FEED_STREAM in done.updated
            feed = await js.stream_info(FEED_STREAM)
            assert feed.config.allow_direct is True
            assert feed.state.messages == 1
            for stream in (WORK_STREAM, RESULTS_STREAM):
                assert (await js.stream_info(stream)).config.allow_direct is False
            again = await declare_topology(js, TOOLS, ack_wait_s=30, max_deliver=5)
            assert again.unchanged == ALL
        finally:
            await nc.close()


async def test_a_stream_that_cannot_be_updated_is_an_error(server: NatsServer) -> None:
    """A work-queue stream's retention cannot change: we refuse instead of deleting data."""
    with anyio.fail_after(10):
        nc = await nats.connect(server.url, allow_reconnect=False, connect_timeout=2)
        js = nc.jetstream(timeout=1)
        try:
            # Limits retention:
            await js.add_stream(name=WORK_STREAM, subjects=[Subjects.all_work()])
            with pytest.raises(TopologyError, match=WORK_STREAM) as raised:
                await declare_topology(js, TOOLS, ack_wait_s=30, max_deliver=5)
            assert "retention" in raised.value.message
            info = await js.stream_info(WORK_STREAM)
            assert info.config.retention == RetentionPolicy.LIMITS  # left as it was
        finally:
            await nc.close()


async def test_replicas_on_a_three_node_cluster(tmp_path: Path) -> None:
    cluster_ports = [free_port() for _ in range(3)]
    routes = tuple(f"nats-route://127.0.0.1:{p}" for p in cluster_ports)
    nodes = [
        NatsServer(
            tmp_path / f"n{i}",
            server_name=f"n{i}",
            cluster=ClusterOptions(name="topology-test", port=port, routes=routes),
        )
        for i, port in enumerate(cluster_ports)
    ]
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_healthy(timeout_s=15)
        with anyio.fail_after(20):
            nc = await nats.connect(
                [n.url for n in nodes], allow_reconnect=False, connect_timeout=2
            )
            try:
                js = nc.jetstream(timeout=2)
                done = await declare_topology(
                    js, TOOLS, ack_wait_s=30, max_deliver=5, replicas=3
                )
                assert done.created == ALL
                info = await js.stream_info(FEED_STREAM)
                assert info.config.num_replicas == 3
                assert info.cluster is not None and len(info.cluster.replicas or []) == 2
            finally:
                await nc.close()
    finally:
        for node in nodes:
            node.stop()


async def test_an_executor_publishing_in_a_loop_fills_only_its_own_share_of_results(
    server: NatsServer,
) -> None:
    """The results stream kept everything forever: an executor publishing junk in a
    loop filled the disk for everyone. Now each tool's subject keeps its newest
    `results_kept_per_tool`, and the others' results stay."""
    with anyio.fail_after(10):
        nc = await nats.connect(server.url, allow_reconnect=False, connect_timeout=2)
        js = nc.jetstream(timeout=1)
        try:
            await declare_topology(js, TOOLS, ack_wait_s=30, max_deliver=5,
                                   results_kept_per_tool=5)
            for n in range(3):
                await js.publish(f"ops.result.{TOOLS[1]}", f"legit-{n}".encode())
            for n in range(40):
                await js.publish(f"ops.result.{TOOLS[0]}", f"junk-{n}".encode())
            state = (await js.stream_info(RESULTS_STREAM)).state
            assert state.messages == 5 + 3
            kept = await js.get_last_msg(RESULTS_STREAM, f"ops.result.{TOOLS[1]}")
            assert kept.data == b"legit-2"
            # A deployment from before the limit is updated in place.
            again = await declare_topology(js, TOOLS, ack_wait_s=30, max_deliver=5)
            assert RESULTS_STREAM in again.updated
        finally:
            await nc.close()


def test_a_declaration_that_timed_out_is_asked_again_and_a_lasting_failure_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replicated stream's creation can outlast the API timeout on a cluster that just
    formed (seen in CI); declaring is idempotent, so it is asked again, a bounded number
    of times."""
    from ledger.nats import topology

    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    answers: list[BaseException | str] = [nats.errors.TimeoutError(), "unchanged"]

    async def declare() -> str:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    assert asyncio.run(topology._patiently(declare)) == "unchanged"
    answers[:] = [nats.errors.TimeoutError()] * topology._DECLARE_TRIES
    with pytest.raises(nats.errors.TimeoutError):
        asyncio.run(topology._patiently(declare))
    assert answers == []


async def _no_sleep(_seconds: float) -> None:
    return None
