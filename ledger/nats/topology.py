"""Declare the JetStream streams and consumers every opledger process relies on.

Only the ledger service runs this (it alone may use `$JS.API.>`); executors and
auditors bind to the consumers it created and cannot create their own.

- `OPS_WORK`: work-queue retention over `ops.exec.*`, one durable pull consumer
  per tool (`exec_<tool>`, filtered on `ops.exec.<tool>`, explicit ack). A
  work-queue stream deletes a message once its consumer acks it, and allows
  one consumer per subject, which is what one-consumer-per-tool gives.
- `OPS_RESULTS`: limits retention over `ops.result.*`, read by the ledger's
  durable `ledger_results` consumer.
- `OPS_FEED`: limits retention over `ops.feed.>`, with a duplicate window so a
  re-published event (same `Nats-Msg-Id`) is stored once; auditors read it
  through the durable `feed_auditor` consumer, and by sequence with direct
  gets (`allow_direct`; `ledger.nats.feed_reader`), since a durable consumer
  cannot go back to what it acknowledged. On a replicated stream, direct gets
  are answered by followers too, which may lag a little behind the leader.
  The other two streams allow no direct get: nobody but the ledger reads them
  by sequence, and it has the leader's `STREAM.MSG.GET`.

Declaring is idempotent: what exists with our configuration is left alone, what
differs is updated, and what cannot be updated (e.g. a stream's retention)
raises `TopologyError` rather than being deleted and recreated, which would
lose data.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import nats.errors
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from ledger.nats.errors import TopologyError
from schemas import (
    FEED_AUDITOR_CONSUMER,
    FEED_STREAM,
    RESULTS_CONSUMER,
    RESULTS_STREAM,
    WORK_STREAM,
    Subjects,
    work_consumer,
)

__all__ = [
    "RESULTS_KEPT_PER_TOOL",
    "DeclaredTopology",
    "consumer_configs",
    "declare_topology",
    "stream_configs",
]

_log = logging.getLogger(__name__)

# Fields we set and therefore compare; the server fills in many others
# (metadata, limits, defaults) that must not count as a difference.
_STREAM_FIELDS = (
    "subjects",
    "retention",
    "storage",
    "duplicate_window",
    "num_replicas",
    "allow_direct",
    "max_msgs_per_subject",
)
_CONSUMER_FIELDS = (
    "durable_name",
    "filter_subject",
    "ack_policy",
    "ack_wait",
    "max_deliver",
    "deliver_policy",
    "num_replicas",
)


@dataclass(frozen=True)
class DeclaredTopology:
    """What `declare_topology` did, by stream or `stream/consumer` name."""

    created: tuple[str, ...]
    updated: tuple[str, ...]
    unchanged: tuple[str, ...]


RESULTS_KEPT_PER_TOOL = 10_000
"""Results kept per tool's subject in `OPS_RESULTS` (the oldest go first): recorded
results are not needed again, and an executor publishing junk in a loop fills its
own tool's share of the disk, not the stream, nor other tools' results."""


def stream_configs(
    *,
    duplicate_window_s: float = 120,
    replicas: int = 1,
    results_kept_per_tool: int = RESULTS_KEPT_PER_TOOL,
) -> list[StreamConfig]:
    """The three streams' configurations."""
    return [
        StreamConfig(
            name=WORK_STREAM,
            subjects=[Subjects.all_work()],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            # Re-queuing the same attempt (same Nats-Msg-Id) within the window is a no-op.
            duplicate_window=duplicate_window_s,
            num_replicas=replicas,
            allow_direct=False,
        ),
        StreamConfig(
            name=RESULTS_STREAM,
            subjects=[Subjects.all_results()],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            # An executor retrying a result publish after a lost PubAck is deduplicated.
            duplicate_window=duplicate_window_s,
            num_replicas=replicas,
            allow_direct=False,
            max_msgs_per_subject=results_kept_per_tool,
        ),
        StreamConfig(
            name=FEED_STREAM,
            subjects=[Subjects.all_feed()],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=duplicate_window_s,
            num_replicas=replicas,
            # Auditors read the whole feed by sequence (`$JS.API.DIRECT.GET.OPS_FEED`).
            allow_direct=True,
        ),
    ]


def consumer_configs(
    tools: Sequence[str], *, ack_wait_s: float, max_deliver: int, replicas: int = 1
) -> list[tuple[str, ConsumerConfig]]:
    """`(stream, config)` of every durable pull consumer: one per tool, results, feed."""

    def pull(name: str, filter_subject: str) -> ConsumerConfig:
        # `name` and `durable_name` both set: nats-py then uses the
        # `$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>` API, which creates or
        # updates, instead of the legacy `DURABLE.CREATE`.
        return ConsumerConfig(
            name=name,
            durable_name=name,
            filter_subject=filter_subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            num_replicas=replicas,
        )

    configs = [(WORK_STREAM, pull(work_consumer(tool), Subjects.work(tool))) for tool in tools]
    configs.append((RESULTS_STREAM, pull(RESULTS_CONSUMER, Subjects.all_results())))
    configs.append((FEED_STREAM, pull(FEED_AUDITOR_CONSUMER, Subjects.all_feed())))
    return configs


