"""The executor's per-item core: work item → lease → action → result envelope.

Nothing here touches NATS. `ItemProcessor.process` takes the raw work item,
a function that asks the ledger for the lease and a function that tells the
server "still working", and returns an `ItemDisposition`: what the runner
must do with the message (ack, nak with a delay, terminate, or publish an
envelope and then ack). Tests drive it with a fake lease responder.

The rules (seed 001):

- `done` → ack: the operation has its outcome; redeliveries converge here.
- `busy` → nak until about when the other executor's lease runs out.
- `execute` → re-check preconditions, run under the timeout, validate the
  output against the contract, redact, publish. A failure is an error
  envelope with a category, never a raw exception text. A timeout, a crash
  or an untrustworthy output of a *write* tool is `outcome_unknown`: the
  side effect may have happened, so only reconciliation may decide.
- `reconcile` → ask the tool what happened under the idempotency key.
- `preview` → run the tool's preview (a dry run) for the approvers and send it
  back; with `execute`, a call approved on a preview is previewed again first,
  and not run if its effect changed since (`PREVIEW_CHANGED`).
- `refused` → terminate: the ledger will never lease it to this tool.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from types import MappingProxyType
from typing import Any

import orjson
from pydantic import ValidationError

from executors._api import (
    Precondition,
    PreconditionVerdict,
    ReconcileStatus,
    Reconciliation,
    Tool,
    ToolContext,
    ToolError,
)
from executors._errors import ExecutorConfigError, LeaseError
from executors._metrics import ExecutorMetrics
from executors._redact import DEFAULT_POLICY, RedactionPolicy, redact, redact_text
from executors._tracing import describe_result, execute_tool_span, reconcile_span
from policy import DEFAULT_LIMITS, CompiledSchema, ToolContract, json_value_issue
from schemas import (
    CANCELLED_BEFORE_EFFECT,
    PREVIEW_MAX_BYTES,
    RECONCILE_UNSUPPORTED,
    CanonicalizationError,
    CheckStage,
    ErrorCategory,
    ErrorInfo,
    LeaseDecision,
    LeaseReply,
    LeaseRequest,
    PreviewReport,
    Provenance,
    ResultEnvelope,
    TrustLabel,
    WorkItem,
    cancel_and_wait,
    canonical_json,
    result_message_id,
    sha256_hex,
)

__all__ = [
    "HeartbeatFn",
    "ItemAction",
    "ItemDisposition",
    "ItemProcessor",
    "LeaseFn",
    "ProcessorOptions",
    "result_msg_id",
    "wait_through_cancels",
]

LeaseFn = Callable[[LeaseRequest], Awaitable[LeaseReply]]
"""Ask the ledger for the lease on one operation (a core NATS request in production)."""
HeartbeatFn = Callable[[], Awaitable[None]]
"""Tell the server the item is still being worked on (`msg.in_progress()`)."""

_MAX_MESSAGE_CHARS = 500
_MAX_DETAIL_ISSUES = 5


class ItemAction(StrEnum):
    """What the runner does with the work item's message."""

    ACK = "ack"
    """Acknowledge: nothing (more) to do."""
    NAK = "nak"
    """Negative-acknowledge with `delay_s`: it comes back later."""
    TERM = "term"
    """Terminate: a malformed item that no redelivery can fix."""
    PUBLISH = "publish"
    """Publish `envelope` as a JetStream message, wait for the PubAck, then ack."""


@dataclass(frozen=True, slots=True)
class ItemDisposition:
    """The core's verdict on one work item."""

    action: ItemAction
    reason: str
    """A fixed word (a metric label value): done, busy, executed, reconciled, ..."""
    envelope: ResultEnvelope | None = None
    delay_s: float | None = None
    keep_until: datetime | None = None
    """For PUBLISH: keep trying to publish the envelope until then (the lease's expiry),
    however long the results stream is unavailable; None: the runner's usual tries."""



result_msg_id = result_message_id
"""`schemas.result_message_id`, the result's `Nats-Msg-Id` (kept under its old name)."""


def _utcnow() -> datetime:
    return datetime.now(UTC)


