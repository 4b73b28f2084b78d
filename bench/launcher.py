"""Run a module as `python -m MODULE ...` would, optionally profiled or with experiments.

    python bench/launcher.py [--profile DIR] [--patch NAME[=VALUE]]... -m MODULE [ARGS...]

`--profile DIR`: cProfile on every thread. `python -m cProfile` sees only the
main thread, but the ledger service does its database work on another thread
(`LedgerGateway`'s executor) and executors run plain tool functions in worker
threads; so `threading.Thread.run` is wrapped to give each thread its own
profiler, and each writes `<thread name>.prof` into DIR when it ends (the main
thread when the module returns or exits).

`--patch NAME`: an *experiment*, applied in this process only: a diagnostic
(how long GC or a loop step paused the process) or a change proposed for code
outside `bench/`, so that the benchmark can say what it would gain. No file
outside `bench/` is edited; none of these is a fix. See `PATCHES` for each.
"""

from __future__ import annotations

import contextlib
import cProfile
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
        connection: sqlite3.Connection = original(*args, **kwargs)
        with contextlib.suppress(sqlite3.Error):
            connection.execute("PRAGMA synchronous=NORMAL")
        return connection

    # Replaced on purpose; its overloads cannot be restated by a wrapper.
    sqlite3.connect = connect  # type: ignore[assignment]


def _switch_interval(value: str) -> None:
    """Service: a shorter GIL switch interval (Python's default is 5 ms).

    For diagnosis: the ledger thread releases the GIL around every SQLite
    call; while the event loop thread is busy, getting it back can take up to
    one switch interval, so a transaction of a dozen statements waits for the
    loop's Python work many times over ("convoy effect"). If a shorter
    interval makes the ledger thread's work much faster, that is where its
    time went. (The service now runs ledger work on the loop thread itself.)
    """
    sys.setswitchinterval(float(value or 0.0005))