def _differs(wanted: Any, existing: Any, fields: Sequence[str]) -> list[str]:
    """Names of `fields` set in `wanted` whose value differs in `existing`."""
    diffs = []
    for name in fields:
        want = getattr(wanted, name)
        if want is None:
            continue
        have = getattr(existing, name, None)
        # Enums come back from the server as plain strings; compare values.
        if getattr(want, "value", want) != getattr(have, "value", have):
            diffs.append(f"{name}: {have!r} -> {want!r}")
    return diffs


async def _declare_stream(js: JetStreamContext, config: StreamConfig) -> str:
    """`created`, `updated` or `unchanged`."""
    assert config.name is not None
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        await js.add_stream(config)
        return "created"
    if not _differs(config, info.config, _STREAM_FIELDS):
        return "unchanged"
    # Keep the server's values for everything we do not manage, so an update
    # never resets a limit an operator set by hand.
    merged = info.config.evolve(**{f: getattr(config, f) for f in _STREAM_FIELDS})
    try:
        await js.update_stream(merged)
    except APIError as exc:
        diffs = "; ".join(_differs(config, info.config, _STREAM_FIELDS))
        raise TopologyError(
            f"stream {config.name} exists with a configuration that cannot be updated "
            f"({diffs}): {exc.description}",
            stream=config.name,
        ) from exc
    return "updated"


async def _declare_consumer(js: JetStreamContext, stream: str, config: ConsumerConfig) -> str:
    """`created`, `updated` or `unchanged`."""
    assert config.durable_name is not None
    try:
        info = await js.consumer_info(stream, config.durable_name)
    except NotFoundError:
        existing = None
    else:
        existing = info.config
        if not _differs(config, existing, _CONSUMER_FIELDS):
            return "unchanged"
    try:
        # The CREATE API with a name creates, or updates a consumer in place.
        await js.add_consumer(stream, config)
    except APIError as exc:
        diffs = "; ".join(_differs(config, existing, _CONSUMER_FIELDS)) if existing else ""
        raise TopologyError(
            f"consumer {stream}/{config.durable_name} could not be declared "
            f"({diffs or 'new'}): {exc.description}",
            stream=stream,
            consumer=config.durable_name,
        ) from exc
    return "created" if existing is None else "updated"


_DECLARE_TRIES = 4


async def _patiently(declare: Callable[[], Awaitable[str]]) -> str:
    """Declare one stream or consumer, asking again when the API timed out.

    A replicated asset is created by the cluster's meta leader and its peers;
    on a busy cluster that just formed, it can outlast the API timeout (seen:
    the second R3 stream of a fresh 3-node cluster on two loaded cores) while
    the creation goes on. Declaring is idempotent (it looks first), so the
    next try finds the stream created, or creates it.
    """
    for attempt in range(1, _DECLARE_TRIES + 1):
        try:
            return await declare()
        except (nats.errors.TimeoutError, ServiceUnavailableError) as exc:
            if attempt == _DECLARE_TRIES:
                raise
            _log.warning("declaring the topology: %s, try %d; asking again", exc, attempt)
            await asyncio.sleep(attempt)
    raise AssertionError("unreachable")


async def declare_topology(
    js: JetStreamContext,
    tools: Sequence[str],
    *,
    ack_wait_s: float,
    max_deliver: int,
    duplicate_window_s: float = 120,
    replicas: int = 1,
    results_kept_per_tool: int = RESULTS_KEPT_PER_TOOL,
) -> DeclaredTopology:
    """Create or update the streams and durable pull consumers (see the module docstring).

    `js` must belong to the ledger identity. `replicas` is the number of copies
    of every stream and consumer (3 on a three-node cluster).
    """
    done: dict[str, list[str]] = {"created": [], "updated": [], "unchanged": []}
    for stream in stream_configs(
        duplicate_window_s=duplicate_window_s,
        replicas=replicas,
        results_kept_per_tool=results_kept_per_tool,
    ):
        assert stream.name is not None
        outcome = await _patiently(partial(_declare_stream, js, stream))
        done[outcome].append(stream.name)
    for stream_name, consumer in consumer_configs(
        tools, ack_wait_s=ack_wait_s, max_deliver=max_deliver, replicas=replicas
    ):
        outcome = await _patiently(partial(_declare_consumer, js, stream_name, consumer))
        done[outcome].append(f"{stream_name}/{consumer.durable_name}")
    return DeclaredTopology(
        created=tuple(done["created"]),
        updated=tuple(done["updated"]),
        unchanged=tuple(done["unchanged"]),
    )
