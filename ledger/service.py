"""The ledger's service layer: use cases over the Operation aggregate.

Each use case loads operations, runs one command, and saves the new events in
one atomic append. Optimistic concurrency does the rest: when two writers race
on one operation, the loser's append fails, it reloads, and re-runs its command
against the fresh state, which either succeeds or refuses cleanly.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import IO, Any, TypeVar

import orjson
from eventsourcing.application import AggregateNotFoundError
from eventsourcing.persistence import IntegrityError

from ledger._recent import Recent
from ledger.adapters.eventstore import EventStoreApp
from ledger.adapters.results import ResultStore, envelope_text_hash
from ledger.adapters.sql import SqlDatabase
from ledger.audit.export import export_jsonl
from ledger.audit.model import served_result
from ledger.audit.parallel import LedgerTables, verify_stored
from ledger.audit.seal import Sealer, SealRefused, SignedHead
from ledger.audit.verify import DEFAULT_SEAL_GRACE, StoredRow, VerificationReport
from ledger.budget import LedgerBudgetCounter
from ledger.domain.errors import (
    ApprovalRefused,
    InvalidProposal,
    LedgerError,
    OperationConflict,
    OperationNotFound,
)
from ledger.domain.operation import Operation
from ledger.domain.states import OperationState, ResultDisposition
from ledger.projections.operations_view import OperationsProjector
from ledger.retention import KEPT_REJECTED_BYTES, kept_arguments
from policy import DEFAULT_LIMITS, ProposalChecker, ToolContract, json_value_issue
from schemas import (
    Decision,
    DecisionOutcome,
    LeaseDecision,
    LeaseReply,
    OperationStatus,
    ResultEnvelope,
    RuntimeContext,
    ToolProposal,
    canonical_json,
    host_operation_id,
    ledger_operation_id,
    sha256_hex,
)

__all__ = ["LeaseGrant", "Ledger", "Submission"]

_log = logging.getLogger(__name__)
T = TypeVar("T")


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class Submission:
    """The answer to a submitted proposal."""

    operation_id: str
    state: OperationState
    decision: Decision | None
    """The check's decision; None when the operation already existed."""
    created: bool
    """False when the same call was submitted before under this ID."""


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """What an executor receives with a lease: exactly the approved call."""

    operation_id: str
    tool: str
    tool_version: str
    arguments: dict[str, Any]
    fencing_token: int
    attempt: int
    lease_expires_at: datetime
    proposal_hash: str


SubmitItem = tuple[ToolProposal, RuntimeContext] | tuple[ToolProposal, RuntimeContext, str]
"""A proposal, its trusted context, and optionally the agent host that sent it."""


def _conflict(operation_id: str) -> OperationConflict:
    # Named by the host's own ID: the conflict is within the host's namespace.
    return OperationConflict(
        "this operation ID belongs to a different call",
        operation_id=host_operation_id(operation_id),
    )


def _unpack(item: SubmitItem) -> tuple[ToolProposal, RuntimeContext, str]:
    if len(item) == 3:
        return item
    return item[0], item[1], ""


def fingerprint(proposal: ToolProposal, context: RuntimeContext, host: str = "") -> str:
    """What makes two submissions "the same call" for idempotency.

    Internal only (never compared across languages), so orjson with sorted
    keys is enough; values orjson cannot encode (a huge integer) fall back to
    their repr, which is still deterministic.
    """
    body = {
        "tool": proposal.tool_name,
        "arguments": proposal.arguments,
        "actor": context.principal,
        "tenant": context.tenant,
        "host": host,
    }
    try:
        encoded = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        encoded = repr(sorted(body.items())).encode()
    return sha256_hex(encoded)


