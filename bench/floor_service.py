"""The service half of the design's floor in `bench/e2e_bench.py --floor`: every NATS
message one operation makes, and no ledger work at all.

An operation through opledger crosses the wire as: the host's proposal request
and its reply; the relay's feed records (Proposed, Validated, Readied) and the
work item on JetStream; the executor's lease request and its reply; the relay's
LeaseClaimed feed record; the executor's result on JetStream, pulled and acked
here; the relay's Succeeded feed record and the host's outcome notice. This
process sends and receives exactly those, of about the real sizes, published the
way `ledger.server.relay.publisher.RelayPublisher` publishes them (feed records
without a PubAck but one every 50 ms, work items with one), and does nothing
else: no check, no event, no commit, no validation beyond parsing the JSON.

So what the floor phase measures is what this design's hops cost on this machine
with the same client library, processes and server: no implementation of the
design can beat it here. An item whose host asked for `"lease": false` skips the
lease request (its LeaseClaimed record goes out with the result): the floor of the
dispatch-lease design in `docs/dispatch-leases.md`, without the broker claim it
would add.

    python bench/floor_service.py --nats-url URL --seed FILE [--max-seconds 900]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from typing import Any

import nats
import orjson

from schemas import PullConsumer

__all__ = ["FLOOR", "main"]

FLOOR = {
    "propose": "bench.floor.propose",
    "lease": "bench.floor.lease",
    "work_stream": "BENCH_FLOOR_WORK",
    "work": "bench.floor.work",
    "work_consumer": "floor_workers",
    "results_stream": "BENCH_FLOOR_RESULTS",
    "result": "bench.floor.result",
    "results_consumer": "floor_results",
    "feed_stream": "BENCH_FLOOR_FEED",
    "feed": "bench.floor.feed",
    "outcome": "bench.floor.outcome",
}
"""The floor's subjects, streams and consumers (declared by the bench's stack)."""

_CONFIRM_EVERY_S = 0.05  # as the relay: one feed record with a PubAck now and then
# About the sizes of the real messages of a no-op call (a feed record carries its
# event; a reply or notice carries the operation's status).
_REPLY_PAD = "x" * 450
_FEED_PAD = "y" * 850
_ITEM_PAD = "z" * 350
_NOTICE_PAD = "w" * 400


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--seed", required=True, help="NKey seed file of the bench user")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    return parser


class _Relay:
    """Publishes what each step means, in order, as the relay does after a commit."""

    def __init__(self, nc: Any) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._queue: list[tuple[str, bytes, str | None, bool]] = []
        self._wake = asyncio.Event()
        self._confirmed_at = 0.0
        self._sequence = 0

    def feed(self, operation_id: str, kind: str) -> None:
        """One feed record (stored, deduplicated by its message ID)."""
        self._sequence += 1
        record = orjson.dumps({"id": operation_id, "type": kind, "seq": self._sequence,
                               "event": {"pad": _FEED_PAD}})
        self._queue.append((f"{FLOOR['feed']}.{kind}", record, f"{operation_id}:{kind}", True))
        self._wake.set()

    def work(self, operation_id: str, lease: bool) -> None:
        """One work item (stored, acknowledged)."""
        item = orjson.dumps({"id": operation_id, "lease": lease, "attempt": 1,
                             "pad": _ITEM_PAD})
        self._queue.append((FLOOR["work"], item, f"w-{operation_id}", False))
        self._wake.set()

    def outcome(self, operation_id: str) -> None:
        """The host's outcome notice (core NATS: not stored)."""
        notice = orjson.dumps({"operation_id": operation_id, "state": "succeeded",
                               "pad": _NOTICE_PAD})
        self._queue.append((f"{FLOOR['outcome']}.{operation_id}", notice, None, False))
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Publish each batch in order; await its PubAcks before the next, as the relay."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            await self._wake.wait()
            self._wake.clear()
            batch, self._queue = self._queue, []
            if not batch:
                continue
            proof_due = loop.time() - self._confirmed_at >= _CONFIRM_EVERY_S
            last_feed = max((i for i, m in enumerate(batch) if m[3]), default=-1)
            acks = []
            for index, (subject, payload, message_id, is_feed) in enumerate(batch):
                headers = {"Nats-Msg-Id": message_id} if message_id else None
                if message_id is None or (is_feed and not (proof_due and index == last_feed)):
                    await self._nc.publish(subject, payload, headers=headers)
                else:
                    acks.append(await self._js.publish_async(subject, payload, headers=headers))
            if acks:
                await asyncio.gather(*acks)
                if proof_due and last_feed >= 0:
                    self._confirmed_at = loop.time()


async def _serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.call_later(args.max_seconds, stop.set)
    nc = await nats.connect(args.nats_url, nkeys_seed=args.seed, name="floor-service")
    relay = _Relay(nc)

    async def on_propose(message: Any) -> None:
        proposal = orjson.loads(message.data)
        operation_id = proposal["operation_id"]
        await message.respond(orjson.dumps({"operation_id": operation_id, "state": "ready",
                                            "pad": _REPLY_PAD}))
        for kind in ("Proposed", "Validated", "Readied"):
            relay.feed(operation_id, kind)
        relay.work(operation_id, bool(proposal.get("lease", True)))

    async def on_lease(message: Any) -> None:
        request = orjson.loads(message.data)
        await message.respond(orjson.dumps({"operation_id": request["id"],
                                            "decision": "execute", "fencing_token": 1,
                                            "pad": _REPLY_PAD}))
        relay.feed(request["id"], "LeaseClaimed")

    async def consume_results(results: PullConsumer) -> None:
        while not stop.is_set():
            for message in await results.take(256, timeout=1.0):
                result = orjson.loads(message.data)
                operation_id = result["operation_id"]
                if not result.get("leased", True):
                    relay.feed(operation_id, "LeaseClaimed")
                relay.feed(operation_id, "Succeeded")
                relay.outcome(operation_id)
                await message.ack()

    try:
        await nc.subscribe(FLOOR["propose"], queue="floor", cb=on_propose)
        await nc.subscribe(FLOOR["lease"], queue="floor", cb=on_lease)
        results = PullConsumer(nc, FLOOR["results_stream"], FLOOR["results_consumer"])
        await results.start()
        await nc.flush()
        print("floor service ready", flush=True)
        tasks = [loop.create_task(relay.run(stop)), loop.create_task(consume_results(results))]
        await stop.wait()
        relay._wake.set()  # let the relay see the stop
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await results.stop()
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


def main() -> int:
    """Serve until a signal or `--max-seconds`; exit code 0."""
    asyncio.run(_serve(_parser().parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
