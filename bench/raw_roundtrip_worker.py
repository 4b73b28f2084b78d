"""The worker of the raw JetStream baseline in `bench/e2e_bench.py`: no ledger at all.

It does what an executor does on the wire and nothing else: pull work items
from a durable pull consumer (`schemas.PullConsumer`, up to `--batch` items in
flight, as `executors._runner.ExecutorRunner` runs them), publish a result to
a results stream and wait for its PubAck, then ack the work item. So the round
trip it gives is the JetStream floor under one operation, in the same process
layout (a separate process) as the real executor.

With `--lease-subject` it is also the executor of the design's floor
(`bench/floor_service.py`): an item that says `"lease": true` asks for its lease
there (a request and its reply) before it publishes the result.

    python bench/raw_roundtrip_worker.py --nats-url URL --seed FILE --stream S \\
        --consumer C --result-subject SUBJ [--batch 1] [--max-seconds 900] \\
        [--lease-subject SUBJ]

Stops on SIGTERM/SIGINT, or after `--max-seconds` in any case.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time
from typing import Any

import nats
import orjson

from schemas import PullConsumer

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--seed", required=True, help="NKey seed file of the bench user")
    parser.add_argument("--stream", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--result-subject", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--name", default="raw-worker")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--lease-subject", default=None,
                        help="where an item that asks for a lease asks for it (the floor)")
    return parser


async def _handle(nc: Any, js: Any, args: argparse.Namespace, message: Any) -> None:
    """One item: a result published (PubAck awaited), then the item acked."""
    item = orjson.loads(message.data)
    leased = bool(args.lease_subject and item.get("lease"))
    if leased:
        reply = await nc.request(
            args.lease_subject,
            orjson.dumps({"id": item["id"], "executor": args.name, "attempt": 1}),
            timeout=10,
        )
        if orjson.loads(reply.data)["decision"] != "execute":
            await message.term()
            return
    # About the size of a real result envelope, built per item.
    envelope: dict[str, Any] = {
        "operation_id": item["id"],
        "ok": True,
        "data": {"ok": True},
        "provenance": {"tool": "raw", "executor": args.name, "attempt": 1},
    }
    if args.lease_subject:
        envelope["leased"] = leased
    result = orjson.dumps(envelope)
    await js.publish(args.result_subject, result, headers={"Nats-Msg-Id": f"r-{item['id']}"})
    await message.ack()


async def _work(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    nc = await nats.connect(args.nats_url, nkeys_seed=args.seed, name=args.name)
    handled = 0
    in_flight: set[asyncio.Task[None]] = set()
    try:
        js = nc.jetstream()
        work = PullConsumer(nc, args.stream, args.consumer)
        await work.start()
        deadline = time.monotonic() + args.max_seconds
        while not stop.is_set() and time.monotonic() < deadline:
            free = args.batch - len(in_flight)
            if free <= 0:
                await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                continue
            # A short wait only so that a stop is noticed quickly.
            for message in await work.take(free, timeout=1.0):
                task = loop.create_task(_handle(nc, js, args, message))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                handled += 1
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
        for message in await work.stop():
            await message.nak()
    finally:
        with contextlib.suppress(Exception):
            await nc.flush(timeout=2)
        with contextlib.suppress(Exception):
            await nc.close()
    return handled


def main() -> int:
    """Run the worker until a signal or `--max-seconds`; exit code 0."""
    asyncio.run(_work(_parser().parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
