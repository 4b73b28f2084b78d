"""Submission: record and check proposals, idempotently by the host's operation ID."""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import orjson
from eventsourcing.persistence import IntegrityError

from ledger.budget import LedgerBudgetCounter, budget_batch
from ledger.domain.errors import InvalidProposal, LedgerError, OperationConflict, OperationNotFound
from ledger.domain.operation import Operation
from ledger.domain.states import OperationState
from ledger.retention import KEPT_REJECTED_BYTES, kept_arguments
from ledger.service._runner import CommandRunner
from policy import ProposalChecker, ToolContract
from schemas import (
    REPAIR_EXHAUSTED,
    REPAIR_TARGET_INVALID,
    CanonicalizationError,
    CheckStage,
    Decision,
    DecisionOutcome,
    RiskLevel,
    RuntimeContext,
    ToolProposal,
    ValidationIssue,
    canonical_json,
    host_operation_id,
    ledger_operation_id,
    sha256_hex,
)

__all__ = [
    "StepOf",
    "Submission",
    "Submissions",
    "SubmitItem",
    "effect_preview",
    "fingerprint",
]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepOf:
    """The plan an operation being built is a step of, and what its approval covers."""

    plan_id: str
    step: str
    approval_id: str | None
    """The plan's approval (None: the plan needed none, so none covers the step)."""
    approvers: tuple[str, ...]
    approved_risk: RiskLevel
    """The step's risk as the plan's approvers saw it: a riskier call (a value that
    arrived from an earlier step's result) is not theirs to have approved."""
    approved_version: str
    """The tool version the plan's approvers saw: a step checked against another
    contract (the catalog changed since) is not theirs to have approved."""
    approval_expires_at: datetime | None
    """Until when the plan's approval holds: a step released later asks for its own,
    as a single call approved that long ago would not run."""

    def covers(self, decision: Decision, *, preview: bool, now: datetime) -> bool:
        """Whether the plan's approval stands in for the step's own: there is one, it
        has not lapsed, and the call as checked now is the one approved (the same
        contract version, no riskier) and asks for no preview."""
        return (
            self.approval_id is not None
            and (self.approval_expires_at is None or now < self.approval_expires_at)
            and decision.tool_version == self.approved_version
            and decision.risk is not None
            and self.approved_risk.at_least(decision.risk)
            and not preview
        )


@dataclass(frozen=True, slots=True)
class Submission:
    """The answer to a submitted proposal."""

    operation_id: str
    state: OperationState
    decision: Decision | None
    """The check's decision; None when the operation already existed."""
    created: bool
    """False when the same call was submitted before under this ID."""


SubmitItem = (
    tuple[ToolProposal, RuntimeContext]
    | tuple[ToolProposal, RuntimeContext, str]
    | tuple[ToolProposal, RuntimeContext, str, str | None]
)
"""A proposal, its trusted context, and optionally the agent host that sent it and the
W3C traceparent the operation's spans continue (`Operation.Proposed.trace_parent`)."""


def fingerprint(proposal: ToolProposal, context: RuntimeContext, host: str = "") -> str:
    """What makes two submissions "the same call" for idempotency.

    The arguments count by their meaning, not their bytes: the same arguments
    as an object or as JSON text, with other whitespace or key order, are the
    same call (RFC 8785 canonical JSON of the parsed value). Text that is not
    JSON counts as the text it is; a value RFC 8785 cannot encode (an integer
    past 2^53) falls back to the stored form's encoding (`_legacy_fingerprint`).
    """
    arguments = proposal.arguments
    if isinstance(arguments, str):
        with contextlib.suppress(orjson.JSONDecodeError):  # not JSON: the text it is
            arguments = orjson.loads(arguments)
    body = _call(proposal, context, host, arguments)
    try:
        return sha256_hex(b"v2:" + canonical_json(body))
    except (CanonicalizationError, RecursionError):
        # Past RFC 8785 (an integer past 2^53) or nested past what it walks: the
        # check refuses such a call anyway; its ID still needs a stable fingerprint.
        return _legacy_fingerprint(proposal, context, host)


