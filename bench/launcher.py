"""Run a module as `python -m MODULE ...` would, optionally profiled or with experiments.

    python bench/launcher.py [--profile DIR] [--patch NAME[=VALUE]]... -m MODULE [ARGS...]

`--profile DIR`: cProfile on every thread. `python -m cProfile` sees only the
main thread, but the ledger service does its database work on another thread
(`LedgerGateway`'s executor) and executors run plain tool functions in worker
threads; so `threading.Thread.run` is wrapped to give each thread its own
profiler, and each writes `<thread name>.prof` into DIR when it ends (the main
thread when the module returns or exits).

`--patch NAME`: an *experiment*, applied in this process only, that mimics a
change proposed for code outside `bench/` so that the benchmark can say what
the change would gain. No file outside `bench/` is edited; none of these is a
fix. See `PATCHES` for each one and the source change it stands for.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import logging
import re
import runpy
import sqlite3
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["PATCHES", "main"]


# -------------------------------------------------------------------- profiling


def _dump(profile: cProfile.Profile, out: Path, thread_name: str) -> None:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", thread_name)[:80]
    path = out / f"{safe}.prof"
    index = 1
    while path.exists():  # thread pools reuse name prefixes; keep every profile
        path = out / f"{safe}-{index}.prof"
        index += 1
    profile.dump_stats(path)


def _profile_threads(out: Path) -> None:
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        profile = cProfile.Profile()
        profile.enable()
        try:
            original(self)
        finally:
            profile.disable()
            _dump(profile, out, self.name)

    threading.Thread.run = run  # type: ignore[method-assign]


# ------------------------------------------------------------------ experiments


def _handlers(value: str) -> None:
    """Service: run up to N request handlers at once per subject (default 1).

    Stands for: `ledger/server/app.py`, `LedgerService._register`, pass
    `max_workers=N` to the three `self.broker.subscriber(...)` calls. FastStream
    core subscribers handle one message at a time by default, so proposals and
    lease requests reach `LedgerGateway` one by one and every batch holds one
    item: one SQLite transaction (with its WAL fsync) per proposal and per lease.
    """
    from faststream.nats import NatsBroker

    workers = int(value or 64)
    original = NatsBroker.subscriber

    def subscriber(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("stream") and not kwargs.get("pull_sub"):
            kwargs.setdefault("max_workers", workers)
        return original(self, *args, **kwargs)

    NatsBroker.subscriber = subscriber  # type: ignore[method-assign]


def _quiet_access_log(_value: str) -> None:
    """Service: FastStream's per-message "Received"/"Processed" lines at DEBUG.

    Stands for: `ledger/server/app.py`, `LedgerService.__init__`, build the
    broker with `log_level=logging.DEBUG` (or tie it to `--log-level`): the
    service writes two INFO lines per request whatever `--log-level` says.
    """
    from faststream.nats import NatsBroker

    original = NatsBroker.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("log_level", logging.DEBUG)
        original(self, *args, **kwargs)

    NatsBroker.__init__ = init  # type: ignore[method-assign]


def _results_timeout(_value: str) -> None:
    """Service: treat nats-py's plain `asyncio.TimeoutError` from `fetch` as "no results".

    Stands for: `ledger/server/app.py`, `LedgerService._consume_results`, catch
    the builtin `TimeoutError` (nats-py's own one subclasses it). nats-py's `_fetch_n` raises a bare
    `asyncio.TimeoutError` when its deadline passed before the long poll (a
    busy loop); the service logs it as a failure and sleeps 1 s, with results
    waiting.
    """
    from ledger.server import app
    from schemas import RESULTS_CONSUMER, RESULTS_STREAM

    async def consume(self: Any, js: Any) -> None:
        subscription = await js.pull_subscribe_bind(RESULTS_CONSUMER, stream=RESULTS_STREAM)
        while True:
            try:
                messages = await subscription.fetch(self.options.result_batch, timeout=1)
            except TimeoutError:  # nats-py's own TimeoutError subclasses it
                continue
            except Exception:
                app._log.exception("fetching results failed")
                await asyncio.sleep(1)
                continue
            await self._record(messages)

    app.LedgerService._consume_results = consume  # type: ignore[method-assign]


def _exec_concurrent(_value: str) -> None:
    """Executor: handle the items of one fetch concurrently, not one after another.

    Stands for: `executors/_runner.py`, `ExecutorRunner._loop`, run
    `self.handle(msg)` for the fetched messages under `asyncio.gather` (or
    keep up to `--batch` items in flight with a semaphore and fetch as slots
    free up). Today each item waits for its lease round trip and its result
    PubAck before the next starts, so one executor does at most
    1 / (lease RTT + PubAck RTT) items per second, and `--batch` changes nothing.
    """
    import nats.errors

    from executors._runner import ExecutorRunner

    async def loop(self: Any, sub: Any) -> None:
        while not self._stop.is_set():
            try:
                messages = await sub.fetch(self._batch, timeout=self._fetch_timeout)
            except TimeoutError:  # also the bare one nats-py raises at times (see above)
                continue
            except nats.errors.ConnectionClosedError:
                return
            except Exception:
                await self._pause(1.0)
                continue
            await asyncio.gather(*(self.handle(message) for message in messages))

    ExecutorRunner._loop = loop  # type: ignore[method-assign]


def _sqlite_normal(_value: str) -> None:
    """Service: `PRAGMA synchronous=NORMAL` on every SQLite connection (event store too).

    For measurement only: it shows what the WAL fsync per commit costs. The
    eventsourcing recorder's connections keep SQLite's default FULL (an fsync
    per commit); the ledger's own connection already uses NORMAL. Weakening an
    audit ledger's durability is a decision, not a tuning knob: the recommended
    fix is fewer transactions per operation, not this.
    """
    original = sqlite3.connect

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        connection = original(*args, **kwargs)
        with contextlib.suppress(sqlite3.Error):
            connection.execute("PRAGMA synchronous=NORMAL")
        return connection

    sqlite3.connect = connect


def _switch_interval(value: str) -> None:
    """Service: a shorter GIL switch interval (Python's default is 5 ms).

    For diagnosis: the ledger thread releases the GIL around every SQLite
    call; while the event loop thread is busy, getting it back can take up to
    one switch interval, so a transaction of a dozen statements waits for the
    loop's Python work many times over ("convoy effect"). If a shorter
    interval makes the ledger thread's work much faster, that is where its
    time went. The real fix is `inline-ledger` or fewer statements per batch.
    """
    sys.setswitchinterval(float(value or 0.0005))


def _inline_ledger(_value: str) -> None:
    """Service: run ledger work on the event loop thread instead of the ledger thread.

    Stands for: `ledger/server/gateway.py`, `LedgerGateway` (its
    `ThreadPoolExecutor(max_workers=1)` and `run_in_executor` calls), call the
    ledger directly. Both threads need the GIL for nearly all their work, so
    the thread buys no parallelism, only hand-offs (a future, a self-pipe
    wake-up per call) and GIL convoys; SQLite's own waits (an fsync is about
    0.2 ms on this disk) are short. With batches of many operations per call,
    blocking the loop for one batch is the cheaper trade.
    """
    from concurrent.futures import Executor, Future

    from ledger.server import gateway

    class InlineExecutor(Executor):
        def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
            future: Future[Any] = Future()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)
            return future

    original = gateway.LedgerGateway.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._thread.shutdown(wait=False)
        self._thread = InlineExecutor()

    gateway.LedgerGateway.__init__ = init  # type: ignore[method-assign]


def _plain_handlers(value: str) -> None:
    """Service: serve propose/status/lease with plain nats-py subscriptions, not FastStream.

    Stands for: `ledger/server/app.py`, `LedgerService._register` / `start`,
    subscribe with `nc.subscribe(subject, queue=..., cb=...)` and start one
    task per request (at most N at once) that calls the same `_propose` /
    `_status` / `_lease` and answers through the same `reply_allowed` check.
    Per request FastStream runs its middleware and dependency machinery,
    writes two log lines and hops to a worker thread about eight times
    (`fast_depends.utils.run_in_threadpool` for sync steps): CPU the ledger
    needs for itself. Implies `handlers` (requests run concurrently).
    """
    from ledger.nats.security import reply_allowed
    from ledger.server import app

    limit = int(value or 256)
    original_start = app.LedgerService.start

    def register(_self: Any) -> None:
        return None  # no FastStream subscribers: `start` subscribes below

    async def start(self: Any) -> None:
        await original_start(self)
        nc = self.broker.connection
        slots = asyncio.Semaphore(limit)
        running: set[asyncio.Task[None]] = set()

        async def serve(message: Any, handle: Callable[[bytes, str], Any]) -> None:
            try:
                payload = await handle(message.data, message.subject.rsplit(".", 1)[-1])
                if not isinstance(payload, bytes):
                    payload = app._reply(payload)
                if reply_allowed(message.subject, message.reply):
                    await nc.publish(message.reply, payload)
            except Exception:
                app._log.exception("request on %s failed", message.subject)
            finally:
                slots.release()

        def route(handle: Callable[[bytes, str], Any]) -> Callable[[Any], Any]:
            async def callback(message: Any) -> None:
                await slots.acquire()  # back-pressure: the subscription queues the rest
                task = asyncio.get_running_loop().create_task(serve(message, handle))
                running.add(task)
                task.add_done_callback(running.discard)

            return callback

        queue = self.options.queue_group
        self._bench_subscriptions = [
            await nc.subscribe("ops.propose.*", queue=queue, cb=route(self._propose)),
            await nc.subscribe("ops.status.*", queue=queue, cb=route(self._status)),
            await nc.subscribe("ops.lease.*", queue=queue, cb=route(self._lease)),
        ]
        self._bench_running = running

    app.LedgerService._register = register  # type: ignore[method-assign]
    app.LedgerService.start = start  # type: ignore[method-assign]


def _gc_pauses(_value: str) -> None:
    """Any process: log how long the cyclic garbage collector paused it (for diagnosis).

    Every collection is timed through `gc.callbacks`; at exit the count, the
    total and the longest pause per generation go to stderr (the process's
    log). A long gen-2 pause stops the event loop: a p99 latency suspect.
    """
    import atexit
    import gc
    import time

    started: list[float] = [0.0]
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - started[0])

    gc.callbacks.append(callback)

    def report() -> None:
        for generation, times in pauses.items():
            if times:
                print(
                    f"gc gen{generation}: {len(times)} collections,"
                    f" total {sum(times) * 1e3:.1f} ms, longest {max(times) * 1e3:.2f} ms",
                    file=sys.stderr,
                )

    atexit.register(report)


def _loop_stalls(value: str) -> None:
    """Any asyncio process: log every callback that held the event loop longer than N ms.

    For diagnosis of latency tails: a step of a task (a coroutine between two
    awaits) that runs long delays every other request in the process. At exit
    the count and the slowest steps, by coroutine, go to stderr.
    """
    import atexit
    import time
    from asyncio import events

    limit = float(value or 5.0) / 1000
    slow: dict[str, list[float]] = {}
    original = events.Handle._run

    def timed(self: Any) -> None:
        started = time.perf_counter()
        original(self)
        took = time.perf_counter() - started
        if took > limit:
            callback = getattr(self, "_callback", None)
            owner = getattr(callback, "__self__", None)
            coro = getattr(owner, "get_coro", lambda: None)()
            name = getattr(coro, "__qualname__", None) or repr(callback)[:80]
            slow.setdefault(name, []).append(took)

    events.Handle._run = timed  # type: ignore[method-assign]

    def report() -> None:
        ranked = sorted(slow.items(), key=lambda item: -max(item[1]))
        for name, times in ranked[:15]:
            print(
                f"loop stall {name}: {len(times)} over {limit * 1e3:.0f} ms,"
                f" longest {max(times) * 1e3:.1f} ms",
                file=sys.stderr,
            )

    atexit.register(report)


PATCHES: dict[str, Callable[[str], None]] = {
    "loop-stalls": _loop_stalls,
    "gc-pauses": _gc_pauses,
    "plain-handlers": _plain_handlers,
    "switch-interval": _switch_interval,
    "inline-ledger": _inline_ledger,
    "handlers": _handlers,
    "quiet-access-log": _quiet_access_log,
    "results-timeout": _results_timeout,
    "exec-concurrent": _exec_concurrent,
    "sqlite-normal": _sqlite_normal,
}
"""Experiment name → function applying it (its docstring names the source change)."""


# ------------------------------------------------------------------------- main


def _usage() -> int:
    print(
        "usage: launcher.py [--profile DIR] [--patch NAME[=VALUE]]... -m MODULE [ARGS...]\n"
        f"patches: {', '.join(PATCHES)}",
        file=sys.stderr,
    )
    return 2


def main() -> int:
    """Apply the options, then run `MODULE` as `__main__`; the module's exit code."""
    # By hand, not argparse: everything after `-m MODULE` belongs to the module.
    argv = sys.argv[1:]
    profile_dir: Path | None = None
    patches: list[tuple[str, str]] = []
    while argv and argv[0] != "-m":
        if len(argv) < 2 or argv[0] not in ("--profile", "--patch"):
            return _usage()
        option, value, argv = argv[0], argv[1], argv[2:]
        if option == "--profile":
            profile_dir = Path(value)
        else:
            name, _, setting = value.partition("=")
            if name not in PATCHES:
                return _usage()
            patches.append((name, setting))
    if len(argv) < 2:
        return _usage()
    module, args = argv[1], argv[2:]
    for name, setting in patches:
        PATCHES[name](setting)
    if profile_dir is None:
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    profile_dir.mkdir(parents=True, exist_ok=True)
    _profile_threads(profile_dir)
    sys.argv = [module, *args]
    profile = cProfile.Profile()
    code = 0
    profile.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        profile.disable()
        _dump(profile, profile_dir, "MainThread")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