async def _invoke(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a tool function: `async` ones directly, plain ones in a daemon thread.

    A thread keeps a blocking provider call from starving the heartbeat. It
    cannot be interrupted: after a timeout the call may still finish, which is
    exactly why a timed-out write is reported as outcome unknown. The thread is
    a daemon so that a call stuck forever cannot keep the process from exiting
    on a stop (a worker of the default executor would be joined at exit).
    """
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(outcome: Any, failed: bool) -> None:
        if future.done():  # timed out or cancelled meanwhile: nobody waits any more
            return
        if failed:
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def target() -> None:
        try:
            outcome, failed = fn(*args), False
        except BaseException as exc:
            outcome, failed = exc, True
        with contextlib.suppress(RuntimeError):  # the loop closed: the process is stopping
            loop.call_soon_threadsafe(settle, outcome, failed)

    threading.Thread(
        target=target, name=f"tool-{getattr(fn, '__name__', 'call')}", daemon=True
    ).start()
    result = await future
    if inspect.isawaitable(result):
        return await result
    return result


class _StoppedOnCancel(Exception):
    """The tool stopped on a cancel request before any effect (internal control flow)."""


class _ProgressAcks:
    """In-progress acks every interval while one item is processed, until `stop`.

    In-progress acks reset the consumer's ack timer, so long work is not
    redelivered to a second executor while this one is still on it. A timer, not a
    task, waits for each: most items are done within one interval and never need
    one. One ack at a time: the next interval starts when the last ack is done.
    """

    def __init__(self, interval: float, heartbeat: HeartbeatFn, log: logging.Logger) -> None:
        self._loop = asyncio.get_running_loop()
        self._interval = interval
        self._heartbeat = heartbeat
        self._log = log
        self._stopped = False
        self._beating: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(interval, self._due)

    def _due(self) -> None:
        self._timer = None
        self._beating = self._loop.create_task(self._beat())

    async def _beat(self) -> None:
        try:
            await self._heartbeat()
        except Exception:  # a lost heartbeat only risks a redelivery, which converges
            self._log.warning("in-progress ack failed", exc_info=True)
        if not self._stopped:
            self._timer = self._loop.call_later(self._interval, self._due)

    async def stop(self) -> None:
        """No more acks; an ack under way is cancelled."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        beating, self._beating = self._beating, None
        # Not `await task` under `suppress(CancelledError)`, which would also swallow a
        # cancel of the caller arriving meanwhile (an executor stopping); and again
        # until it ends, since nats-py may drop one cancel (`cancel_and_wait`).
        await cancel_and_wait(beating)


_RUN_STOP_S = 1.0
"""How long a tool's cancelled call has to end before its item ends without it."""


async def wait_through_cancels(task: asyncio.Task[Any], seconds: float) -> bool:
    """Wait up to `seconds` for `task` to end, also through cancels of the caller; True
    if the caller was cancelled meanwhile (it raises that once what it must still do is
    done: a tool's close, a cancelled call's end)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    cancelled = False
    while not task.done() and (left := deadline - loop.time()) > 0:
        try:
            await asyncio.wait({task}, timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


async def _ended_within(run: asyncio.Task[Any], seconds: float) -> bool:
    """Wait (up to `seconds`) until the cancelled `run` has ended, also through further
    cancels of the caller; True if the caller was cancelled meanwhile
    (`wait_through_cancels`).

    The tool's call runs in a task of its own, cancelled when its item stops (a
    deadline, a cancel, a second SIGTERM). Not waited for, a call still unwinding (an
    MCP call telling its server it was cancelled) or one that takes a while over its
    cancel outlived its item, and, when the executor stopped, the tool's `close` (found
    in review). A call in a worker thread (`_invoke`) ends at once here: its thread
    cannot be stopped and is not waited for.
    """
    cancelled = await wait_through_cancels(run, seconds)
    if run.done() and not run.cancelled():
        run.exception()  # retrieved: what a call cut off raised is not its item's
    return cancelled


def _hook(fn: Callable[..., Any], *args: Any) -> asyncio.Task[Any]:
    """A tool's function (`run` or a hook) in a task of its own: its context is a copy,
    so what it sets (a context variable, an OpenTelemetry context it attached and left
    attached) stays its own, not the item's, whose result carries trace headers."""
    return asyncio.ensure_future(_invoke(fn, *args))


class _Untrusted(Exception):
    """The tool's output cannot be reported as it is (internal control flow)."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One leased attempt: what every envelope of it needs."""

    operation_id: str
    attempt: int
    fencing_token: int
    started: float
    """`time.monotonic()` when the lease was granted."""
    lease_expires_at: datetime | None = None
    """When the ledger's lease runs out (None for a lookup: it holds no lease)."""
    lookup: int | None = None
    """For a lookup: which one (from the lease), named in its answer."""


@dataclass(frozen=True, slots=True)
class ProcessorOptions:
    """How an `ItemProcessor` works: who it is, what it holds, and its timings.

    Only `executor` has no default: every published result names the process
    that produced it.
    """

    executor: str
    """This executor's identity, recorded in each result's provenance."""
    secrets: Mapping[str, str] | None = None
    """This executor's own secrets (names case-insensitive); checked against the tool's needs."""
    redaction: RedactionPolicy = DEFAULT_POLICY
    """What is scrubbed from outputs and errors; the secrets' values are always added."""
    metrics: ExecutorMetrics | None = None
    """Where counts go; None makes a fresh set (tests and embedded use)."""
    clock: Callable[[], datetime] = _utcnow
    """The wall clock for deadlines and timestamps (a fake in tests)."""
    heartbeat_interval_s: float = 5.0
    """Seconds between in-progress acks while an item is processed, and between the
    ledger check-ins of a running tool (the first one interval after it started)."""
    retry_delay_s: float = 5.0
    """Seconds before an item comes back after a problem on this side (no lease answer,
    a failed lookup)."""
    busy_delay_bounds_s: tuple[float, float] = (1.0, 30.0)
    """The wait behind another executor's lease is clamped to these bounds."""
    give_up_after_deliveries: int = 5
    """When a failing provider lookup becomes "unknown, reconcile by hand" and a refused
    lease request is dropped."""
    max_result_bytes: int = 512 * 1024
    """The largest result envelope published; a bigger output is a failure instead."""
    logger: logging.Logger | None = None
    """Where the processor logs; None: `opledger.executor.<tool>`."""


