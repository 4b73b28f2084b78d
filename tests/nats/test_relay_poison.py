"""No event can stop the relay: against a real server, on both storage backends.

An event the relay cannot publish (here: one written by an earlier version
that stored a tool name no subject can carry) is set aside with a row, a
metric, a log line and an event on its operation, and everything after it
flows. An event too large for one message goes out without its body; the
feed still carries its hash.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest

from ledger import Ledger, Operation, StorageConfig
from ledger.domain.hashing import stored_event_hash
from ledger.nats import NatsServer, declare_topology
from ledger.server.app import build_relay
from ledger.server.gateway import LedgerGateway
from ledger.server.metrics import LedgerMetrics
from ledger.server.relay import SET_ASIDE_TABLE
from schemas import FEED_STREAM, WORK_STREAM, RuntimeContext, Subjects
from tests.factories import blob_registry
from tests.feed import feed_messages
from tests.ledger.helpers import ALICE, make_ledger, proposal, search

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A server whose messages may be at most 64 KiB (an operator's lower limit)."""
    # `authorization` is appended to the config as it is: here, a payload limit.
    with NatsServer(
        tmp_path_factory.mktemp("small"), authorization="max_payload: 65536"
    ) as server:
        yield server


def _suffix(storage: StorageConfig) -> str:
    # Message IDs are operation IDs: unique per backend, or JetStream's duplicate
    # window would drop the second backend's publishes.
    return "pg" if storage.is_postgres else "lite"


def _forged_legacy_operation(ledger: Ledger, operation_id: str, tool: str) -> None:
    """An operation as an earlier version stored it: a tool name that is no subject token."""
    operation = Operation.propose(
        operation_id,
        proposal={"tool_name": tool, "arguments": {}},
        fingerprint="f",
        actor="alice",
        tenant="acme",
        environment="test",
        tool=tool,
        now=datetime.now(UTC),
    )
    operation.reject(issues=[{"code": "unknown_tool"}], category="INVALID_INPUT",
                     repairable=True, tool_version=None, now=datetime.now(UTC))
    ledger.events.events.put(operation.collect_events())


async def _feed_ids(js: Any, subject: str) -> set[str]:
    """Message IDs of the feed messages on `subject`."""
    return {msg.headers.get("Nats-Msg-Id", "") for msg in await feed_messages(js, subject)}


async def test_an_event_that_cannot_be_published_is_set_aside_and_the_relay_moves_on(
    small_server: NatsServer, storage: StorageConfig
) -> None:
    """Before: `not a valid subject token`, the same batch retried forever; no feed
    events, outcome notices or work items went out for anyone, across restarts."""
    ledger = make_ledger(storage)
    suffix = _suffix(storage)
    nc = await nats.connect(small_server.url)
    try:
        js = nc.jetstream()
        await declare_topology(js, ["search_documents"], ack_wait_s=5, max_deliver=3)
        metrics = LedgerMetrics()
        relay = build_relay(LedgerGateway(ledger), nc, metrics=metrics)
        _forged_legacy_operation(ledger, f"legacy-{suffix}", "../etc/passwd")
        ledger.submit(search(f"after-{suffix}"), ALICE)
        assert await relay.pump() is False

        # Everything after the poisoned events went out.
        ids = await _feed_ids(js, Subjects.all_feed("search_documents"))
        assert {f"after-{suffix}:{v}" for v in (1, 2, 3)} <= ids
        work = await js.get_last_msg(WORK_STREAM, Subjects.work("search_documents"))
        assert work.data is not None
        assert orjson.loads(work.data)["operation_id"] == f"after-{suffix}"
        # Both events of the legacy operation were set aside, and said so.
        rows = ledger.db.query(
            f"SELECT operation_id, version, reason FROM {SET_ASIDE_TABLE} ORDER BY position"
        )
        assert [(r[0], r[1]) for r in rows] == [(f"legacy-{suffix}", 1), (f"legacy-{suffix}", 2)]
        assert all("not a valid subject token" in r[2] for r in rows)
        assert metrics.registry.get_sample_value("opledger_relay_events_set_aside_total") == 2
        history = ledger.history(f"legacy-{suffix}")
        assert [type(e).__name__ for e in history] == [
            "Proposed", "Rejected", "PublicationSetAside", "PublicationSetAside",
        ]
        assert [e.version for e in history[2:]] == [1, 2]

        # The notes themselves cannot be published either (same tool): set aside,
        # never noted again; and a new relay (a restart) does not go round again.
        await relay.pump()
        await relay.stop()
        again = build_relay(LedgerGateway(ledger), nc, metrics=metrics)
        ledger.submit(search(f"later-{suffix}"), ALICE)
        await again.pump()
        await again.stop()
        assert len(ledger.history(f"legacy-{suffix}")) == 4
        count = ledger.db.query(f"SELECT COUNT(*) FROM {SET_ASIDE_TABLE}")[0][0]
        assert count == 4
        assert f"later-{suffix}:3" in await _feed_ids(js, Subjects.all_feed("search_documents"))
    finally:
        await nc.close()
        ledger.close()