def _call(
    proposal: ToolProposal, context: RuntimeContext, host: str, arguments: Any
) -> dict[str, Any]:
    """What a fingerprint covers: the tool, the arguments, who, for which tenant, from
    which host, and the repaired proposal."""
    body = {
        "tool": proposal.tool_name,
        "arguments": arguments,
        "actor": context.principal,
        "tenant": context.tenant,
        "host": host,
    }
    if proposal.repairs is not None:
        # Only when set, so that the fingerprints of calls stored before stay as they were.
        body["repairs"] = proposal.repairs
    return body


def _legacy_fingerprint(proposal: ToolProposal, context: RuntimeContext, host: str) -> str:
    """The fingerprint operations stored before it was canonical carry: the arguments'
    bytes as sent (orjson, sorted keys). A retry of such an operation still matches it."""
    body = _call(proposal, context, host, proposal.arguments)
    try:
        encoded = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        encoded = repr(sorted(body.items())).encode()
    return sha256_hex(encoded)


def effect_preview(
    contract: ToolContract,
    decision: Decision,
    context: RuntimeContext,
    checker: ProposalChecker | None = None,
) -> dict[str, Any]:
    """What an approver sees: the exact effect, not "run the tool?" (seed 001), with
    the resources it acts on as the host's systems name them (`checker`'s resolver)."""
    shown, total = checker.affected_targets(decision, context) if checker else ([], 0)
    return {
        "targets": [target.as_dict() for target in shown],
        "targets_total": total,
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


class Submissions:
    """The submission use case: one atomic append per batch of proposals."""

    def __init__(
        self,
        runner: CommandRunner,
        checker: ProposalChecker,
        *,
        clock: Callable[[], datetime],
        new_id: Callable[[], str],
        budget: LedgerBudgetCounter | None = None,
        kept_rejected_bytes: int = KEPT_REJECTED_BYTES,
    ) -> None:
        self._runner = runner
        self._checker = checker
        self._clock = clock
        self._new_id = new_id
        self._budget = budget
        self._kept_rejected_bytes = kept_rejected_bytes
        # When a batch's append last found an ID of it taken (see `_submit_many`).
        self._id_taken_at = float("-inf")

    def submit_many(self, items: Sequence[SubmitItem]) -> list[Submission | LedgerError]:
        """Record and check many proposals with one atomic append (the fast path).

        Each item gets its own answer: a `Submission`, or the error that
        refused that item alone (an ID its host already used for another
        call, a proposal that cannot be stored). One item can never fail,
        or keep out, the others.
        """
        with budget_batch(self._budget):
            return self._submit_many(items)

    def _submit_many(
        self, items: Sequence[SubmitItem], *, look_up: bool = False
    ) -> list[Submission | LedgerError]:
        answers: list[Submission | LedgerError | None] = [None] * len(items)
        keyed: list[tuple[int, str, ToolProposal, RuntimeContext, str, str | None]] = []
        for index, item in enumerate(items):
            proposal, context, host, trace_parent = _unpack(item)
            try:
                operation_id = ledger_operation_id(host, proposal.operation_id or self._new_id())
            except ValueError:
                answers[index] = InvalidProposal(
                    "the host name or operation ID is not a valid identifier"
                )
                continue
            keyed.append((index, operation_id, proposal, context, host, trace_parent))
        ids = [operation_id for _, operation_id, *_ in keyed]
        # Right after a batch's append found one of its IDs taken, ask first for a
        # while: a host resending old IDs must not make every turn run twice (and the
        # other lanes of the service's turn with it).
        look_up = look_up or time.monotonic() - self._id_taken_at < _LOOK_UP_AFTER_S
        if look_up:
            # One query for the batch instead of one lookup per proposal; an ID
            # stored by another writer after it is caught by the append below.
            stored = self._runner.tables.stored_ids(ids)
        else:
            # First without asking the database: a new proposal's ID is new, and an ID
            # already stored makes the append below fail as a whole (its first event's
            # version is taken), after which the batch is settled with the lookup.
            # The query per batch was a tenth of the service's PostgreSQL waits; a
            # proposal sent again soon (a host's retry) is still known here, cached.
            stored = {operation_id for operation_id in ids if self._runner.cached(operation_id)}
        new: list[tuple[int, Operation, Decision]] = []
        fresh: dict[str, tuple[int, str]] = {}
        # Rejected operations a proposal of this batch repairs: saved in the same append.
        repaired: dict[str, Operation] = {}
        for index, operation_id, proposal, context, host, trace_parent in keyed:
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
                    existing = self._existing(operation_id, proposal, context, host)
                    if existing is not None:
                        answers[index] = existing
                        continue
                operation, decision = self._new_operation(
                    operation_id, proposal, context, print_, host, repaired, trace_parent
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
        # A refusal is the answer for a new ID only: under a stored one, the answer is
        # what the lookup would have given (the operation, or a conflict).
        refused_unasked = [
            (index, operation_id, proposal, context, host)
            for index, operation_id, proposal, context, host, _ in keyed
            if not look_up
            and operation_id not in stored
            and isinstance(answers[index], LedgerError)
        ]
        if refused_unasked:
            found = self._runner.tables.stored_ids(op for _, op, *_ in refused_unasked)
            for index, operation_id, proposal, context, host in refused_unasked:
                if operation_id in found:
                    try:
                        existing = self._existing(operation_id, proposal, context, host)
                    except LedgerError as error:
                        answers[index] = error
                    else:
                        if existing is not None:
                            answers[index] = existing
        if new:
            try:
                self._runner.save(
                    *(operation for _, operation, _ in new),
                    *(target for target in repaired.values() if target.pending_events),
                )
            except IntegrityError:
                if self._budget is not None:
                    self._budget.clear_pending()
                self._id_taken_at = time.monotonic()
                if not look_up:
                    # An ID of the batch was stored already: again, asking which.
                    return self._submit_many(items, look_up=True)
                # Another writer created one of these IDs meanwhile: settle one by one.
                return [
                    answer
                    if isinstance(answer, LedgerError)
                    else self._submit_after_race(items[index])
                    for index, answer in enumerate(answers)
                ]
            for index, operation, decision in new:
                answers[index] = Submission(operation.id, operation.state, decision, True)
        return [answer for answer in answers if answer is not None]

    def retry(self, operation_id: str, *, by: str, reason: str, via: str) -> Submission:
        """A person runs a failed call again: the same call, for the same caller, as a
        new operation (`<host's ID>-r<n>`) linked both ways to the failed one.

        The new operation is checked, approved and budgeted afresh, as any proposal
        is (the policy, the catalog and the caller's standing may have changed since),
        and its outcome is announced to the host under its own ID. The failed one
        keeps its final outcome; `Operation.note_retry` says what refuses a retry.
        Both are stored in one append, or neither.
        """
        original = self._runner.get(operation_id)
        if original.capabilities is None:
            raise InvalidProposal(
                "this operation was stored before its caller's capabilities were recorded:"
                " propose the call anew"
            )
        host = original.host
        retry_id = ledger_operation_id(host, _retry_local_id(host_operation_id(original.id)))
        stored = dict(original.proposal)
        stored.update(operation_id=host_operation_id(retry_id), repairs=None, repair_attempt=0)
        proposal = ToolProposal.model_validate(stored)
        context = original.caller_context
        original.note_retry(retry_id=retry_id, by=by, reason=reason, via=via, now=self._clock())
        if self._runner.tables.stored_ids([retry_id]):
            raise OperationConflict(
                f"the ID {retry_id} the retry would take is taken", operation_id=original.id
            )
        with budget_batch(self._budget):
            try:
                operation, decision = self._new_operation(
                    retry_id,
                    proposal,
                    context,
                    fingerprint(proposal, context, host),
                    host,
                    trace_parent=original.trace_parent,
                    retries=(original.id, by),
                )
                self._runner.save(operation, original)
            except IntegrityError:
                raise OperationConflict(
                    "the operation changed, or its retry's ID was taken, meanwhile: look again",
                    operation_id=original.id,
                ) from None
        return Submission(operation.id, operation.state, decision, True)

    def compensation(
        self,
        operation_id: str,
        proposal: ToolProposal,
        context: RuntimeContext,
        host: str,
        *,
        compensates: str,
        by: str,
    ) -> tuple[Operation, Decision]:
        """The operation that undoes `compensates`, built and checked but not saved (it is
        saved with the original's `CompensationProposed`): a call of its own, checked,
        approved and budgeted like any, proposed by `by` on behalf of the original caller."""
        with budget_batch(self._budget):
            return self._new_operation(
                operation_id,
                proposal,
                context,
                fingerprint(proposal, context, host),
                host,
                compensates=(compensates, by),
            )

    def step_operation(
        self,
        operation_id: str,
        proposal: ToolProposal,
        context: RuntimeContext,
        host: str,
        step_of: StepOf,
        compensates: tuple[str, str] | None = None,
    ) -> tuple[Operation, Decision]:
        """The operation of a released plan step, built and checked but not saved (the
        plan saves it together with its `StepReleased`). Its arguments are the step's
        with every reference replaced by the value it names, checked in full like any
        call; the plan's approval stands in for its own only while the step is no
        riskier than when the plan was approved and its contract asks for no preview.
        `compensates`: (the operation it undoes, who proposed that), for a step of a
        compensation plan. It counts against its caller's budget from now on, for the
        steps released with it too: the caller ends the batch after saving them
        (`LedgerBudgetCounter.batch`)."""
        return self._new_operation(
            operation_id,
            proposal,
            context,
            fingerprint(proposal, context, host),
            host,
            step_of=step_of,
            compensates=compensates,
        )

    def _submit_after_race(self, item: SubmitItem) -> Submission | LedgerError:
        proposal, context, host, _ = _unpack(item)
        if proposal.operation_id is not None:
            operation_id = ledger_operation_id(host, proposal.operation_id)
            try:
                existing = self._existing(operation_id, proposal, context, host)
            except LedgerError as error:
                return error
            if existing is not None:
                return existing
        # Saved (or not) on its own: the next item's check must not count it as
        # pending as well as stored.
        with budget_batch(self._budget):
            return self._submit_many([item], look_up=True)[0]

    def _repair_link(
        self,
        proposal: ToolProposal,
        host: str,
        operation_id: str,
        repaired: dict[str, Operation] | None,
    ) -> tuple[Operation | None, int, ValidationIssue | None]:
        """The rejected operation `proposal` repairs, the chain's depth, or why it cannot.

        A repair must name a rejected, repairable proposal of the same host,
        conversation and tool that no other proposal repairs yet. Its depth is
        the target's plus one: counted from the ledger's events, whatever the
        host says in `repair_attempt`.
        """
        if proposal.repairs is None:
            return _NO_REPAIR
        target_id = ledger_operation_id(host, proposal.repairs)
        target = (repaired or {}).get(target_id)
        if target is None:
            try:
                target = self._runner.get(target_id)
            except OperationNotFound:
                return _invalid_repair("`repairs` names no proposal of this host")
        if target.host != host:
            return _invalid_repair("`repairs` names no proposal of this host")
        if (
            target.state is not OperationState.REJECTED
            or target.tool != proposal.tool_name
            or target.proposal.get("conversation_id") != proposal.conversation_id
        ):
            return _invalid_repair(
                "`repairs` must name a rejected, repairable proposal of the same"
                " conversation and tool"
            )
        if target.repaired_by not in (None, operation_id):
            return _invalid_repair(
                "that proposal is already repaired by another: repair the newest one"
            )
        return target, target.repair_depth + 1, None

    def _existing(
        self, operation_id: str, proposal: ToolProposal, context: RuntimeContext, host: str
    ) -> Submission | None:
        try:
            operation = self._runner.get(operation_id)
        except OperationNotFound:
            return None
        if operation.fingerprint != fingerprint(proposal, context, host) and (
            operation.fingerprint != _legacy_fingerprint(proposal, context, host)
        ):
            raise _conflict(operation_id)
        return Submission(operation.id, operation.state, None, False)

    def _new_operation(
        self,
        operation_id: str,
        proposal: ToolProposal,
        context: RuntimeContext,
        print_: str,
        host: str,
        repaired: dict[str, Operation] | None = None,
        trace_parent: str | None = None,
        retries: tuple[str, str] | None = None,
        step_of: StepOf | None = None,
        compensates: tuple[str, str] | None = None,
    ) -> tuple[Operation, Decision]:
        pending_repair: list[Operation] = []
        operation, decision = self._build_operation(
            operation_id,
            proposal,
            context,
            print_,
            host,
            repaired,
            pending_repair,
            trace_parent,
            retries,
            step_of,
            compensates,
        )
        for target in pending_repair:
            assert repaired is not None
            target.note_repair(by=operation_id, now=self._clock())
            repaired[target.id] = target
        if (
            self._budget is not None
            and decision.outcome not in _NOT_ACCEPTED
            and _limited(self._checker.catalog.get(decision.tool))
        ):
            # Counted from now on: by later checks of this batch, and once stored by
            # every later one (retries, compensations and plan steps count too). Only
            # a tool with a limit is ever counted: the rest would be remembered for
            # nothing.
            self._budget.note_pending(
                tenant=context.tenant,
                actor=context.principal,
                tool=decision.tool,
                operation_id=operation.id,
                at=operation.created_on,
            )
        return operation, decision

    def _build_operation(
        self,
        operation_id: str,
        proposal: ToolProposal,
        context: RuntimeContext,
        print_: str,
        host: str,
        repaired: dict[str, Operation] | None,
        pending_repair: list[Operation],
        trace_parent: str | None = None,
        retries: tuple[str, str] | None = None,
        step_of: StepOf | None = None,
        compensates: tuple[str, str] | None = None,
    ) -> tuple[Operation, Decision]:
        now = self._clock()
        target, depth, refusal = self._repair_link(proposal, host, operation_id, repaired)
        # The ledger's own count, never the host's: `repair_attempt` is what the
        # check's repair status and bound read.
        proposal = proposal.model_copy(update={"repair_attempt": depth})
        contract_of = self._checker.catalog.get(proposal.tool_name)
        if refusal is None and contract_of is not None and depth > contract_of.max_repair_attempts:
            refusal = ValidationIssue(
                stage=CheckStage.REPAIR,
                code=REPAIR_EXHAUSTED,
                message=f"this call was repaired {depth - 1} times already; the bound is"
                f" {contract_of.max_repair_attempts}: ask the user instead",
                expected=contract_of.max_repair_attempts,
                actual=depth,
                repairable=False,
            )
        elif refusal is None and target is not None and not target.repairable:
            refusal = ValidationIssue(
                stage=CheckStage.REPAIR,
                code=REPAIR_TARGET_INVALID,
                message="that rejection cannot be repaired by the model: ask the user",
                repairable=False,
            )
            target = None
        decision = (
            self._checker.check(proposal, context)
            if refusal is None
            else self._checker.refuse(proposal, [refusal])
        )
        if refusal is not None and refusal.code == REPAIR_TARGET_INVALID:
            target = None  # not a valid link: nothing is noted on it
        rejected = decision.outcome in _NOT_ACCEPTED
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
            capabilities=context.capabilities,
            repairs=target.id if target is not None else None,
            repair_depth=depth if target is not None else 0,
            trace_parent=trace_parent,
            retries=retries[0] if retries else None,
            proposed_by=(retries or compensates or (None, None))[1],
            compensates=compensates[0] if compensates else None,
            plan=step_of.plan_id if step_of is not None else None,
            step=step_of.step if step_of is not None else None,
        )
        if target is not None and repaired is not None:
            # Noted once the repairing operation is built (below): a proposal that
            # fails on the way must not leave its target "repaired" by nothing.
            pending_repair.append(target)
        if decision.outcome is DecisionOutcome.NEEDS_CLARIFICATION:
            operation.ask_clarification(
                question=decision.question or "",
                issues=[issue.model_dump(mode="json") for issue in decision.issues],
                tool_version=decision.tool_version,
                now=now,
            )
            return operation, decision
        if rejected:
            operation.reject(
                issues=[issue.model_dump(mode="json") for issue in decision.issues],
                category=(decision.category.value if decision.category else "INVALID_INPUT"),
                repairable=decision.repairable,
                tool_version=decision.tool_version,
                now=now,
            )
            return operation, decision
        contract = self._checker.catalog[decision.tool]
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
        elif step_of is not None and step_of.covers(
            decision, preview=contract.approval.preview, now=now
        ):
            assert step_of.approval_id is not None
            operation.mark_ready_in_plan(
                approval_id=step_of.approval_id, approvers=list(step_of.approvers), now=now
            )
        else:
            operation.request_approval(
                approval_id=f"apr-{uuid.uuid4().hex[:16]}",
                effect_preview=effect_preview(contract, decision, context, self._checker),
                approver_roles=list(decision.approval.approver_roles),
                required_approvals=decision.approval.required_approvals,
                required_from=dict(decision.approval.required_from),
                separation_of_duties=decision.approval.separation_of_duties,
                expires_at=now + timedelta(seconds=decision.approval.expires_in_s),
                reason=decision.approval.reason,
                now=now,
            )
            if contract.approval.preview:
                # In the same append: the preview's work item goes out with the request.
                operation.request_preview(now)
        return operation, decision


_NOT_ACCEPTED = frozenset({DecisionOutcome.REJECTED, DecisionOutcome.NEEDS_CLARIFICATION})
"""Decisions that never run: only what is storable and small of their arguments is kept."""

_LOOK_UP_AFTER_S = 10.0
"""After a batch found an ID of it taken, batches look their IDs up first for this long."""

_NO_REPAIR: tuple[None, int, None] = (None, 0, None)


def _invalid_repair(message: str) -> tuple[None, int, ValidationIssue]:
    return (
        None,
        0,
        ValidationIssue(
            stage=CheckStage.REPAIR,
            code=REPAIR_TARGET_INVALID,
            message=message,
            repairable=False,
        ),
    )


def _conflict(operation_id: str) -> OperationConflict:
    # Named by the host's own ID: the conflict is within the host's namespace.
    return OperationConflict(
        "this operation ID belongs to a different call",
        operation_id=host_operation_id(operation_id),
    )


_RETRY_SUFFIX = re.compile(r"-r([0-9]{1,6})$")


def _retry_local_id(local: str) -> str:
    """The host-local ID of the next retry of `local`: `mail-1` → `mail-1-r1`, and a
    retry's retry `mail-1-r1` → `mail-1-r2` (within the 128 characters an ID has)."""
    found = _RETRY_SUFFIX.search(local)
    base, number = (local[: found.start()], int(found.group(1))) if found else (local, 0)
    suffix = f"-r{number + 1}"
    if len(base) + len(suffix) > 128:
        base = base[: 128 - len(suffix) - 9] + "-" + sha256_hex(base.encode())[:8]
    return base + suffix


def _unpack(item: SubmitItem) -> tuple[ToolProposal, RuntimeContext, str, str | None]:
    if len(item) == 4:
        return item
    if len(item) == 3:
        return item[0], item[1], item[2], None
    return item[0], item[1], "", None


def _limited(contract: ToolContract | None) -> bool:
    return contract is not None and (
        contract.limits.max_per_minute is not None or contract.limits.max_per_hour is not None
    )