class ItemProcessor:
    """Turns work items into dispositions for one tool at one pinned contract version.

    Its knobs are a `ProcessorOptions`.
    """

    def __init__(self, tool: Tool, contract: ToolContract, options: ProcessorOptions) -> None:
        executor, secrets, redaction = options.executor, options.secrets, options.redaction
        self.options = options
        if tool.name != contract.name:
            raise ExecutorConfigError(
                f"tool {tool.name!r} cannot run contract {contract.name!r}", tool=tool.name
            )
        if tool.version is not None and tool.version != contract.version:
            raise ExecutorConfigError(
                f"{tool.name} implements version {tool.version}, contract is {contract.version}",
                tool=tool.name,
            )
        # Read-only: a tool must not change what the next attempt sees.
        # Names are case-insensitive (as `load_secrets` and `ToolContext.secret` treat them).
        self.secrets: Mapping[str, str] = MappingProxyType(
            {name.lower(): value for name, value in (secrets or {}).items()}
        )
        missing = [name for name in tool.required_secrets if name not in self.secrets]
        if missing:
            raise ExecutorConfigError(
                f"{tool.name} needs secrets {', '.join(missing)} "
                "(--secrets FILE or OPLEDGER_SECRET_<NAME>)",
                missing=missing,
            )
        self.tool = tool
        self.contract = contract
        self.executor = executor
        # The executor's own secret values are scrubbed from anything it publishes.
        self.redaction = redaction.with_secrets(self.secrets.values())
        self.metrics = options.metrics if options.metrics is not None else ExecutorMetrics()
        self._clock = options.clock
        self._heartbeat_interval = options.heartbeat_interval_s
        self._retry_delay = options.retry_delay_s
        self._busy_bounds = options.busy_delay_bounds_s
        self._give_up_after = options.give_up_after_deliveries
        self._max_result_bytes = options.max_result_bytes
        self._log = options.logger or logging.getLogger(f"opledger.executor.{tool.name}")
        self._input = CompiledSchema(contract.input_schema, stage=CheckStage.STRUCTURE)
        self._output = CompiledSchema(contract.output_schema, stage=CheckStage.STRUCTURE)
        self._writes = contract.effect.writes

    # ------------------------------------------------------------------ entry

    async def process(
        self,
        payload: bytes,
        *,
        lease: LeaseFn,
        heartbeat: HeartbeatFn,
        delivery: int = 1,
    ) -> ItemDisposition:
        """Decide what to do with one work item; `delivery` is JetStream's delivery count."""
        acks = _ProgressAcks(self._heartbeat_interval, heartbeat, self._log)
        try:
            disposition = await self._process(payload, lease, delivery)
        finally:
            await acks.stop()
        self.metrics.items.labels(tool=self.contract.name, action=disposition.reason).inc()
        if disposition.action is ItemAction.NAK:
            self.metrics.retries.labels(reason=disposition.reason).inc()
        return disposition

    async def _process(self, payload: bytes, lease: LeaseFn, delivery: int) -> ItemDisposition:
        try:
            item = WorkItem.model_validate_json(payload)
        except ValidationError:
            # Redelivering cannot repair it; the ledger still has the operation.
            self._log.error("malformed work item (%d bytes) terminated", len(payload))
            return ItemDisposition(ItemAction.TERM, "malformed")
        if item.tool != self.contract.name:
            self._log.error("work item of tool %r on %r's queue", item.tool, self.contract.name)
            return ItemDisposition(ItemAction.TERM, "wrong_tool")
        if item.tool_version != self.contract.version:
            # Another executor may run that version (a rolling upgrade); never
            # run a call checked against a contract this code does not implement.
            return ItemDisposition(ItemAction.NAK, "version_mismatch", delay_s=self._retry_delay)
        if delivery > 1:
            self.metrics.retries.labels(reason="redelivered").inc()
        reply = await self._ask(
            lease, LeaseRequest(operation_id=item.operation_id, executor=self.executor), delivery
        )
        if isinstance(reply, ItemDisposition):
            return reply
        if reply.operation_id != item.operation_id:
            self._log.error("lease reply for %s answered %s", item.operation_id, reply.operation_id)
            return ItemDisposition(ItemAction.NAK, "lease_invalid", delay_s=self._retry_delay)
        if reply.decision is LeaseDecision.DONE:
            return ItemDisposition(ItemAction.ACK, "done")
        if reply.decision is LeaseDecision.BUSY:
            return ItemDisposition(ItemAction.NAK, "busy", delay_s=self._busy_delay(reply))
        if reply.decision is LeaseDecision.PREVIEW:
            return await self._preview_for_approvers(item, reply, lease, delivery)
        if reply.decision not in (LeaseDecision.EXECUTE, LeaseDecision.RECONCILE):
            # A decision this executor does not know: never guess "execute".
            self._log.error("unknown lease decision %r for %s", reply.decision, item.operation_id)
            return ItemDisposition(ItemAction.NAK, "lease_invalid", delay_s=self._retry_delay)
        if reply.fencing_token is None or reply.attempt is None or reply.fencing_token < 1:
            # Without a token no envelope can be filed; the lease runs out and
            # the ledger moves on. Say so loudly: this is a ledger bug.
            self._log.error("lease for %s has no fencing token or attempt", item.operation_id)
            return ItemDisposition(ItemAction.NAK, "lease_invalid", delay_s=self._retry_delay)
        attempt = _Attempt(
            item.operation_id,
            reply.attempt,
            reply.fencing_token,
            time.monotonic(),
            reply.lease_expires_at,
            reply.lookup if reply.decision is LeaseDecision.RECONCILE else None,
        )
        mismatch = self._lease_mismatch(reply)
        if mismatch:
            # We hold the lease and did nothing: "failed" is the truth.
            self._log.error("lease for %s: %s", item.operation_id, mismatch)
            return self._failure(
                attempt,
                ErrorInfo(code="LEASE_MISMATCH", category=ErrorCategory.INTERNAL, message=mismatch),
                reason="lease_invalid",
            )
        if reply.decision is LeaseDecision.RECONCILE:
            with reconcile_span(
                self.contract,
                operation_id=attempt.operation_id,
                attempt=attempt.attempt,
                lookup=attempt.lookup,
            ) as span:
                disposition = await self._reconcile(attempt, reply, delivery)
                describe_result(span, disposition.envelope, disposition.reason)
            return disposition
        return await self._execute(attempt, reply, lease)

    async def _ask(
        self, lease: LeaseFn, request: LeaseRequest, delivery: int
    ) -> LeaseReply | ItemDisposition:
        """The ledger's answer to a lease request about the item, or what to do with the
        item without one (a refusal: put back, then dropped; no answer: put back)."""
        try:
            return await lease(request)
        except LeaseError as refusal:
            return self._lease_error(request.operation_id, refusal.error, delivery)
        except Exception as exc:
            self._log.warning(
                "no lease answer for %s: %s", request.operation_id, type(exc).__name__
            )
            return ItemDisposition(ItemAction.NAK, "lease_unavailable", delay_s=self._retry_delay)

    def _lease_error(self, operation_id: str, error: ErrorInfo, delivery: int) -> ItemDisposition:
        self._log.warning(
            "lease for %s answered %s (%s)", operation_id, error.code, error.category.value
        )
        transient = error.category in (ErrorCategory.TRANSIENT, ErrorCategory.INTERNAL)
        if transient or delivery < self._give_up_after:
            # A ledger that just started, or a replica behind, may know it next time.
            return ItemDisposition(ItemAction.NAK, "lease_error", delay_s=self._retry_delay)
        return ItemDisposition(ItemAction.TERM, "lease_refused")

    def _busy_delay(self, reply: LeaseReply) -> float:
        low, high = self._busy_bounds
        if reply.not_before is not None:
            # A retry's backoff: back exactly then (a short margin for clocks),
            # never spinning on the lease before it.
            wait = (reply.not_before - self._clock()).total_seconds() + 0.05
            return min(max(wait, 0.05), high)
        if reply.lease_expires_at is None:
            return min(low * 5, high)
        # Until shortly after the other lease runs out: by then its holder has
        # reported (the ledger answers `done`) or the ledger asks to reconcile.
        wait = (reply.lease_expires_at - self._clock()).total_seconds() + 0.5
        return min(max(wait, low), high)

    def _lease_mismatch(self, reply: LeaseReply) -> str:
        if reply.tool is not None and reply.tool != self.contract.name:
            return f"lease names tool {reply.tool!r}"
        if reply.tool_version is not None and reply.tool_version != self.contract.version:
            return (
                f"lease names version {reply.tool_version}, executor runs {self.contract.version}"
            )
        if reply.decision is LeaseDecision.EXECUTE and reply.arguments is None:
            return "execute lease without arguments"
        return ""

    def _context(self, attempt: _Attempt, timeout_s: float, reply: LeaseReply) -> ToolContext:
        trusted = reply.context
        return ToolContext(
            operation_id=attempt.operation_id,
            attempt=attempt.attempt,
            deadline=self._clock() + timedelta(seconds=timeout_s),
            fencing_token=attempt.fencing_token,
            secrets=self.secrets,
            logger=logging.LoggerAdapter(
                self._log,
                {"operation_id": attempt.operation_id, "attempt": attempt.attempt},
            ),
            tool=self.contract.name,
            tool_version=self.contract.version,
            executor=self.executor,
            # From the ledger's lease reply only: nothing in the work item or the
            # arguments can name another tenant.
            principal=trusted.principal if trusted else "",
            tenant=trusted.tenant if trusted else "",
            capabilities=trusted.capabilities if trusted else frozenset(),
            environment=trusted.environment if trusted else "",
        )

    # ---------------------------------------------------------------- execute

    async def _execute(
        self, attempt: _Attempt, reply: LeaseReply, lease: LeaseFn
    ) -> ItemDisposition:
        timeout_s = (reply.timeout_ms or self.contract.timeout_ms) / 1000
        deadline = attempt.started + timeout_s
        context = self._context(attempt, timeout_s, reply)
        arguments: dict[str, Any] = dict(reply.arguments or {})
        try:
            disposition = await self._execute_checked(
                attempt,
                arguments,
                context,
                deadline,
                round(timeout_s * 1000),
                lease,
                reply.preview_hash,
            )
        finally:
            self.metrics.duration.labels(tool=self.contract.name).observe(
                time.monotonic() - attempt.started
            )
        return disposition

    async def _execute_checked(
        self,
        attempt: _Attempt,
        arguments: dict[str, Any],
        context: ToolContext,
        deadline: float,
        timeout_ms: int,
        lease: LeaseFn,
        preview_hash: str | None = None,
    ) -> ItemDisposition:
        # The ledger checked these arguments; checking them again against the
        # pinned schema catches a ledger and an executor that disagree on it.
        issues = self._input.issues(arguments)
        if issues:
            return self._failure(
                attempt,
                ErrorInfo(
                    code="ARGUMENTS_INVALID",
                    category=ErrorCategory.INVALID_INPUT,
                    message="the leased arguments do not match the executor's input schema",
                    safe_details={"issues": _issue_summary(issues)},
                ),
            )
        if self.tool.check_preconditions is not None:
            checked = await self._check_preconditions(attempt, arguments, context, deadline)
            if isinstance(checked, ItemDisposition):
                return checked
            if checked.verdict is PreconditionVerdict.STALE:
                return self._failure(
                    attempt,
                    ErrorInfo(
                        code=checked.code or "PRECONDITION_STALE",
                        category=ErrorCategory.CONFLICT,
                        message=checked.reason or "the target changed after the call was approved",
                    ),
                )
            if checked.verdict is PreconditionVerdict.ALREADY_APPLIED:
                return await self._report_output(
                    attempt, arguments, checked.data, context, reason="already_applied"
                )
        if preview_hash is not None:
            # Last before the run (after the preconditions: an effect already applied is
            # reported as such, not previewed again), as close to the effect as it gets.
            changed = await self._preview_changed(arguments, context, deadline, preview_hash)
            if changed is not None:
                return self._failure(attempt, changed)
        # The GenAI conventions' span covers the tool's run itself: not a lookup, not a
        # precondition that finds the call stale or applied already, not a replay.
        with execute_tool_span(
            self.contract,
            operation_id=attempt.operation_id,
            attempt=attempt.attempt,
            fencing_token=attempt.fencing_token,
            executor=self.executor,
            arguments=arguments,
            redaction=self.redaction,
        ) as span:
            disposition = await self._run_and_report(
                attempt, arguments, context, deadline, timeout_ms, lease
            )
            describe_result(span, disposition.envelope, disposition.reason)
        return disposition

    async def _run_and_report(
        self,
        attempt: _Attempt,
        arguments: dict[str, Any],
        context: ToolContext,
        deadline: float,
        timeout_ms: int,
        lease: LeaseFn,
    ) -> ItemDisposition:
        try:
            output = await self._run_watched(attempt, arguments, context, deadline, lease)
        except _StoppedOnCancel:
            return self._failure(
                attempt,
                ErrorInfo(
                    code=CANCELLED_BEFORE_EFFECT,
                    category=ErrorCategory.POLICY_DENIED,
                    message="stopped while running (cancelled, or its lease ran out) before any"
                    " effect",
                ),
                reason="cancelled",
            )
        except TimeoutError:
            return self._failure(
                attempt,
                ErrorInfo(
                    code="EXECUTION_TIMEOUT",
                    category=ErrorCategory.TRANSIENT,
                    message=f"the tool did not finish within {timeout_ms} ms",
                    # A read may simply be retried; a write must be reconciled first.
                    retryable=not self._writes,
                ),
                unknown=self._writes,
            )
        except ToolError as error:
            return self._failure(
                attempt,
                self._tool_error_info(error),
                unknown=self._writes and error.outcome_unknown,
            )
        except Exception:
            # The trace stays in this process's log; the envelope says only that it broke.
            self._log.exception("tool %s crashed on %s", self.contract.name, attempt.operation_id)
            return self._failure(
                attempt,
                ErrorInfo(
                    code="TOOL_CRASHED",
                    category=ErrorCategory.INTERNAL,
                    message="the tool failed unexpectedly",
                ),
                unknown=self._writes,
            )
        return await self._report_output(attempt, arguments, output, context, reason="executed")

    async def _run_watched(
        self,
        attempt: _Attempt,
        arguments: dict[str, Any],
        context: ToolContext,
        deadline: float,
        lease: LeaseFn,
    ) -> Any:
        """The tool's output; while it runs, the executor checks in with the ledger.

        Every progress interval it asks whether to go on (`LeaseRequest.holding`).
        On `cancel`, the tool's `cancel` hook decides: stopped before any effect
        raises `_StoppedOnCancel` (the run is abandoned); too late, or no hook,
        and the call runs on to its outcome. `TimeoutError` at the deadline.
        """
        run = _hook(self.tool.run, arguments, context)
        watch: asyncio.Task[bool] | None = None
        stopping = False
        try:
            # Most calls finish within one progress interval, before any check-in is
            # due: they get no check-in task (with the in-progress acks' task, two
            # tasks per item were a fifth of an executor's CPU at throughput,
            # bench/e2e_bench.py).
            remaining = max(deadline - time.monotonic(), 0)
            done, _ = await asyncio.wait({run}, timeout=min(self._heartbeat_interval, remaining))
            if run in done:
                return run.result()
            # A check-in is due now, unless the deadline comes first (then none would
            # be made before it, as when the check-ins started with the call).
            if self._heartbeat_interval < remaining:
                watch = asyncio.create_task(self._watch_for_cancel(attempt, context, lease))
                done, _ = await asyncio.wait(
                    {run, watch},
                    timeout=max(deadline - time.monotonic(), 0),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if run in done:
                    return run.result()
                if watch in done and watch.result():
                    run.cancel()
                    stopping = True
                    if await _ended_within(run, _RUN_STOP_S):
                        raise asyncio.CancelledError
                    if run.done() and not run.cancelled() and run.exception() is None:
                        # The hook said it stopped, yet the call ended with its output:
                        # that is what happened (found in review: it was dropped).
                        return run.result()
                    raise _StoppedOnCancel
            # Too late to stop, nothing asked, or the deadline within one interval: the
            # call runs to its deadline. Waited for, not awaited: an await passes a
            # cancel of the item on to the call and waits however long the call takes
            # to stop (found in review); the `finally` bounds that wait.
            done, _ = await asyncio.wait({run}, timeout=max(deadline - time.monotonic(), 0))
            if run in done:
                return run.result()
            raise TimeoutError
        finally:
            # Its check-in is a nats-py request, which on Python 3.11 may drop the
            # cancel (found in review: the watch then kept checking in, and the item
            # never ended): cancelled first, since the wait for the call below may be
            # cut short, then again until it ends.
            if watch is not None:
                watch.cancel()
            cancelled = False
            if not run.done():
                run.cancel()
                if not stopping:  # waited for once already
                    cancelled = await _ended_within(run, _RUN_STOP_S)
            await cancel_and_wait(watch)
            if cancelled:
                raise asyncio.CancelledError

    async def _watch_for_cancel(
        self, attempt: _Attempt, context: ToolContext, lease: LeaseFn
    ) -> bool:
        """Check in at once, then every progress interval (started once the tool has
        run for one interval); True once the tool stopped on a cancel.

        Returns False (and checks in no more) when a cancel came too late to stop
        it; never returns otherwise, so the run decides.
        """
        request = LeaseRequest(
            operation_id=attempt.operation_id, executor=self.executor, holding=attempt.fencing_token
        )
        pause = 0.0
        while True:
            if pause:
                await asyncio.sleep(pause)
            pause = self._heartbeat_interval
            try:
                reply = await lease(request)
            except Exception as exc:  # a lost check-in only delays a cancel
                self._log.debug("check-in for %s failed: %s", attempt.operation_id, exc)
                continue
            if reply.decision is LeaseDecision.DONE:
                # The lease is no longer ours (it ran out, or the call was settled):
                # stop before an effect if the tool can, as for a cancel.
                why = "lost its lease"
            elif reply.decision is LeaseDecision.CANCEL:
                why = "cancelled"
            else:
                continue
            hook = self.tool.cancel
            if hook is None:
                self._log.info("%s %s while running: too late to stop it",
                               attempt.operation_id, why)
                return False
            try:
                stopped = bool(await _invoke(hook, attempt.operation_id, context))
            except Exception:
                self._log.exception("cancel hook failed on %s", attempt.operation_id)
                stopped = False  # not known to have stopped: it runs on
            self._log.info("%s %s while running: %s", attempt.operation_id, why,
                           "stopped before any effect" if stopped else "too late to stop it")
            return stopped

    async def _check_preconditions(
        self,
        attempt: _Attempt,
        arguments: dict[str, Any],
        context: ToolContext,
        deadline: float,
    ) -> Precondition | ItemDisposition:
        """The verdict, or the failure to publish. No side effect has happened here."""
        assert self.tool.check_preconditions is not None
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError  # no time left: the check is not started at all
            async with asyncio.timeout(left):
                verdict = await _hook(self.tool.check_preconditions, arguments, context)
        except TimeoutError:
            return self._failure(
                attempt,
                ErrorInfo(
                    code="PRECONDITION_TIMEOUT",
                    category=ErrorCategory.TRANSIENT,
                    message="re-checking the target before running took too long",
                    retryable=True,
                ),
            )
        except ToolError as error:
            # A precondition check only reads, so its failure is a known outcome.
            return self._failure(attempt, self._tool_error_info(error))
        except Exception:
            self._log.exception("precondition check crashed on %s", attempt.operation_id)
            return self._failure(
                attempt,
                ErrorInfo(
                    code="PRECONDITION_CHECK_FAILED",
                    category=ErrorCategory.INTERNAL,
                    message="the target could not be re-checked before running",
                ),
            )
        if not isinstance(verdict, Precondition):
            self._log.error("check_preconditions returned %s", type(verdict).__name__)
            return self._failure(
                attempt,
                ErrorInfo(
                    code="PRECONDITION_CHECK_FAILED",
                    category=ErrorCategory.INTERNAL,
                    message="the target could not be re-checked before running",
                ),
            )
        return verdict

    # -------------------------------------------------------------- reconcile

    async def _reconcile(
        self, attempt: _Attempt, reply: LeaseReply, delivery: int
    ) -> ItemDisposition:
        reconcile = self.tool.reconcile
        if reconcile is None:
            if not self._writes:
                # A read changed nothing anywhere: running it again is safe.
                return self._not_applied(attempt, "a read-only tool has no effect to look up")
            return self._failure(
                attempt,
                ErrorInfo(
                    code=RECONCILE_UNSUPPORTED,
                    category=ErrorCategory.INTERNAL,
                    message="this executor cannot look earlier attempts up; reconcile by hand",
                ),
                unknown=True,
                reason="reconciled",
            )
        timeout_s = (reply.timeout_ms or self.contract.timeout_ms) / 1000
        context = self._context(attempt, timeout_s, reply)
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                found = await _hook(reconcile, attempt.operation_id, context)
            if not isinstance(found, Reconciliation):
                raise TypeError(f"reconcile returned {type(found).__name__}")
        except Exception as exc:
            self._log.warning(
                "reconciling %s failed (%s)", attempt.operation_id, type(exc).__name__
            )
            if delivery < self._give_up_after:
                # The provider may answer next time; the lease stays with the ledger.
                return ItemDisposition(
                    ItemAction.NAK, "reconcile_failed", delay_s=self._retry_delay
                )
            return self._failure(
                attempt,
                ErrorInfo(
                    code="RECONCILE_FAILED",
                    category=ErrorCategory.TRANSIENT,
                    message="the provider could not be asked what happened; reconcile by hand",
                ),
                unknown=True,
                reason="reconciled",
            )
        finally:
            self.metrics.reconciliation_duration.labels(tool=self.contract.name).observe(
                time.monotonic() - started
            )
        if found.status is ReconcileStatus.APPLIED:
            # Postconditions need the arguments, which a reconcile lease may lack.
            return await self._report_output(
                attempt, {}, found.data, context, reason="reconciled", check_post=False
            )
        if found.status is ReconcileStatus.NOT_APPLIED:
            return self._not_applied(attempt, found.reason)
        return self._failure(
            attempt,
            ErrorInfo(
                code="RECONCILE_INCONCLUSIVE",
                category=ErrorCategory.TRANSIENT,
                message=found.reason or "the provider cannot tell whether the call took effect",
            ),
            unknown=True,
            reason="reconciled",
        )

    def _not_applied(self, attempt: _Attempt, reason: str) -> ItemDisposition:
        return self._failure(
            attempt,
            ErrorInfo(
                code="NOT_APPLIED",
                category=ErrorCategory.TRANSIENT,
                message=reason or "the earlier attempt had no effect; it may be retried",
                retryable=True,
            ),
            reason="reconciled",
        )

    # ---------------------------------------------------------------- preview

    async def _preview_for_approvers(
        self, item: WorkItem, reply: LeaseReply, lease: LeaseFn, delivery: int
    ) -> ItemDisposition:
        """Run the preview a call awaiting approval needs and send it to the ledger."""
        timeout_s = (reply.timeout_ms or self.contract.timeout_ms) / 1000
        context = self._context(
            _Attempt(item.operation_id, reply.attempt or 1, 0, time.monotonic()),
            timeout_s,
            reply,
        )
        report, transient = await self._previewed(
            dict(reply.arguments or {}), context, time.monotonic() + timeout_s
        )
        if transient and delivery < self._give_up_after:
            # A provider that is down now: the approvers get the effect a little later
            # rather than a failed preview for good.
            return ItemDisposition(ItemAction.NAK, "preview_retry", delay_s=self._retry_delay)
        sent = await self._ask(
            lease,
            LeaseRequest(operation_id=item.operation_id, executor=self.executor, preview=report),
            delivery,
        )
        if isinstance(sent, ItemDisposition):
            return sent
        return ItemDisposition(ItemAction.ACK, "previewed")

    async def _preview_changed(
        self,
        arguments: Mapping[str, Any],
        context: ToolContext,
        deadline: float,
        approved: str,
    ) -> ErrorInfo | None:
        """Why the call must not run because its effect is not the one approved, if so.

        The approvers approved a preview; time passed since (seed 001's TOCTOU): a
        recipient's address changed, a template was edited. The same preview, run
        now, must come out byte for byte the same, or nothing is run.
        """
        report, transient = await self._previewed(arguments, context, deadline)
        if report.error is not None:
            # Only a preview that showed an effect can be approved: one that cannot be
            # run now shows none, whatever its digest.
            if transient:
                return ErrorInfo(
                    code="PREVIEW_UNAVAILABLE",
                    category=ErrorCategory.TRANSIENT,
                    message="the effect could not be previewed again before the run;"
                    " nothing ran",
                    retryable=True,
                )
            return ErrorInfo(
                code="PREVIEW_FAILED",
                category=ErrorCategory.INTERNAL,
                message=f"the preview failed before the run ({report.error.code}); nothing ran",
            )
        if report.digest() != approved:
            return ErrorInfo(
                code="PREVIEW_CHANGED",
                category=ErrorCategory.CONFLICT,
                message="what the call would do now differs from the preview its approvers"
                " approved; nothing ran",
            )
        return None

    async def _previewed(
        self, arguments: Mapping[str, Any], context: ToolContext, deadline: float
    ) -> tuple[PreviewReport, bool]:
        """The tool's preview as a report (redacted like any output), and whether its
        failure is transient (worth trying again)."""
        hook = self.tool.preview
        if hook is None:
            return _preview_error(
                "PREVIEW_UNSUPPORTED", ErrorCategory.INTERNAL, "this tool has no preview"
            ), False
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.1)):
                output = await _hook(hook, arguments, context)
        except ToolError as error:
            info = self._tool_error_info(error)
            message, _ = redact_text(info.message, self.redaction)
            return PreviewReport(
                error=ErrorInfo(
                    code=info.code,
                    category=info.category,
                    message=message[:_MAX_MESSAGE_CHARS],
                )
            ), info.category is ErrorCategory.TRANSIENT
        except TimeoutError:
            return _preview_error(
                "PREVIEW_TIMEOUT", ErrorCategory.TRANSIENT, "the preview took too long"
            ), True
        except Exception:
            self._log.exception("preview crashed on %s", context.operation_id)
            return _preview_error(
                "PREVIEW_FAILED", ErrorCategory.INTERNAL, "the preview failed"
            ), False
        try:
            data = _plain_json(output, "PREVIEW_INVALID")
            # Approvers see it redacted like any output; the digest binds what the tool
            # produced, so a change in a part they were not shown is a change all the same.
            produced = sha256_hex(canonical_json(data))
        except _Untrusted as problem:
            return _preview_error(problem.code, ErrorCategory.INTERNAL, problem.message), False
        except CanonicalizationError:
            return _preview_error(
                "PREVIEW_INVALID", ErrorCategory.INTERNAL, "the tool's output is not plain JSON"
            ), False
        shown = redact(data, self.redaction)
        report = PreviewReport(
            effect=shown.value, effect_sha256=produced, redactions=list(shown.pointers)[:1000]
        )
        if len(canonical_json(report.model_dump(mode="json"))) > PREVIEW_MAX_BYTES:
            return _preview_error(
                "PREVIEW_TOO_LARGE", ErrorCategory.INTERNAL, "the preview is too large to show"
            ), False
        return report, False

    # ---------------------------------------------------------------- results

    async def _report_output(
        self,
        attempt: _Attempt,
        arguments: Mapping[str, Any],
        output: Any,
        context: ToolContext,
        *,
        reason: str,
        check_post: bool = True,
    ) -> ItemDisposition:
        try:
            data = await self._trusted_output(arguments, output, context, check_post=check_post)
            redacted = redact(data, self.redaction)
            envelope = self._envelope(
                attempt,
                ok=True,
                data=redacted.value,
                redactions=tuple("/data" + p for p in redacted.pointers),
            )
            size = len(envelope.model_dump_json())
            if size > self._max_result_bytes:
                raise _Untrusted(
                    "RESULT_TOO_LARGE",
                    "the result is too large to deliver",
                    limit_bytes=self._max_result_bytes,
                )
        except _Untrusted as problem:
            # A write's effect may have happened even though its report is
            # unusable; only reconciliation may settle it.
            return self._failure(
                attempt,
                ErrorInfo(
                    code=problem.code,
                    category=ErrorCategory.INTERNAL,
                    message=problem.message,
                    safe_details=problem.details,
                ),
                unknown=self._writes,
                reason=reason,
            )
        if redacted.pointers:
            self.metrics.redactions.labels(tool=self.contract.name).inc(len(redacted.pointers))
        return self._published(envelope, reason, attempt)

    async def _trusted_output(
        self,
        arguments: Mapping[str, Any],
        output: Any,
        context: ToolContext,
        *,
        check_post: bool,
    ) -> dict[str, Any]:
        """The output as plain JSON, valid against the contract; `_Untrusted` otherwise."""
        data = _plain_json(output, "OUTPUT_CONTRACT_VIOLATION")
        issues = self._output.issues(data)
        if issues:
            raise _Untrusted(
                "OUTPUT_CONTRACT_VIOLATION",
                "the tool's output does not match its contract's output schema",
                issues=_issue_summary(issues),
            )
        post = self.tool.check_postconditions
        if post is not None and check_post:
            try:
                async with asyncio.timeout(max(context.seconds_left(self._clock()), 1.0)):
                    problems = await _hook(post, arguments, data, context)
            except Exception as exc:
                self._log.warning("postcondition check failed: %s", type(exc).__name__)
                raise _Untrusted(
                    "POSTCONDITION_UNVERIFIED", "the effect could not be verified"
                ) from None
            if problems:
                raise _Untrusted(
                    "POSTCONDITION_FAILED",
                    "the effect is not what the call asked for",
                    problems=[redact_text(str(p), self.redaction)[0][:200] for p in problems][
                        :_MAX_DETAIL_ISSUES
                    ],
                )
        return data

    def _tool_error_info(self, error: ToolError) -> ErrorInfo:
        info = error.to_info()
        declared = self.contract.error_category(info.code)
        if declared is not None and declared is not info.category:
            # The operator's contract is the authority on what a code means.
            self._log.warning(
                "%s raised %s as %s; the contract says %s",
                self.contract.name,
                info.code,
                info.category.value,
                declared.value,
            )
            info = info.model_copy(update={"category": declared})
        return info

    def _failure(
        self,
        attempt: _Attempt,
        error: ErrorInfo,
        *,
        unknown: bool = False,
        reason: str = "executed",
    ) -> ItemDisposition:
        message, message_changed = redact_text(error.message, self.redaction)
        message = message[:_MAX_MESSAGE_CHARS]
        details = redact(error.safe_details, self.redaction)
        redactions = (["/error/message"] if message_changed else []) + [
            "/error/safe_details" + p for p in details.pointers
        ]
        safe = error.model_copy(update={"message": message, "safe_details": details.value})
        envelope = self._envelope(
            attempt, ok=False, error=safe, unknown=unknown, redactions=tuple(redactions)
        )
        return self._published(envelope, reason, attempt)

    def _envelope(
        self,
        attempt: _Attempt,
        *,
        ok: bool,
        data: dict[str, Any] | None = None,
        error: ErrorInfo | None = None,
        unknown: bool = False,
        redactions: tuple[str, ...] = (),
    ) -> ResultEnvelope:
        return ResultEnvelope(
            operation_id=attempt.operation_id,
            fencing_token=attempt.fencing_token,
            ok=ok,
            data=data,
            error=error,
            outcome_unknown=unknown,
            provenance=Provenance(
                tool=self.contract.name,
                tool_version=self.contract.version,
                executor=self.executor,
                attempt=attempt.attempt,
                latency_ms=round((time.monotonic() - attempt.started) * 1000, 3),
                completed_at=self._clock(),
                trust=TrustLabel.UNTRUSTED,
            ),
            lookup=attempt.lookup,
            redactions=redactions,
        )

    def _published(
        self, envelope: ResultEnvelope, reason: str, attempt: _Attempt
    ) -> ItemDisposition:
        outcome = envelope.outcome.value
        self.metrics.executions.labels(tool=self.contract.name, outcome=outcome).inc()
        if envelope.outcome_unknown:
            self.metrics.unknown.labels(tool=self.contract.name).inc()
        # A result once computed is kept trying while the lease holds: dropping it
        # would turn a call that ran fine into an unknown outcome.
        return ItemDisposition(
            ItemAction.PUBLISH, reason, envelope=envelope, keep_until=attempt.lease_expires_at
        )


