"""An asyncio front for the synchronous ledger, batching concurrent requests.

The ledger's cost per operation is dominated by Python work and one database
transaction per append; grouping the requests that arrive while a batch runs
into the next batch makes one transaction serve many operations.

Ledger work runs on the event loop's own thread, one batch at a time, so the
database sees a single writer per process. A separate ledger thread was
measured with `bench/e2e_bench.py` against this inline design and lost:
both threads need the GIL for nearly all their work, so the thread bought no
parallelism, only hand-offs and GIL convoys (545 against 612 operations/s,
p99 at 200 operations/s 62 against 33 ms). Blocking the loop for one batch is
the cheaper trade: requests that arrive meanwhile wait in the socket buffer
and make up the next batch. That holds on PostgreSQL too, where the thread
could at least overlap the round trips' waits with NATS work: one thread for
all ledger work lost there as well (427 against 500 operations/s, p99 at 200
operations/s 193 against 121 ms, service CPU 1.53 against 1.22 ms/op), so
what helps there is fewer round trips, not hiding them. A narrower thread, for
the append alone (the commands on the loop, only the insert and commit on a
writer thread, a turn's answers sent once it is stored), lost on PostgreSQL
too (two interleaved pairs: 377 and 379 against 425 and 377 operations/s,
p99 at 200 operations/s 236 and 308 against 105 and 109 ms, service CPU 1.90
and 1.95 against 1.72 and 1.83 ms/op). Nor did awaiting the append over an
asyncio connection of its own, with the commands on the loop and every other use
of the ledger held off while it was in flight (no thread, so no hand-offs): the
loop was then idle 45 % of the time at 200 operations/s instead of 10 %, and
neither throughput nor latency moved beyond the noise (`docs/performance.md`,
stop 35). On SQLite, group commit (commits without
a sync, the log synced on a thread once per group, every message held until its
commits were synced) was measured three ways and gained nothing or lost
(`docs/performance.md`, stop 33).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from eventsourcing.persistence import IntegrityError

from ledger.adapters.failures import is_outage
from ledger.domain.errors import InvalidArgument, LedgerError
from ledger.domain.states import ResultDisposition
from ledger.service import Ledger, Submission, SubmitItem
from schemas import (
    ApproverRequest,
    ErrorCategory,
    LeaseReply,
    OperationStatus,
    OperatorRequest,
    OpledgerError,
    PlanRequest,
    PlanStatus,
    PreviewReport,
    ResultEnvelope,
    cancel_and_wait,
    ledger_operation_id,
)

__all__ = ["LedgerGateway"]

_log = logging.getLogger(__name__)
In = TypeVar("In")
Out = TypeVar("Out")


class InternalFailure(OpledgerError):
    """A batch failed for a reason that is not the caller's (logged, not shown)."""

    category = ErrorCategory.INTERNAL
    code = "LEDGER_UNAVAILABLE"
    retryable = True


def _failure(cause: Exception) -> InternalFailure:
    failure = InternalFailure("the ledger could not process the request")
    failure.__cause__ = cause
    return failure


@dataclass
class _Lane(Generic[In, Out]):
    """Requests of one kind waiting for the next batch."""

    run: Callable[[list[In]], Sequence[Out | LedgerError]]
    items: list[In] = field(default_factory=list)
    futures: list[asyncio.Future[Out]] = field(default_factory=list)