class Ledger:
    """Submit, approve, lease, record and cancel operations."""

    def __init__(
        self,
        *,
        events: EventStoreApp,
        db: SqlDatabase,
        checker: ProposalChecker,
        projector: OperationsProjector | None = None,
        budget: LedgerBudgetCounter | None = None,
        clock: Callable[[], datetime] = _utcnow,
        new_id: Callable[[], str] = lambda: f"op-{uuid.uuid4()}",
        lease_ttl: timedelta = timedelta(seconds=60),
        conflict_retries: int = 5,
        # A few seconds of traffic: operations in flight are what commands
        # touch. More costs GC time: every cached aggregate is walked by each
        # full collection (10,000 made 30-50 ms pauses in the service).
        cache_size: int = 2_000,
        # And bounded in bytes (of stored history; the objects weigh a few
        # times that): 2,000 operations of 512 KiB would be a gigabyte.
        cache_bytes: int = 16 * 1024 * 1024,
        kept_rejected_bytes: int = KEPT_REJECTED_BYTES,
        results: ResultStore | None = None,
        sealer: Sealer | None = None,
        seal_grace: timedelta = DEFAULT_SEAL_GRACE,
    ) -> None:
        self.events = events
        self.db = db
        self.checker = checker
        self.projector = projector or OperationsProjector(db, events.recorder)
        self.results = results or ResultStore(db)
        # Only a ledger holding the seal key seals (the service): readers
        # never write the seal, and a ledger without the key seals nothing.
        self.sealer = sealer
        self.seal_grace = seal_grace
        self._seal_refused_logged = float("-inf")
        self._budget = budget
        self._clock = clock
        self._new_id = new_id
        self._lease_ttl = lease_ttl
        self._conflict_retries = conflict_retries
        # Operations this instance wrote last, for commands only. A stale entry
        # is harmless: its append fails on the version check and the command
        # runs again on the stored state; a refusal from a cached state is
        # likewise re-checked against the stored one before it is believed.
        self._cache: Recent[str, Operation] = Recent(cache_size, max_weight=cache_bytes)
        self._kept_rejected_bytes = kept_rejected_bytes
        self._cache_lock = threading.Lock()

    # ------------------------------------------------------------------ reading

    def get(self, operation_id: str, *, version: int | None = None) -> Operation:
        """The operation as of now, or as of `version` (for auditors' replay)."""
        try:
            operation: Operation = self.events.repository.get(
                operation_id, version=version, projector_func=_replay
            )
        except AggregateNotFoundError:
            raise OperationNotFound("no such operation", operation_id=operation_id) from None
        return operation

    def history(self, operation_id: str) -> list[Any]:
        """Every event of one operation, oldest first."""
        events = list(self.events.events.get(operation_id))
        if not events:
            raise OperationNotFound("no such operation", operation_id=operation_id)
        return events

    def contract_of(self, operation: Operation) -> ToolContract | None:
        """The pinned contract the operation was checked against, if still pinned."""
        contract = self.checker.catalog.get(operation.tool)
        if contract is None or contract.version != operation.tool_version:
            return None
        return contract

    @property
    def events_table(self) -> str:
        """The name of the table that holds the events (for auditors' direct reads)."""
        # Both SQL recorders have this attribute; the abstract recorder type does not.
        name = getattr(self.events.recorder, "events_table_name", "stored_events")
        return str(name).rsplit(".", 1)[-1]

    def seal_now(self) -> int:
        """Bring the view up to date and seal everything now (a service that stops)."""
        projected = self.projector.catch_up()
        if self.sealer is not None:
            try:
                self.sealer.seal(self.projector.projected, now=True)
            except SealRefused as refused:
                _log.error("not sealing: %s", refused.message)
        return projected

    def refresh(self) -> int:
        """Bring the read models up to date with the event log, and seal it if this
        ledger holds the seal key; returns how many events the view took in."""
        projected = self.projector.catch_up()
        if self.sealer is None:
            return projected
        # Its own transaction: one around the view's and the seal's together was
        # measured slower end to end (bench/e2e_bench.py, 2 x 16: 967-1,217
        # against 1,182-1,232 operations/s).
        try:
            self.sealer.seal(self.projector.projected)
        except SealRefused as refused:
            # Loud but not fatal: the feed, work and outcomes must go on (the
            # feed is the auditors' witness of what happened meanwhile).
            now = time.monotonic()
            if now - self._seal_refused_logged >= 60:
                self._seal_refused_logged = now
                _log.error("not sealing: %s", refused.message)
        return projected

    # --------------------------------------------------------------- submitting

    def submit(self, proposal: ToolProposal, context: RuntimeContext, host: str = "") -> Submission:
        """Record and check one proposal. Same ID and call again: the existing operation.

        `host` names the agent host that sent it (from its authenticated
        subject), so outcomes go back to that host only, and the proposal's
        operation ID is that host's own (`schemas.ledger_operation_id`).
        Raises the `LedgerError` that refused it, if one did.
        """
        answer = self.submit_many([(proposal, context, host)])[0]
        if isinstance(answer, LedgerError):
            raise answer
        return answer

    def submit_many(self, items: Sequence[SubmitItem]) -> list[Submission | LedgerError]:
        """Record and check many proposals with one atomic append (the fast path).

        Each item gets its own answer: a `Submission`, or the error that
        refused that item alone (an ID its host already used for another
        call, a proposal that cannot be stored). One item can never fail,
        or keep out, the others.
        """
        try:
            return self._submit_many(items)
        finally:
            if self._budget is not None:
                self._budget.clear_pending()

    def _submit_many(self, items: Sequence[SubmitItem]) -> list[Submission | LedgerError]:
        answers: list[Submission | LedgerError | None] = [None] * len(items)
        keyed: list[tuple[int, str, ToolProposal, RuntimeContext, str]] = []
        for index, item in enumerate(items):
            proposal, context, host = _unpack(item)
            try:
                operation_id = ledger_operation_id(host, proposal.operation_id or self._new_id())
            except ValueError:
                answers[index] = InvalidProposal(
                    "the host name or operation ID is not a valid identifier"
                )
                continue
            keyed.append((index, operation_id, proposal, context, host))
        # One query for the batch instead of one lookup per proposal; an ID
        # stored by another writer after it is caught by the append below.
        stored = self._stored_ids(operation_id for _, operation_id, *_ in keyed)
        new: list[tuple[int, Operation, Decision]] = []
        fresh: dict[str, tuple[int, str]] = {}
        for index, operation_id, proposal, context, host in keyed:
            try:
                print_ = fingerprint(proposal, context, host)
                if operation_id in fresh:
                    # The same ID twice in one batch: a redelivery, or a conflict.
                    first, first_print = fresh[operation_id]
                    if first_print != print_:
                        raise _conflict(operation_id)
                    answers[index] = Submission(operation_id, new[first][1].state, None, False)
                    continue
                if operation_id in stored:
                    existing = self._existing(operation_id, print_)
                    if existing is not None:
                        answers[index] = existing
                        continue
                operation, decision = self._new_operation(
                    operation_id, proposal, context, print_, host
                )
            except LedgerError as error:
                answers[index] = error
                continue
            except Exception as exc:
                # A value the check let through and the event encoder cannot
                # write (or a bug): this proposal alone is refused, the rest
                # of the batch is stored.
                _log.warning(
                    "proposal %s cannot be stored: %s: %s",
                    operation_id,
                    type(exc).__name__,
                    str(exc)[:200],
                )
                answers[index] = InvalidProposal("the proposal cannot be stored")
                continue
            fresh[operation_id] = (len(new), print_)
            new.append((index, operation, decision))
            if self._budget is not None and decision.outcome is not DecisionOutcome.REJECTED:
                self._budget.note_pending(
                    tenant=context.tenant, actor=context.principal, tool=decision.tool
                )
        if new:
            try:
                self._save(*(operation for _, operation, _ in new))
            except IntegrityError:
                # Another writer created one of these IDs meanwhile: settle one by one.
                if self._budget is not None:
                    self._budget.clear_pending()
                return [
                    answer
                    if isinstance(answer, LedgerError)
                    else self._submit_after_race(items[index])
                    for index, answer in enumerate(answers)
                ]
            for index, operation, decision in new:
                answers[index] = Submission(operation.id, operation.state, decision, True)
        return [answer for answer in answers if answer is not None]

    def _submit_after_race(self, item: SubmitItem) -> Submission | LedgerError:
        proposal, context, host = _unpack(item)
        if proposal.operation_id is not None:
            operation_id = ledger_operation_id(host, proposal.operation_id)
            try:
                existing = self._existing(operation_id, fingerprint(proposal, context, host))
            except LedgerError as error:
                return error
            if existing is not None:
                return existing
        return self._submit_many([item])[0]

    def _existing(self, operation_id: str, print_: str) -> Submission | None:
        try:
            operation = self.get(operation_id)
        except OperationNotFound:
            return None
        if operation.fingerprint != print_:
            raise _conflict(operation_id)
        return Submission(operation.id, operation.state, None, False)

    def _new_operation(
        self,
        operation_id: str,
        proposal: ToolProposal,
        context: RuntimeContext,
        print_: str,
        host: str,
    ) -> tuple[Operation, Decision]:
        now = self._clock()
        decision = self.checker.check(proposal, context)
        rejected = decision.outcome is DecisionOutcome.REJECTED
        # Accepted arguments passed the parse stage: plain JSON, bounded in
        # size. Of a rejected proposal only what is storable and small is kept.
        arguments, omitted = (
            kept_arguments(proposal.arguments, self._kept_rejected_bytes)
            if rejected
            else (proposal.arguments, None)
        )
        stored = proposal.model_dump(mode="json", exclude={"arguments"})
        stored["arguments"] = arguments
        operation = Operation.propose(
            operation_id,
            proposal=stored,
            fingerprint=print_,
            actor=context.principal,
            tenant=context.tenant,
            environment=context.environment,
            tool=proposal.tool_name,
            now=now,
            host=host,
            omitted=omitted,
        )
        if rejected:
            operation.reject(
                issues=[issue.model_dump(mode="json") for issue in decision.issues],
                category=(decision.category.value if decision.category else "INVALID_INPUT"),
                repairable=decision.repairable,
                tool_version=decision.tool_version,
                now=now,
            )
            return operation, decision
        contract = self.checker.catalog[decision.tool]
        assert decision.proposal_hash is not None and decision.risk is not None
        operation.validate(
            tool_version=contract.version,
            input_schema_hash=contract.input_schema_hash,
            output_schema_hash=contract.output_schema_hash,
            proposal_hash=decision.proposal_hash,
            arguments=dict(decision.normalized_arguments or {}),
            applied_defaults=list(decision.applied_defaults),
            risk=decision.risk.value,
            risk_reasons=list(decision.risk_reasons),
            max_attempts=contract.retry.max_attempts,
            retry_on=sorted(category.value for category in contract.retry.retry_on),
            now=now,
        )
        if decision.approval is None:
            operation.mark_ready(now)
        else:
            operation.request_approval(
                approval_id=f"apr-{uuid.uuid4().hex[:16]}",
                effect_preview=effect_preview(contract, decision, context),
                approver_roles=list(decision.approval.approver_roles),
                required_approvals=decision.approval.required_approvals,
                separation_of_duties=decision.approval.separation_of_duties,
                expires_at=now + timedelta(seconds=decision.approval.expires_in_s),
                reason=decision.approval.reason,
                now=now,
            )
        return operation, decision

    # ---------------------------------------------------------------- commands

    def _save(self, *operations: Operation) -> None:
        """Append the new events of `operations` atomically, and remember them."""
        events = [event for operation in operations for event in operation.collect_events()]
        try:
            self.events.events.put(events)
        except BaseException:
            self._forget(*(operation.id for operation in operations))
            raise
        with self._cache_lock:
            for operation in operations:
                self._cache.remember(operation.id, operation, operation.history_bytes)

    def _forget(self, *operation_ids: str) -> None:
        with self._cache_lock:
            for operation_id in operation_ids:
                self._cache.pop(operation_id, None)

    def _cached(self, operation_id: str) -> Operation | None:
        with self._cache_lock:
            return self._cache.get(operation_id)

    def _update(
        self, operation_id: str, command: Callable[[Operation], T], *, use_cache: bool = True
    ) -> T:
        """Run `command` on the operation and save; on a lost race, again on fresh state.

        A cached operation may be stale (another process wrote since). An answer
        that appends events is safe anyway: the append's version check fails
        and the command runs again on the stored state. An answer that appends
        nothing (a refusal, "busy", "done", a duplicate) is believed only when
        it was computed from the stored state.
        """
        operation = self._cached(operation_id) if use_cache else None
        for _ in range(self._conflict_retries):
            from_cache = operation is not None
            if operation is None:
                operation = self.get(operation_id)
            try:
                answer = command(operation)
            except LedgerError:
                self._forget(operation_id)
                if from_cache:
                    operation = None  # believe a refusal only from the stored state
                    continue
                raise
            except BaseException:
                self._forget(operation_id)
                raise
            if not operation.pending_events:
                if from_cache:
                    operation = None
                    continue
                return answer
            try:
                self._save(operation)
            except IntegrityError:
                _log.debug("lost a race on %s; retrying", operation_id)
                operation = None
                continue
            return answer
        raise OperationConflict(
            "too many concurrent writers on this operation", operation_id=operation_id
        )

    def approve(
        self,
        operation_id: str,
        *,
        approver: str,
        approver_roles: Iterable[str],
        proposal_hash: str,
        approval_id: str | None = None,
    ) -> Operation:
        """Approve exactly the call that hashes to `proposal_hash`.

        A refused approval is recorded in the ledger, then `ApprovalRefused` is raised.
        """
        roles = frozenset(approver_roles)

        def command(operation: Operation) -> tuple[Operation, str | None]:
            given = approval_id or (operation.approval or {}).get("approval_id", "")
            refusal = operation.grant_approval(
                approval_id=given,
                approver=approver,
                approver_roles=roles,
                proposal_hash=proposal_hash,
                now=self._clock(),
            )
            return operation, refusal

        operation, refusal = self._update(operation_id, command)
        if refusal is not None:
            raise ApprovalRefused(
                f"approval refused: {refusal}", operation_id=operation_id, reason=str(refusal)
            )
        return operation

    def deny(self, operation_id: str, *, approver: str, reason: str = "") -> Operation:
        """Deny the call; it will never run."""

        def command(operation: Operation) -> Operation:
            operation.deny_approval(
                approval_id=(operation.approval or {}).get("approval_id", ""),
                approver=approver,
                reason=reason,
                now=self._clock(),
            )
            return operation

        return self._update(operation_id, command)

    def expire_approvals(self) -> list[str]:
        """Expire every approval request whose time has passed."""
        self.refresh()
        now = self._clock()
        expired = []
        for row in self.projector.rows(state=OperationState.AWAITING_APPROVAL.value):
            if row.approval_expires_at and datetime.fromisoformat(row.approval_expires_at) <= now:
                self._update(row.operation_id, lambda op: op.expire_approval(now))
                expired.append(row.operation_id)
        return expired

    def claim(
        self, operation_id: str, *, executor: str, ttl: timedelta | None = None
    ) -> LeaseGrant:
        """Lease a ready operation to `executor` with a new fencing token."""

        def command(operation: Operation) -> LeaseGrant:
            now = self._clock()
            token = operation.claim_lease(executor=executor, ttl=ttl or self._lease_ttl, now=now)
            return _grant(operation, token)

        return self._update(operation_id, command)

    def claim_many(
        self, operation_ids: Sequence[str], *, executor: str
    ) -> list[LeaseGrant | LedgerError]:
        """Lease many ready operations with one append (for batching services).

        Each item is a grant, or the error that refused it. A lost race falls
        back to claiming one by one.
        """
        now = self._clock()

        def claim(operation: Operation) -> LeaseGrant:
            token = operation.claim_lease(executor=executor, ttl=self._lease_ttl, now=now)
            return _grant(operation, token)

        return self._batch([(operation_id, claim) for operation_id in operation_ids])

    def lease(self, operation_id: str, *, executor: str, tool: str | None = None) -> LeaseReply:
        """Answer an executor's lease request for one work item (see `lease_many`)."""
        answer = self.lease_many([(operation_id, executor, tool)])[0]
        if isinstance(answer, LedgerError):
            raise answer
        return answer

    def lease_many(
        self, requests: Sequence[tuple[str, str, str | None]]
    ) -> list[LeaseReply | LedgerError]:
        """Answer many (operation ID, executor, tool) lease requests with one append.

        `tool` is the tool the executor is authenticated for (from its subject);
        an operation of another tool is answered `OperationNotFound`, exactly
        as an unknown ID is, and nothing is appended.
        READY: a new lease and fencing token, with the exact approved arguments.
        A live lease held by someone: BUSY (try later). An expired lease or an
        unknown outcome: RECONCILE (look the outcome up, never run again).
        Anything final: DONE, which is how redelivered work items converge.
        """
        now = self._clock()
        return self._batch(
            [
                (operation_id, partial(self._lease, executor=executor, tool=tool, now=now))
                for operation_id, executor, tool in requests
            ]
        )

    def _lease(
        self, operation: Operation, *, executor: str, tool: str | None, now: datetime
    ) -> LeaseReply:
        if tool is not None and operation.tool != tool:
            # Exactly the answer for an ID nobody used: an executor of one tool
            # must not learn which operations other tools have.
            raise OperationNotFound("no such operation", operation_id=operation.id)
        state = operation.state
        contract = self.contract_of(operation)
        timeout_ms = (
            contract.timeout_ms if contract else int(self._lease_ttl.total_seconds() * 1000)
        )
        if state is OperationState.READY:
            ttl = timedelta(milliseconds=timeout_ms) + self._lease_ttl
            token = operation.claim_lease(executor=executor, ttl=ttl, now=now)
            return _lease_reply(LeaseDecision.EXECUTE, operation, token, timeout_ms)
        if state in (OperationState.EXECUTING, OperationState.CANCEL_REQUESTED):
            lease = operation.lease or {}
            if lease.get("expires_at", now) > now:
                return LeaseReply(
                    decision=LeaseDecision.BUSY,
                    operation_id=operation.id,
                    reason=f"leased to {lease.get('executor')} until {lease['expires_at']}",
                )
            operation.expire_lease(now)
        if operation.state is OperationState.OUTCOME_UNKNOWN:
            operation.start_reconciliation(by=executor, now=now)
        if operation.state is OperationState.RECONCILING:
            return _lease_reply(
                LeaseDecision.RECONCILE, operation, operation.fencing_token, timeout_ms
            )
        return LeaseReply(
            decision=LeaseDecision.DONE, operation_id=operation.id, reason=operation.state.value
        )

    def status(
        self, operation_id: str, *, known_version: int | None = None, host: str | None = None
    ) -> OperationStatus:
        """Where an operation stands, with its result envelope once it has one.

        `known_version`: the caller saw the operation reach this version (the
        relay, announcing an event it just read). A copy this process wrote
        at that version or later is then as good as a replay, and cheaper.

        `host`: asked on behalf of this agent host, in its own namespace:
        `operation_id` is the host's ID (see `schemas.ledger_operation_id`),
        and so is the one in the answer. Another host's operations are not in
        that namespace at all.
        """
        asked = operation_id
        if host is not None:
            operation_id = ledger_operation_id(host, operation_id)
        cached = self._cached(operation_id)
        if cached is not None and known_version is None:
            # One index lookup says whether the copy is current (another
            # instance may have written since); a replay decodes every event.
            known_version = self._stored_version(operation_id)
        if cached is not None and known_version is not None and cached.version >= known_version:
            operation = cached
        else:
            try:
                operation = self.get(operation_id)
            except OperationNotFound:
                raise OperationNotFound("no such operation", operation_id=asked) from None
        if host is not None and operation.host != host:
            # Only an operation submitted before IDs were scoped can be here.
            raise OperationNotFound("no such operation", operation_id=asked)
        outcome = operation.outcome
        result = None
        if outcome and outcome.get("result_ref"):
            # Only the exact envelope its event bound (RESULT_INTEGRITY otherwise).
            reference = outcome["result_ref"]
            text = self.results.get_text(reference)
            result = served_result(text, operation.id, reference, outcome)
        return OperationStatus(
            operation_id=operation.id if host is None else asked,
            state=operation.state.value,
            final=operation.state in FINAL_STATES,
            tool=operation.tool,
            tool_version=operation.tool_version,
            attempts=operation.attempt,
            outcome=outcome,
            result=result,
        )

    def record_result(self, envelope: ResultEnvelope) -> ResultDisposition:
        """Record an executor's result; retries a retryable failure when the policy allows."""
        kept: list[tuple[str, str, str]] = []
        disposition = self._update(
            envelope.operation_id, partial(self._apply_result, envelope=envelope, kept=kept)
        )
        self.results.put_texts(kept[-1:])  # the command's last run is the one saved
        return disposition

    def record_results(
        self, envelopes: Sequence[ResultEnvelope]
    ) -> list[ResultDisposition | LedgerError]:
        """Record many results with one append (for batching services)."""
        kept: list[tuple[str, str, str]] = []
        answers = self._batch(
            [
                (envelope.operation_id, partial(self._apply_result, envelope=envelope, kept=kept))
                for envelope in envelopes
            ]
        )
        # After the events: a kept envelope without its event would be harmless,
        # an event pointing at no envelope would not. A command that ran twice
        # (a lost race) kept twice: its last run is the one saved.
        self.results.put_texts(list({item[0]: item for item in kept}.values()))
        return answers

    def _batch(
        self, items: Sequence[tuple[str, Callable[[Operation], T]]]
    ) -> list[T | LedgerError]:
        """Run one command per operation and save all changes in one append."""
        if len({operation_id for operation_id, _ in items}) != len(items):
            return [self._one(operation_id, command) for operation_id, command in items]
        answers: list[T | LedgerError] = []
        changed: list[Operation] = []
        recheck: list[int] = []  # answers that appended nothing, from a cached state
        for index, (operation_id, command) in enumerate(items):
            cached = self._cached(operation_id)
            try:
                operation = cached or self.get(operation_id)
                answers.append(command(operation))
            except LedgerError as error:
                self._forget(operation_id)
                answers.append(error)
                if cached is not None:
                    recheck.append(index)
                continue
            if operation.pending_events:
                changed.append(operation)
            elif cached is not None:
                recheck.append(index)
        try:
            self._save(*changed)
        except IntegrityError:
            return [self._one(operation_id, command) for operation_id, command in items]
        for index in recheck:  # see `_update`: believe no-op answers from stored state only
            answers[index] = self._one(*items[index], use_cache=False)
        return answers

    def _one(
        self, operation_id: str, command: Callable[[Operation], T], *, use_cache: bool = True
    ) -> T | LedgerError:
        try:
            return self._update(operation_id, command, use_cache=use_cache)
        except LedgerError as error:
            return error

    def _apply_result(
        self,
        operation: Operation,
        envelope: ResultEnvelope,
        kept: list[tuple[str, str, str]],
    ) -> ResultDisposition:
        """Record one result on a loaded operation (no save); `kept` gets its envelope
        as (reference, operation ID, exact text), when an event binds that text.

        A result whose provenance names another tool is REFUSED: the results
        consumer accepts a tool's results only on that tool's subject, which
        only its executors may publish to, so this is an executor of one tool
        trying to settle another tool's operation (fencing tokens are small
        counters, easily guessed).
        """
        if envelope.provenance.tool != operation.tool:
            return ResultDisposition.REFUSED
        now = self._clock()
        attempt = envelope.provenance.attempt
        reference = ResultStore.reference(operation.id, attempt)
        error = envelope.error
        reason = error.message if error else ""
        problem = (
            json_value_issue(envelope.data, DEFAULT_LIMITS.max_depth)
            if envelope.data is not None
            else None
        )
        if problem is not None:
            # Data no hash can bind (an integer beyond 2**53, a 300-level nesting):
            # nothing in the envelope can be trusted to say what happened, and
            # it is not kept. Unknown, for reconciliation to settle; before, it
            # failed the append on every redelivery until JetStream gave up.
            outcome, output_hash, text, envelope_hash = "unknown", "", "", ""
            reason = f"the result cannot be recorded: {problem.code} at {problem.path or '/'}"
        else:
            output_hash = (
                sha256_hex(canonical_json(envelope.data)) if envelope.data is not None else ""
            )
            # Encoded once: the event records the hash of exactly the text that is kept.
            text = ResultStore.encode(envelope)
            envelope_hash = envelope_text_hash(text)
            if envelope.ok:
                outcome = "succeeded"
            elif envelope.outcome_unknown:
                outcome = "unknown"
            else:
                outcome = "failed"
        pending = len(operation.pending_events)
        disposition = operation.record_result(
            fencing_token=envelope.fencing_token,
            executor=envelope.provenance.executor,
            outcome=outcome,  # type: ignore[arg-type]
            now=now,
            output_hash=output_hash,
            result_ref=reference,
            code=error.code if error else "",
            category=error.category.value if error else "",
            retryable=error.retryable if error else False,
            reason=reason,
            envelope_hash=envelope_hash,
        )
        if disposition is ResultDisposition.ACCEPTED:
            # Kept only where a settling event names it (not for an unknown
            # outcome, whose reference a later reconciliation of the same
            # attempt reuses: the first text kept would win over the bound one).
            if text and any(
                getattr(event, "result_ref", "") == reference
                for event in operation.pending_events[pending:]
            ):
                kept.append((reference, operation.id, text))
            if operation.can_retry:
                contract = self.contract_of(operation)
                delay = contract.retry.backoff_ms(operation.attempt) if contract else 0
                operation.schedule_retry(not_before=now + timedelta(milliseconds=delay), now=now)
        return disposition

    def expire_leases(self) -> list[str]:
        """Move every operation whose lease ran out to `outcome_unknown`."""
        self.refresh()
        now = self._clock()
        expired = []
        # The view names the candidates, so that a sweep loads only operations
        # whose lease ran out, not every one in flight; the aggregate decides.
        for operation_id in self.projector.lease_expiry_candidates(now):
            operation = self.get(operation_id)
            if operation.lease and operation.lease["expires_at"] <= now:
                self._update(operation_id, lambda op: op.expire_lease(now))
                expired.append(operation_id)
        return expired

    def cancel(self, operation_id: str, *, by: str, reason: str = "") -> Operation:
        """Cancel now if nothing runs, ask the executor if it runs, note it if too late."""

        def command(operation: Operation) -> Operation:
            operation.request_cancel(by=by, reason=reason, now=self._clock())
            return operation

        return self._update(operation_id, command)

    def note_publication_set_aside(
        self, operation_id: str, *, position: int, version: int, reason: str
    ) -> None:
        """Record that the relay could not publish the event at `version` (position
        `position`) and went on without it (`Operation.PublicationSetAside`)."""

        def command(operation: Operation) -> None:
            operation.note_publication_set_aside(
                position=position, version=version, reason=reason, now=self._clock()
            )

        self._update(operation_id, command)

    def start_reconciliation(self, operation_id: str, *, by: str) -> Operation:
        """Begin settling an unknown outcome."""

        def command(operation: Operation) -> Operation:
            operation.start_reconciliation(by=by, now=self._clock())
            return operation

        return self._update(operation_id, command)

    def reconcile(
        self, operation_id: str, *, by: str, succeeded: bool, **details: Any
    ) -> Operation:
        """Settle an unknown outcome with what the provider reports."""

        def command(operation: Operation) -> Operation:
            operation.reconcile(
                outcome="succeeded" if succeeded else "failed", by=by, now=self._clock(), **details
            )
            return operation

        return self._update(operation_id, command)

    # ----------------------------------------------------------------- auditing

    def verify(
        self,
        *,
        expected_head: str | None = None,
        workers: int | None = None,
        chunk_size: int | None = None,
        trusted_keys: Sequence[str] | None = None,
        seal_grace: timedelta | None = None,
        anchor: SignedHead | None = None,
    ) -> VerificationReport:
        """Check every event's hash chain, the seal and its signatures, the view and
        the kept results.

        `trusted_keys`: the public keys whose seal signatures count (None:
        this ledger's own seal key, if it has one); events past the last head
        they signed that are older than `seal_grace` (None: the ledger's) are
        findings. `anchor`: a signed head kept earlier (`audit head`).

        The tables are read straight from SQL, `chunk_size` positions at a time
        (None: chosen for `workers`), by `workers` processes (None: one per CPU
        for a large ledger, else this one alone; 1: this one alone). The report
        does not depend on either: see `ledger.audit.parallel.verify_stored`.
        """
        if trusted_keys is None:
            trusted_keys = [self.sealer.key.public_key] if self.sealer is not None else []
        return verify_stored(
            LedgerTables(self.db.storage, self.events_table),
            expected_head=expected_head,
            workers=workers,
            chunk_size=chunk_size,
            trusted=trusted_keys,
            now=self._clock(),
            grace=self.seal_grace if seal_grace is None else seal_grace,
            anchor=anchor,
        )

    def _stored_ids(self, operation_ids: Iterable[str | None]) -> set[str]:
        """Which of these operation IDs have events (batched `IN` queries)."""
        ids = [operation_id for operation_id in dict.fromkeys(operation_ids) if operation_id]
        rows = self.db.query_in(
            f"SELECT originator_id FROM {self.events_table}"
            " WHERE originator_id IN ({marks}) AND originator_version = 1",
            ids,
        )
        return {str(row[0]) for row in rows}

    def _stored_version(self, operation_id: str) -> int | None:
        rows = self.db.query(
            f"SELECT MAX(originator_version) FROM {self.events_table} WHERE originator_id = ?",
            (operation_id,),
        )
        return int(rows[0][0]) if rows and rows[0][0] is not None else None

    def stored_rows_after(self, position: int, limit: int) -> list[StoredRow]:
        """Up to `limit` stored rows after `position`, in position order."""
        column = "notification_id" if self.db.is_postgres else "rowid"
        return self.db.query(  # both drivers return (int, str, int, str, bytes)
            f"SELECT {column}, originator_id, originator_version, topic, state"
            f" FROM {self.events_table} WHERE {column} > ? ORDER BY {column} LIMIT ?",
            (position, limit),
        )

    def stored_rows(self, page: int = 10_000) -> Iterator[StoredRow]:
        """Every row of the events table in position order, straight from SQL.

        Auditors read the table itself, not the library's notification log, so
        that no row can hide at a position the log does not show.
        """
        position = "notification_id" if self.db.is_postgres else "rowid"
        # `>=` on the first page: a row at the lowest 64-bit position must not hide either.
        after, above = -(2**63), ">="
        while True:
            rows = self.db.query(
                f"SELECT {position}, originator_id, originator_version, topic, state"
                f" FROM {self.events_table} WHERE {position} {above} ? ORDER BY {position} LIMIT ?",
                (after, page),
            )
            # Both drivers already return (int, str, int, str, bytes): no conversion.
            yield from rows
            if len(rows) < page:
                return
            after, above = int(rows[-1][0]), ">"

    def export(self, out: IO[bytes]) -> int:
        """Write the ledger as JSON Lines, sensitive argument values hashed."""
        return export_jsonl(self.stored_rows(), self.checker.catalog, out)

    def close(self) -> None:
        """Release database connections."""
        self.db.close()
        self.events.close()