def _plain_json(output: Any, code: str) -> dict[str, Any]:
    """A JSON copy of what a tool returned (an output, a preview); `_Untrusted` with
    `code` when it is no JSON object or not plain JSON."""
    if not isinstance(output, Mapping):
        raise _Untrusted(code, "the tool returned no JSON object")
    try:
        # A JSON round trip copies the output (the tool keeps no handle on
        # what is published) and refuses anything JSON cannot carry.
        data: dict[str, Any] = orjson.loads(orjson.dumps(output))
    except TypeError:
        raise _Untrusted(code, "the tool returned a value JSON cannot carry") from None
    # The ledger binds what a tool returns by its canonical hash: what no hash can
    # bind (an integer beyond 2**53, a nesting deeper than the arguments may
    # have) is refused here, with the same rule the inputs follow.
    problem = json_value_issue(data, DEFAULT_LIMITS.max_depth)
    if problem is not None:
        raise _Untrusted(
            code, "the tool's output is not plain JSON", issues=_issue_summary([problem])
        )
    return data


def _preview_error(code: str, category: ErrorCategory, message: str) -> PreviewReport:
    return PreviewReport(error=ErrorInfo(code=code, category=category, message=message))


def _issue_summary(issues: list[Any]) -> list[dict[str, str]]:
    """Where and which rule failed, never the offending value (it may be sensitive)."""
    return [
        {"path": issue.path, "code": issue.code, "keyword": issue.keyword or ""}
        for issue in issues[:_MAX_DETAIL_ISSUES]
    ]