async def test_an_event_larger_than_a_message_goes_out_without_its_body(
    small_server: NatsServer, storage: StorageConfig
) -> None:
    """Before: `MaxPayloadError` for the batch, forever. Now the feed record keeps the
    event's hash (what auditors compare) and drops its body; the work item goes out."""
    registry = blob_registry()
    ledger = make_ledger(storage, registry=registry, rules={})
    suffix = _suffix(storage)
    nc = await nats.connect(small_server.url)
    try:
        js = nc.jetstream()
        await declare_topology(js, ["store_blob"], ack_wait_s=5, max_deliver=3)
        relay = build_relay(LedgerGateway(ledger), nc)
        blob = proposal("store_blob", {"blob": "b" * 100_000}, operation_id=f"blob-{suffix}")
        assert ledger.submit(blob, RuntimeContext(principal="a", tenant="t")).state.value == "ready"
        await relay.pump()
        rows = {row[2]: row for row in ledger.stored_rows() if row[1] == f"blob-{suffix}"}
        for kind, version in (("Proposed", 1), ("Validated", 2), ("Readied", 3)):
            msg = await js.get_last_msg(FEED_STREAM, Subjects.feed("store_blob", kind))
            assert msg.data is not None
            record = orjson.loads(msg.data)
            assert record["version"] == version and len(msg.data) < 65536
            assert record["event_hash"] == stored_event_hash(rows[version][3], rows[version][4])
            assert record.get("event_omitted", False) is (kind != "Readied")
            assert (record["event"] == {}) is (kind != "Readied")
        work = await js.get_last_msg(WORK_STREAM, Subjects.work("store_blob"))
        assert work.data is not None
        assert orjson.loads(work.data)["operation_id"] == f"blob-{suffix}"
        assert ledger.db.query(f"SELECT COUNT(*) FROM {SET_ASIDE_TABLE}")[0][0] == 0
    finally:
        await nc.close()
        ledger.close()


def test_the_payload_limit_server_really_has_that_limit(small_server: NatsServer) -> None:
    """The fixture's premise, checked against the server itself (not the config text)."""
    import asyncio

    async def limit() -> int:
        nc = await nats.connect(small_server.url)
        try:
            return int(nc.max_payload)
        finally:
            await nc.close()

    assert asyncio.run(limit()) == 65536
    assert Path(small_server.config_path).exists()


def _insert_raw(ledger: Ledger, operation_id: str, version: int, topic: str, state: bytes) -> None:
    """A row written by hand into the events table (its position from the table itself)."""
    ledger.db.execute(
        f"INSERT INTO {ledger.events_table} (originator_id, originator_version, topic, state)"
        " VALUES (?, ?, ?, ?)",
        (operation_id, version, topic, state),
    )


async def test_rows_that_are_no_events_stop_neither_the_relay_nor_the_view_nor_the_seal(
    small_server: NatsServer, storage: StorageConfig
) -> None:
    """Before: `orjson.loads` in the relay's route learning and `KeyError: 'timestamp'`
    in the projector, retried forever: no feed, no view, no seal, no sweeps, and every
    proposal to a rate-limited tool rejected CHECK_FAILED (its budget reads the view)."""
    ledger = make_ledger(storage)
    suffix = _suffix(storage)
    topic = "ledger.domain.operation:Operation.Proposed"
    nc = await nats.connect(small_server.url)
    try:
        js = nc.jetstream()
        await declare_topology(js, ["search_documents"], ack_wait_s=5, max_deliver=3)
        relay = build_relay(LedgerGateway(ledger), nc)
        ledger.submit(search(f"known-{suffix}"), ALICE)
        _insert_raw(ledger, f"garbage-{suffix}", 1, topic, b"\xff\xfe not json")
        _insert_raw(ledger, f"shape-{suffix}", 1, topic, b'{"hello": 1}')
        _insert_raw(ledger, f"known-{suffix}", 4, topic.replace("Proposed", "Succeeded"),
                    b'{"hello": 1}')
        after = ledger.submit(search(f"after-{suffix}"), ALICE)
        assert after.state.value == "ready"  # the budget read the view: it is not stuck
        assert await relay.pump() is False

        ids = await _feed_ids(js, Subjects.all_feed("search_documents"))
        assert {f"after-{suffix}:{v}" for v in (1, 2, 3)} <= ids
        rows = ledger.db.query(
            f"SELECT operation_id, reason FROM {SET_ASIDE_TABLE} ORDER BY position"
        )
        assert [r[0] for r in rows] == [f"garbage-{suffix}", f"shape-{suffix}"]
        assert all(r[1] == "no operation is known for this event" for r in rows)
        # The view went past them, and the seal too.
        assert ledger.projector.row(f"after-{suffix}") is not None
        assert ledger.projector.row(f"garbage-{suffix}") is None
        known = ledger.projector.row(f"known-{suffix}")
        assert known is not None
        assert known.state == "ready"  # v4 did not project
        ((sealed,),) = ledger.db.query("SELECT MAX(position) FROM opledger_seal_signatures")
        last = max(row[0] for row in ledger.stored_rows())
        assert sealed == last
    finally:
        await nc.close()
        ledger.close()