def _replay(operation: Operation | None, events: Iterable[Any]) -> Operation | None:
    """Apply stored events in order (the library's projector, minus a costly
    runtime protocol check per event on Python 3.11)."""
    for event in events:
        operation = event.mutate(operation)
    return operation


FINAL_STATES = frozenset(
    {
        OperationState.SUCCEEDED,
        OperationState.FAILED,
        OperationState.REJECTED,
        OperationState.APPROVAL_DENIED,
        OperationState.APPROVAL_EXPIRED,
        OperationState.CANCELLED,
    }
)
"""States whose outcome a host can act on. A retryable failure is never seen
here: its retry is scheduled in the same append, so the state is READY again."""


def _lease_reply(
    decision: LeaseDecision, operation: Operation, token: int, timeout_ms: int
) -> LeaseReply:
    lease = operation.lease or {}
    return LeaseReply(
        decision=decision,
        operation_id=operation.id,
        tool=operation.tool,
        tool_version=operation.tool_version,
        arguments=dict(operation.arguments or {}),
        fencing_token=token,
        attempt=operation.attempt,
        lease_expires_at=lease.get("expires_at"),
        timeout_ms=timeout_ms,
        proposal_hash=operation.proposal_hash,
    )


def _grant(operation: Operation, token: int) -> LeaseGrant:
    assert operation.lease is not None and operation.tool_version is not None
    return LeaseGrant(
        operation_id=operation.id,
        tool=operation.tool,
        tool_version=operation.tool_version,
        arguments=dict(operation.arguments or {}),
        fencing_token=token,
        attempt=operation.attempt,
        lease_expires_at=operation.lease["expires_at"],
        proposal_hash=operation.proposal_hash or "",
    )


def effect_preview(
    contract: ToolContract, decision: Decision, context: RuntimeContext
) -> dict[str, Any]:
    """What an approver sees: the exact effect, not "run the tool?" (seed 001)."""
    return {
        "tool": contract.name,
        "tool_version": contract.version,
        "summary": contract.description.summary,
        "effect": contract.effect.value,
        "reversible": contract.effect.value != "irreversible_write",
        "risk": decision.risk.value if decision.risk else None,
        "risk_reasons": list(decision.risk_reasons),
        "arguments": decision.normalized_arguments,
        "applied_defaults": list(decision.applied_defaults),
        "requested_by": context.principal,
        "tenant": context.tenant,
        "environment": context.environment,
        "proposal_hash": decision.proposal_hash,
    }