class LedgerGateway:
    """Submit, lease, record and query, batched, from asyncio code."""

    def __init__(self, ledger: Ledger, *, max_batch: int = 256) -> None:
        self.ledger = ledger
        self._max_batch = max_batch
        self._wakeup = asyncio.Event()
        self._lanes: dict[str, _Lane[Any, Any]] = {
            "submit": _Lane(self._submit_batch),
            "lease": _Lane(ledger.lease_many),
            "result": _Lane(ledger.record_results),
        }
        self._task: asyncio.Task[None] | None = None
        self.written = asyncio.Event()
        """Set after every batch that may have appended events (for the relay)."""

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="ledger-batches")

    async def stop(self) -> None:
        """Stop batching."""
        await cancel_and_wait(self._task)

    async def call(self, fn: Callable[..., Out], *args: Any) -> Out:
        """Run any ledger function between batches (unbatched)."""
        return fn(*args)

    # ------------------------------------------------------------------ requests

    async def submit(self, item: SubmitItem) -> Submission:
        """Record and check one proposal (batched with others)."""
        result: Submission = await self._enqueue("submit", item)
        return result

    async def lease(self, operation_id: str, executor: str, tool: str) -> LeaseReply:
        """Answer a lease request (batched with others)."""
        result: LeaseReply = await self._enqueue("lease", (operation_id, executor, tool))
        return result

    async def record_preview(
        self, operation_id: str, tool: str, executor: str, report: PreviewReport
    ) -> LeaseReply:
        """Record the preview an executor ran for the approvers (unbatched: one per call)."""
        reply = self.ledger.leasing.record_preview(
            operation_id, tool=tool, executor=executor, report=report
        )
        self.written.set()
        return reply

    async def check_in(self, operation_id: str, tool: str, holding: int) -> LeaseReply:
        """Answer a running executor's check-in (read only, so not batched)."""
        return self.ledger.leasing.check_in(operation_id, tool=tool, holding=holding)

    async def cancel(self, operation_id: str, host: str, reason: str) -> OperationStatus:
        """A host cancels one of its own operations; its status after the cancel."""
        # Its own only: the status, asked in the host's namespace, is refused
        # (no such operation) for anyone else's, before anything is appended.
        self.ledger.status(operation_id, host=host)
        self.ledger.cancel(
            ledger_operation_id(host, operation_id), by=f"host:{host}", reason=reason
        )
        return self.ledger.status(operation_id, host=host)

    async def operate(self, request: OperatorRequest, operator: str) -> OperationStatus:
        """An operator resolves, cancels or retries (recorded as `operator:<name>`); the
        status after."""
        by = f"operator:{operator}"
        answered = request.operation_id
        if request.command == "resolve":
            if request.applied is None:
                raise InvalidArgument("a resolution says whether it was applied (`applied`)")
            self.ledger.resolve(
                request.operation_id, by=by, applied=request.applied, reason=request.reason
            )
        elif request.command == "compensate":
            # The answer is the compensation's status: it runs as an operation of its own.
            answered = self.ledger.compensate(
                request.operation_id, by=by, reason=request.reason
            ).operation_id
        elif request.command == "retry":
            # The answer is the new operation's status: the retry runs as it.
            answered = self.ledger.retry(
                request.operation_id, by=by, reason=request.reason, via="nats"
            ).operation_id
        else:
            self.ledger.cancel(request.operation_id, by=by, reason=request.reason)
        self.written.set()  # the relay publishes what changed now, not at its next poll
        return self.ledger.status(answered)

    async def decide(
        self, request: ApproverRequest, approver: str, roles: frozenset[str]
    ) -> OperationStatus | PlanStatus:
        """An approver approves or denies a call or a plan (recorded as `approver`, with
        `roles`, via NATS); the status after. A refusal is recorded, then raised."""
        if request.command == "approve" and request.proposal_hash is None:
            raise InvalidArgument(
                "an approval names the hash it was shown (`proposal_hash`)"
            )
        if request.plan_id is not None:
            return self._decide_plan(request, request.plan_id, approver, roles)
        assert request.operation_id is not None
        if request.command == "approve":
            assert request.proposal_hash is not None
            self.ledger.approve(
                request.operation_id,
                approver=approver,
                approver_roles=roles,
                proposal_hash=request.proposal_hash,
                preview_hash=request.preview_hash,
                via="nats",
            )
        else:
            self.ledger.deny(
                request.operation_id,
                approver=approver,
                approver_roles=roles,
                reason=request.reason,
                via="nats",
            )
        self.written.set()  # a call that became ready is dispatched now, not at the next poll
        return self.ledger.status(request.operation_id)

    def _decide_plan(
        self, request: ApproverRequest, plan_id: str, approver: str, roles: frozenset[str]
    ) -> PlanStatus:
        ledger_id = plan_id  # `<host>/<plan id>`: the plans' own namespace
        if request.command == "approve":
            assert request.proposal_hash is not None
            status = self.ledger.approve_plan(
                ledger_id, approver=approver, approver_roles=roles,
                plan_hash=request.proposal_hash, via="nats",
            )
        else:
            status = self.ledger.deny_plan(
                ledger_id, approver=approver, approver_roles=roles, reason=request.reason,
                via="nats",
            )
        self.written.set()  # the steps it released are dispatched now
        return status

    async def plan(self, request: PlanRequest, host: str) -> PlanStatus:
        """A host proposes a plan, asks where one stands, or cancels one; its status,
        in the host's namespace."""
        if request.command == "propose":
            assert request.plan is not None and request.context is not None
            status = self.ledger.propose_plan(request.plan, request.context, host)
            self.written.set()
            return status
        plan_id = request.asked_id
        if request.command == "cancel":
            ledger_id = self.ledger.plans.ledger_id(host, plan_id)
            self.ledger.plan_status(plan_id, host=host)  # another host's plan is not found
            self.ledger.cancel_plan(ledger_id, by=f"host:{host}", reason=request.reason)
            self.written.set()
        return self.ledger.plan_status(plan_id, host=host)

    async def advance_plans(self, plan_ids: Sequence[str]) -> None:
        """Move these plans on (their steps changed): release, skip, settle."""
        for plan_id in plan_ids:
            try:
                self.ledger.advance_plan(plan_id)
            except OpledgerError as error:
                _log.warning("plan %s could not advance: %s", plan_id, error)
            except Exception:
                _log.exception("plan %s could not advance", plan_id)
        self.written.set()

    async def record_many(
        self, envelopes: Sequence[ResultEnvelope]
    ) -> list[ResultDisposition | BaseException]:
        """Record many results (batched); each answer, or the exception for that result."""
        futures = [self._enqueue("result", envelope) for envelope in envelopes]
        return list(await asyncio.gather(*futures, return_exceptions=True))

    async def status(self, operation_id: str, host: str | None = None) -> OperationStatus:
        """Where one operation stands (as `Ledger.status`, asked for `host`)."""
        return self.ledger.status(operation_id, host=host)

    def _enqueue(self, lane: str, item: Any) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._lanes[lane].items.append(item)
        self._lanes[lane].futures.append(future)
        self._wakeup.set()
        return future

    # --------------------------------------------------------------------- batches

    def _submit_batch(self, items: list[SubmitItem]) -> list[Submission | LedgerError]:
        # Each item gets its own answer: one bad item never fails the others.
        return self.ledger.submit_many(items)

    def _run(self, lane: _Lane[Any, Any], items: list[Any]) -> Sequence[Any]:
        """One batch's answers; a batch that raises is run again item by item.

        The ledger answers each item on its own, so a batch raises only on an
        outage (every caller learns it) or on a bug one item triggered: run
        alone, each item then gets its own answer, and only the one that
        triggered it fails. An outage is not retried item by item: each
        attempt would wait out the same database timeout.
        """
        try:
            return lane.run(items)
        except Exception as exc:
            _log.exception("ledger batch of %d failed", len(items))
            if len(items) == 1 or is_outage(exc):
                return [_failure(exc)] * len(items)
        answers: list[Any] = []
        for item in items:
            try:
                answers.extend(lane.run([item]))
            except Exception as exc:
                _log.exception("ledger request failed on its own")
                answers.append(_failure(exc))
        return answers

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while any(lane.items for lane in self._lanes.values()):
                # One batch of every kind waiting, in one transaction (see `_run_together`).
                turn: list[tuple[_Lane[Any, Any], list[Any], list[asyncio.Future[Any]]]] = []
                for lane in self._lanes.values():
                    if lane.items:
                        turn.append(
                            (lane, lane.items[: self._max_batch], lane.futures[: self._max_batch])
                        )
                        del lane.items[: self._max_batch]
                        del lane.futures[: self._max_batch]
                answered = self._run_together([(lane, items) for lane, items, _ in turn])
                for (_, _, futures), answers in zip(turn, answered, strict=True):
                    for future, answer in zip(futures, answers, strict=True):
                        if future.done():
                            continue
                        if isinstance(answer, BaseException):
                            future.set_exception(answer)
                        else:
                            future.set_result(answer)
                self.written.set()
                await asyncio.sleep(0)  # the answers go out, new requests come in

    def _run_together(
        self, turn: Sequence[tuple[_Lane[Any, Any], list[Any]]]
    ) -> list[Sequence[Any]]:
        """The answers of one batch per lane, all saved in one append.

        Proposals, leases and results that arrived together cost one transaction
        instead of three (each commit is a round trip and a log flush on
        PostgreSQL). Should anything in it fail (a bug one item triggers, an
        append that lost a race with another instance, an outage), nothing of it
        was stored, and each lane runs again on its own, as `_run` always did.
        """
        if len(turn) == 1:
            lane, items = turn[0]
            return [self._run(lane, items)]
        try:
            with self.ledger.runner.one_append():
                return [lane.run(items) for lane, items in turn]
        except Exception as exc:
            if is_outage(exc) and not isinstance(exc, IntegrityError):
                # The database is down: every lane would wait out the same timeout.
                _log.exception("ledger batches failed together")
                return [[_failure(exc)] * len(items) for _, items in turn]
            _log.debug("ledger batches run one by one after: %s", type(exc).__name__)
        return [self._run(lane, items) for lane, items in turn]