def _threads(value: str) -> None:
    """Service: whether the view and seal are refreshed on a thread of their own,
    whatever the storage (`view:on` or `view:off`).

    For comparison: `ServiceOptions.view_thread` is on for PostgreSQL and off for
    SQLite by default.
    """
    from dataclasses import replace

    from ledger.server import app

    chosen = dict(part.split(":", 1) for part in value.split("+") if part)
    fields = {"view": "view_thread"}
    changes: dict[str, Any] = {fields[name]: setting == "on" for name, setting in chosen.items()}
    original = app.LedgerService.__init__

    def init(self: app.LedgerService, ledger: Any, options: app.ServiceOptions) -> None:
        original(self, ledger, replace(options, **changes))

    app.LedgerService.__init__ = init  # type: ignore[method-assign]


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
        # What a full collection has to walk (the frozen objects aside): by type.
        oldest = gc.get_objects(generation=2)
        kinds: dict[str, int] = {}
        for item in oldest:
            name = f"{type(item).__module__}.{type(item).__qualname__}"
            kinds[name] = kinds.get(name, 0) + 1
        top = sorted(kinds.items(), key=lambda kind: -kind[1])[:12]
        print(
            f"gc gen2 holds {len(oldest)} objects ({gc.get_freeze_count()} frozen): "
            + ", ".join(f"{name} {count}" for name, count in top),
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


def _cpu_split(_value: str) -> None:
    """Service: the CPU time each ledger and relay step took, and the event loop's total.

    For diagnosis of where an operation's CPU goes at low rates: every call
    of the steps below is timed with `time.thread_time` (CPU of the loop's
    thread, kernel time included), and at exit the total, the call count and
    the time per call go to stderr, beside the CPU time of the whole loop.
    What the steps do not cover is NATS messaging and asyncio itself.
    """
    import asyncio.base_events
    import atexit
    import functools
    import time

    from ledger.server import relay
    from ledger.service import (
        CommandRunner,
        Leasing,
        ReadModels,
        ResultRecording,
        StatusReader,
        Submissions,
    )

    totals: dict[str, list[float]] = {}

    def timed(owner: Any, name: str) -> None:
        original = getattr(owner, name)
        label = f"{owner.__name__}.{name}"

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                entry = totals.setdefault(label, [0.0, 0])
                entry[0] += time.thread_time() - started
                entry[1] += 1

        setattr(owner, name, wrapper)

    # Patched on the classes that define them (the ledger binds their methods when it
    # is built, after this runs).
    timed(Submissions, "submit_many")
    timed(Leasing, "lease_many")
    timed(ResultRecording, "record_results")
    timed(ReadModels, "refresh")
    timed(StatusReader, "status")
    timed(CommandRunner, "save")
    timed(relay.Relay, "_read_batch")
    timed(asyncio.base_events.BaseEventLoop, "_run_once")

    def report() -> None:
        for label, (seconds, calls) in sorted(totals.items(), key=lambda item: -item[1][0]):
            print(
                f"cpu {label}: {seconds * 1e3:.0f} ms in {int(calls)} calls,"
                f" {seconds / max(calls, 1) * 1e6:.0f} us each",
                file=sys.stderr,
            )

    atexit.register(report)


def _pg_statements(_value: str) -> None:
    """Service: count the PostgreSQL statements each ledger and relay step sends.

    For diagnosis of round trips per operation: every `execute`, `executemany`
    and commit of psycopg is counted under the step running on that thread
    (the wrappers of `cpu-split`'s steps), by the statement's first words; at
    exit the totals go to stderr. Nothing is changed in what is sent.
    """
    import atexit
    import functools

    import psycopg

    from ledger.server import relay
    from ledger.service import Leasing, ReadModels, ResultRecording, StatusReader, Submissions

    current = threading.local()
    counts: dict[tuple[str, str], int] = {}
    calls: dict[str, int] = {}

    def count(kind: str) -> None:
        step = getattr(current, "step", None) or "other"
        counts[(step, kind)] = counts.get((step, kind), 0) + 1

    def stepped(owner: Any, name: str) -> None:
        original = getattr(owner, name)
        label = f"{owner.__name__}.{name}"

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(current, "step", None)
            if outer is None:
                current.step = label
                calls[label] = calls.get(label, 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                if outer is None:
                    current.step = None

        setattr(owner, name, wrapper)

    def words(query: Any) -> str:
        text = query.as_string(None) if hasattr(query, "as_string") else str(query)
        return " ".join(text.split()[:3])[:48]

    for method in ("execute", "executemany"):
        original = getattr(psycopg.Cursor, method)

        def counted(self: Any, query: Any, *args: Any, _o: Any = original, _m: str = method,
                    **kwargs: Any) -> Any:
            count(f"{_m}: {words(query)}")
            return _o(self, query, *args, **kwargs)

        setattr(psycopg.Cursor, method, counted)
    commit = psycopg.Connection.commit

    def committed(self: Any) -> None:
        count("commit")
        commit(self)

    psycopg.Connection.commit = committed  # type: ignore[method-assign]
    transaction_exit = psycopg.Transaction.__exit__

    def transaction_done(self: Any, *args: Any) -> Any:
        count("transaction end")
        return transaction_exit(self, *args)

    psycopg.Transaction.__exit__ = transaction_done  # type: ignore[method-assign]

    steps: tuple[tuple[type, str], ...] = (
        (Submissions, "submit_many"),
        (Leasing, "lease_many"),
        (Leasing, "check_in"),
        (ResultRecording, "record_results"),
        (ReadModels, "refresh"),
        (ReadModels, "seal_now"),
        (StatusReader, "status"),
        (relay.Relay, "_read_batch"),
    )
    for owner, name in steps:
        stepped(owner, name)

    def report() -> None:
        total = sum(counts.values())
        print(f"pg statements: {total} in all", file=sys.stderr)
        for label, n in sorted(calls.items()):
            print(f"pg step {label}: {n} calls", file=sys.stderr)
        for (step, kind), n in sorted(counts.items(), key=lambda item: -item[1]):
            print(f"pg {n:8d}  {step:28s} {kind}", file=sys.stderr)

    atexit.register(report)


def _lease_in_result(_value: str) -> None:
    """Service and executor, both: the ceiling of granting the lease at dispatch.

    **Unsafe, for measurement only** (`docs/dispatch-leases.md`): the executor
    runs an item without asking for a lease (it makes up attempt 1, token 1,
    the arguments `{"n": 0}` and no context, which the bench's no-op ignores), and the
    service claims the lease in the same append as the result. No claim is
    made anywhere before the call runs, so a crash or a redelivery could run it
    twice; the broker claim that would prevent that is not made either, so its
    round trip (a JetStream publish) is missing from the figures. Given to the
    service and to the executors (`--service-patches lease-in-result
    --executor-patches lease-in-result`), it shows how much of an operation's
    time and CPU the lease hop and its commit hold.
    """
    from datetime import UTC, datetime, timedelta

    from executors import ExecutorRunner
    from ledger.domain.states import OperationState
    from ledger.service import ResultRecording
    from schemas import LeaseDecision, LeaseReply

    original_lease = ExecutorRunner._lease

    async def lease(self: Any, request: Any) -> Any:
        if request.holding is not None:  # a check-in while running: as before
            return await original_lease(self, request)
        return LeaseReply(
            decision=LeaseDecision.EXECUTE,
            operation_id=request.operation_id,
            tool=self.contract.name,
            tool_version=self.contract.version,
            arguments={"n": 0},
            fencing_token=1,
            attempt=1,
            lease_expires_at=datetime.now(UTC) + timedelta(seconds=60),
            timeout_ms=self.contract.timeout_ms,
        )

    original_apply = ResultRecording._apply

    def apply(self: Any, operation: Any, envelope: Any) -> Any:
        if operation.state is OperationState.READY and envelope.fencing_token == 1:
            operation.claim_lease(
                executor=envelope.provenance.executor,
                ttl=timedelta(seconds=60),
                now=self._clock(),
                checked={"patched": "lease-in-result"},
            )
        return original_apply(self, operation, envelope)

    # Both processes load both packages; each only ever calls its own half.
    ExecutorRunner._lease = lease  # type: ignore[method-assign]
    ResultRecording._apply = apply  # type: ignore[method-assign]


def _any_reply(_value: str) -> None:
    """Service: answer a request at any reply subject (for `e2e_bench --nats-rights open`).

    Unsafe, for that diagnostic only: `reply_allowed` keeps the service from
    publishing a lease answer anywhere but the `_R_.` subject the executor's service
    import gives it, and with every identity in one account there is no import.
    """
    from ledger.server import requests

    def reply_allowed(request_subject: str, reply: str | None) -> bool:  # noqa: ARG001
        return bool(reply)

    setattr(requests, "reply_allowed", reply_allowed)  # noqa: B010 (not exported there)


def _no_feed(_value: str) -> None:
    """Service: publish no feed event (a ceiling: what the feed costs every process).

    **Breaks the product, for measurement only**: the feed is the auditors' and the
    dashboards' record on NATS. Work items and outcome notices go out as before.
    """
    from ledger.server.relay.publisher import RelayPublisher

    original = RelayPublisher.publish

    async def publish(self: Any, messages: list[Any]) -> Any:
        return await original(self, [message for message in messages if not message.feed])

    RelayPublisher.publish = publish  # type: ignore[method-assign]


PATCHES: dict[str, Callable[[str], None]] = {
    "no-feed": _no_feed,
    "loop-stalls": _loop_stalls,
    "gc-pauses": _gc_pauses,
    "switch-interval": _switch_interval,
    "threads": _threads,
    "sqlite-normal": _sqlite_normal,
    "cpu-split": _cpu_split,
    "pg-statements": _pg_statements,
    "lease-in-result": _lease_in_result,
    "any-reply": _any_reply,
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
