"""Planning: propose, check, approve and run a plan of tool calls (seed 001).

The plan is checked whole before anything runs (every step's layered check,
its shape, its references, its parallel writes, one approval requirement);
then `advance` runs it: a step is released (its operation proposed, with the
values its references name put in) once every step it depends on succeeded,
and skipped, with the reason, once one of them did not; independent branches
go on. `advance` decides from the stored states alone, so calling it again,
from any instance, after a crash, converges: releasing a step and recording
it are one append, and a step's operation ID is fixed by the plan.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import orjson
from eventsourcing.application import AggregateNotFoundError
from eventsourcing.persistence import IntegrityError

from ledger.budget import LedgerBudgetCounter, budget_batch
from ledger.domain.approval_rules import Refusal
from ledger.domain.errors import (
    ApprovalRefused,
    IllegalTransition,
    InvalidProposal,
    LedgerError,
    OperationConflict,
    OperationNotFound,
    PlanNotFound,
)
from ledger.domain.operation import Operation
from ledger.domain.plan import (
    PLAN_ID_SUFFIX,
    Plan,
    PlanState,
    StepState,
    is_plan_id,
    plan_ledger_id,
)
from ledger.domain.states import TERMINAL_STATES, OperationState
from ledger.retention import KEPT_REJECTED_BYTES, kept_arguments
from ledger.service._compensation import compensation_arguments, compensation_id
from ledger.service._runner import CommandRunner
from ledger.service._status import StatusReader
from ledger.service._submission import StepOf, Submissions, effect_preview
from policy import (
    MISSING,
    ProposalChecker,
    merge_approvals,
    parallel_writes,
    plan_shape,
    resolve_pointer,
    riskiest,
)
from schemas import (
    REFERENCE_KEY,
    CheckStage,
    Decision,
    DecisionOutcome,
    PlanProposal,
    PlanStatus,
    PlanStepStatus,
    RiskLevel,
    RuntimeContext,
    ToolProposal,
    ValidationIssue,
    canonical_json,
    host_operation_id,
    ledger_operation_id,
    plan_hash,
    references_in,
    sha256_hex,
)

__all__ = ["Planning"]

_log = logging.getLogger(__name__)

_NOT_ACCEPTED = frozenset({DecisionOutcome.REJECTED, DecisionOutcome.NEEDS_CLARIFICATION})
_CONFLICT_RETRIES = 5


def _replay(plan: Plan | None, events: Iterable[Any]) -> Plan | None:
    for event in events:
        plan = event.mutate(plan)
    return plan


def _fingerprint(proposal: PlanProposal, context: RuntimeContext, host: str) -> str:
    return sha256_hex(
        canonical_json(
            {
                "host": host,
                "actor": context.principal,
                "tenant": context.tenant,
                "environment": context.environment,
                "capabilities": sorted(context.capabilities),
                "plan": proposal.model_dump(mode="json"),
            }
        )
    )


def _at_step(issue: ValidationIssue, index: int, step: str) -> ValidationIssue:
    """A step's own finding, placed in the plan: its path under `/steps/<i>/arguments`."""
    return issue.model_copy(
        update={
            "path": f"/steps/{index}/arguments{issue.path}",
            "details": {**issue.details, "step": step},
        }
    )


@dataclass(frozen=True, slots=True)
class _Undoing:
    """What a compensation plan undoes: the plan, who asked, and per undoing step the
    operation it undoes."""

    plan_id: str
    by: str
    steps: Mapping[str, str]


class Planning:
    """The plan use cases, on the same runner, checker and submissions as single calls."""

    def __init__(
        self,
        runner: CommandRunner,
        checker: ProposalChecker,
        submissions: Submissions,
        status_reader: StatusReader,
        *,
        clock: Callable[[], datetime],
        budget: LedgerBudgetCounter | None = None,
    ) -> None:
        self._runner = runner
        self._checker = checker
        self._submissions = submissions
        self._status = status_reader
        self._clock = clock
        self._budget = budget

    # ------------------------------------------------------------------ reading

    def get(self, plan_id: str) -> Plan:
        """The stored plan, by the ledger's ID: `<host>/<id>` as people see it (or as
        stored, `<host>/<id>~plan`)."""
        if not is_plan_id(plan_id):
            plan_id = plan_ledger_id(plan_id)
        try:
            plan = self._runner.events.repository.get(plan_id, projector_func=_replay)
        except AggregateNotFoundError:
            raise PlanNotFound("no such plan", operation_id=plan_id) from None
        if not isinstance(plan, Plan):
            raise PlanNotFound("no such plan", operation_id=plan_id)
        return plan

    def ledger_id(self, host: str, plan_id: str) -> str:
        """The ledger's ID of host `host`'s plan `plan_id`."""
        return plan_ledger_id(ledger_operation_id(host, plan_id))

    def status(self, plan_id: str, *, host: str | None = None) -> PlanStatus:
        """Where a plan stands, with its step table. With `host`: asked by that host,
        in its own namespace (`plan_id` is the host's ID, and so are the answer's)."""
        asked = plan_id
        if host is not None:
            plan_id = self.ledger_id(host, plan_id)
        try:
            plan = self.get(plan_id)
        except PlanNotFound:
            raise PlanNotFound("no such plan", operation_id=asked) from None
        if host is not None and plan.host != host:
            raise PlanNotFound("no such plan", operation_id=asked)
        local = host is not None
        return self._describe(plan, asked if local else _shown(plan), local=local)

    def _describe(self, plan: Plan, shown_id: str, *, local: bool) -> PlanStatus:
        rows = []
        for one in plan.steps:
            name = one["step"]
            operation_id = plan.released.get(name, one["operation_id"])
            state: str
            compensation = None
            retry_needed = False
            if name in plan.skipped:
                state, retry_needed = "skipped", True
            elif name in plan.released:
                try:
                    operation = self._runner.get(operation_id)
                    state = operation.state.value
                except OperationNotFound:
                    state = "unknown"
                retry_needed = state in _RETRYABLE
                if state == OperationState.SUCCEEDED.value:
                    contract = self._checker.catalog.get(one["tool"])
                    if contract is not None and contract.compensation is not None:
                        compensation = contract.compensation.tool
            else:
                state = "waiting"
            rows.append(
                PlanStepStatus(
                    step=name,
                    operation_id=host_operation_id(operation_id) if local else operation_id,
                    tool=one["tool"],
                    state=state,
                    depends_on=tuple(one["depends_on"]),
                    skipped_because=plan.skipped.get(name),
                    retry_needed=retry_needed and plan.state.is_final,
                    compensation=compensation,
                )
            )
        approval = plan.approval
        return PlanStatus(
            plan_id=shown_id,
            state=plan.state.value,
            final=plan.state.is_final,
            plan_hash=plan.plan_hash,
            risk=plan.risk,
            steps=tuple(rows),
            issues=tuple(plan.issues),
            approvals_required=approval.required_approvals if approval else 0,
            approvals_granted=len(plan.approvals_given),
            cancel_requested=plan.cancel_requested,
        )

    # ----------------------------------------------------------------- proposing

    def propose(
        self,
        proposal: PlanProposal,
        context: RuntimeContext,
        host: str,
        *,
        undoes: _Undoing | None = None,
    ) -> PlanStatus:
        """Record and check a plan; run what may run at once. Idempotent by the host's
        plan ID: the same plan again answers its status, another plan under that ID
        `OPERATION_CONFLICT`. `undoes`: for a compensation plan (`compensate`)."""
        # The steps released at once count against the budget until saved.
        with budget_batch(self._budget):
            return self._propose(proposal, context, host, undoes=undoes)

    def _propose(
        self,
        proposal: PlanProposal,
        context: RuntimeContext,
        host: str,
        *,
        undoes: _Undoing | None = None,
    ) -> PlanStatus:
        plan_id = self.ledger_id(host, proposal.plan_id)
        print_ = _fingerprint(proposal, context, host)
        existing = self._existing(plan_id, print_, proposal.plan_id)
        if existing is not None:
            return existing
        now = self._clock()
        with budget_batch(self._budget):
            issues, steps, decisions, requirement = self._check(proposal, context, host)
        body = proposal.model_dump(mode="json")
        plan = Plan.propose(
            plan_id,
            # Of a refused plan, only what is small is kept: a host cannot fill the
            # ledger with plans that never run (as with a refused single call).
            plan=_kept_rejected(body) if issues else body,
            fingerprint=print_,
            host=host,
            actor=context.principal,
            tenant=context.tenant,
            environment=context.environment,
            capabilities=context.capabilities,
            now=now,
            proposed_by=undoes.by if undoes else None,
            compensates=undoes.plan_id if undoes else None,
        )
        released: list[Operation] = []
        if undoes is not None:
            for one in steps:
                one["compensates"] = undoes.steps[one["step"]]
        if issues:
            kept = [issue.model_dump(mode="json") for issue in issues[:_MAX_FINDINGS]]
            if len(issues) > _MAX_FINDINGS:
                kept.append({"code": "more_issues", "message": f"{len(issues) - _MAX_FINDINGS}"
                             " more findings are not listed: repair these first",
                             "path": "", "details": {"step": ""}})
            plan.reject(issues=kept, now=now)
        else:
            risk = riskiest([RiskLevel(one["risk"]) for one in steps])
            plan.validate(plan_hash=plan_hash(steps), risk=risk.value, steps=steps, now=now)
            if requirement is None:
                plan.start(now)
                released = self._advance(plan)
            else:
                plan.request_approval(
                    approval_id=f"apr-{uuid.uuid4().hex[:16]}",
                    effect_preview=self._plan_preview(plan, decisions, context),
                    approver_roles=list(requirement.approver_roles),
                    required_approvals=requirement.required_approvals,
                    required_from=requirement.required_from,
                    separation_of_duties=requirement.separation_of_duties,
                    expires_at=now + timedelta(seconds=requirement.expires_in_s),
                    reason=requirement.reason,
                    now=now,
                )
        try:
            self._runner.save(plan, *released)
        except IntegrityError:
            # Another writer stored this plan, or one of its steps' IDs, meanwhile.
            existing = self._existing(plan_id, print_, proposal.plan_id)
            if existing is not None:
                return existing
            raise OperationConflict(
                "a step's operation ID was taken meanwhile: propose the plan again",
                operation_id=proposal.plan_id,
            ) from None
        return self._describe(plan, proposal.plan_id, local=True)

    def _existing(self, plan_id: str, print_: str, asked: str) -> PlanStatus | None:
        try:
            plan = self.get(plan_id)
        except PlanNotFound:
            return None
        if plan.fingerprint != print_:
            raise OperationConflict("this plan ID belongs to a different plan", operation_id=asked)
        return self._describe(plan, asked, local=True)

    def _check(
        self, proposal: PlanProposal, context: RuntimeContext, host: str
    ) -> tuple[
        list[ValidationIssue], list[dict[str, Any]], dict[str, Decision], Any
    ]:
        """(findings, the steps as checked, each step's decision, the plan's approval
        requirement or None)."""
        catalog = self._checker.catalog
        shape, issues = plan_shape(proposal, catalog)
        if shape is None:
            return issues, [], {}, None
        ids = {step.step: ledger_operation_id(host, step.operation_id) for step in proposal.steps}
        taken = self._runner.tables.stored_ids(ids.values())
        decisions: dict[str, Decision] = {}
        for index, step in enumerate(proposal.steps):
            if ids[step.step] in taken:
                issues.append(
                    ValidationIssue(
                        stage=CheckStage.STRUCTURE,
                        code="plan_operation_id_taken",
                        message=f"step {step.step!r}: this host used the operation ID"
                        f" {step.operation_id!r} already; a step is a new operation",
                        path=f"/steps/{index}/operation_id",
                        repairable=True,
                        details={"step": step.step},
                    )
                )
                continue
            call = ToolProposal(
                proposal_id=step.operation_id,
                conversation_id=proposal.conversation_id,
                requested_by_user_id=proposal.requested_by_user_id,
                tool_name=step.tool_name,
                arguments=step.arguments,
                operation_id=step.operation_id,
            )
            deferred = frozenset(ref.at for ref in references_in(step.arguments))
            decision = self._checker.check(call, context, deferred=deferred)
            if decision.outcome in _NOT_ACCEPTED:
                issues.extend(_at_step(issue, index, step.step) for issue in decision.issues)
                continue
            decisions[step.step] = decision
            if self._budget is not None:
                # Budgets count the whole plan: each later step sees the earlier ones.
                self._budget.note_pending(
                    tenant=context.tenant, actor=context.principal, tool=decision.tool
                )
        if issues:
            return issues, [], decisions, None
        arguments = {name: dict(d.normalized_arguments or {}) for name, d in decisions.items()}
        issues.extend(parallel_writes(proposal, shape, catalog, arguments))
        requirement = merge_approvals(
            {name: d.approval for name, d in decisions.items() if d.approval is not None}
        )
        if isinstance(requirement, ValidationIssue):
            issues.append(requirement)
        if issues:
            return issues, [], decisions, None
        steps = []
        for step in proposal.steps:
            decision = decisions[step.step]
            assert decision.risk is not None
            steps.append(
                {
                    "step": step.step,
                    "operation_id": ids[step.step],
                    "tool": decision.tool,
                    "tool_version": decision.tool_version,
                    "arguments": arguments[step.step],
                    "depends_on": list(step.depends_on),
                    "risk": decision.risk.value,
                    "needs_approval": decision.approval is not None,
                    "proposal_hash": decision.proposal_hash,
                }
            )
        return issues, steps, decisions, requirement

    def _plan_preview(
        self, plan: Plan, decisions: dict[str, Decision], context: RuntimeContext
    ) -> dict[str, Any]:
        """What the plan's approvers see: every step's exact effect, in order, with its
        dependencies and where a value comes from an earlier step's result."""
        steps = []
        for one in plan.steps:
            decision = decisions[one["step"]]
            contract = self._checker.catalog[decision.tool]
            shown = effect_preview(contract, decision, context, self._checker)
            shown.update(
                step=one["step"],
                operation_id=one["operation_id"],
                depends_on=one["depends_on"],
                takes_from=[
                    {"argument": ref.at, "step": ref.step, "field": ref.pointer}
                    for ref in references_in(one["arguments"])
                ],
            )
            steps.append(shown)
        return {
            "plan": plan.id,
            "plan_hash": plan.plan_hash,
            "risk": plan.risk,
            "steps": steps,
            "requested_by": context.principal,
            "tenant": context.tenant,
            "environment": context.environment,
        }

    # ----------------------------------------------------------------- deciding

    def approve(
        self,
        plan_id: str,
        *,
        approver: str,
        approver_roles: Iterable[str],
        plan_hash: str,
        via: str = "",
    ) -> PlanStatus:
        """Approve exactly the plan that hashes to `plan_hash`; the last approval it
        needs starts it. A refused approval is recorded, then `ApprovalRefused` raised."""
        roles = frozenset(approver_roles)

        def command(plan: Plan) -> tuple[list[Operation], Refusal | None]:
            refusal = plan.grant_approval(
                approval_id=plan.approval.approval_id if plan.approval else "",
                approver=approver,
                approver_roles=roles,
                plan_hash=plan_hash,
                now=self._clock(),
                via=via,
            )
            return (self._advance(plan) if refusal is None else []), refusal

        plan, refusal = self._update(plan_id, command)
        if refusal is not None:
            raise ApprovalRefused(
                f"approval refused: {refusal}", operation_id=plan.id, reason=refusal
            )
        return self._describe(plan, _shown(plan), local=False)

    def deny(
        self,
        plan_id: str,
        *,
        approver: str,
        approver_roles: Iterable[str],
        reason: str = "",
        via: str = "",
    ) -> PlanStatus:
        """Deny the plan: none of it runs."""
        roles = frozenset(approver_roles)

        def command(plan: Plan) -> tuple[list[Operation], Refusal | None]:
            refusal = plan.deny_approval(
                approval_id=plan.approval.approval_id if plan.approval else "",
                approver=approver,
                approver_roles=roles,
                reason=reason,
                now=self._clock(),
                via=via,
            )
            return [], refusal

        plan, refusal = self._update(plan_id, command)
        if refusal is not None:
            raise ApprovalRefused(f"denial refused: {refusal}", operation_id=plan.id,
                                  reason=refusal)
        return self._describe(plan, _shown(plan), local=False)

    def cancel(self, plan_id: str, *, by: str, reason: str = "") -> PlanStatus:
        """Cancel the plan: steps not started are skipped, running ones are asked to stop
        (each then ends `cancelled` or `too_late`, as a single call does)."""

        def command(plan: Plan) -> tuple[list[Operation], None]:
            if plan.request_cancel(by=by, reason=reason, now=self._clock()):
                return self._advance(plan, cancelled_by=by), None
            return [], None

        plan, _ = self._update(plan_id, command)
        return self._describe(plan, _shown(plan), local=False)

    def retry(self, plan_id: str, *, by: str, reason: str = "") -> PlanStatus:
        """Run a failed or partially succeeded plan's failed and skipped steps again:
        each failed step as a new operation linked to the failed one, skipped steps
        once their dependencies succeed. A succeeded step never runs again."""

        def command(plan: Plan) -> tuple[list[Operation], None]:
            again = []
            for one in plan.steps:
                name = one["step"]
                if name in plan.skipped:
                    again.append(name)
                elif name in plan.released:
                    state = self._runner.get(plan.released[name]).state
                    if state is not OperationState.SUCCEEDED:
                        again.append(name)
            plan.retry(by=by, reason=reason, steps=again, now=self._clock())
            return self._advance(plan), None

        plan, _ = self._update(plan_id, command)
        return self._describe(plan, _shown(plan), local=False)

    def compensate(self, plan_id: str, *, by: str, reason: str) -> PlanStatus:
        """Propose undoing a plan's succeeded steps, as a plan of its own
        (`<plan id>-undo`): one step per succeeded step whose contract names a
        compensation, in the reverse order (a step is undone after every step that
        depended on it), checked and approved like any plan; each undoing operation
        and the step it undoes are linked both ways. Steps whose effect no tool undoes
        are left (the status's `compensation` says which). `by`: who asks."""
        if not reason.strip():
            raise InvalidProposal("a compensation needs a reason (why undo what happened)")
        plan = self.get(plan_id)
        if not plan.state.is_final or plan.state in (PlanState.REJECTED,
                                                      PlanState.APPROVAL_DENIED,
                                                      PlanState.APPROVAL_EXPIRED):
            raise IllegalTransition(
                f"only a plan that ran is undone; this one is {plan.state.value}",
                operation_id=plan.id,
            )
        undoable: dict[str, tuple[Operation, Any]] = {}
        for one in plan.steps:
            name = one["step"]
            contract = self._checker.catalog.get(one["tool"])
            if name not in plan.released or contract is None or contract.compensation is None:
                continue
            operation = self._runner.get(plan.released[name])
            if operation.state is OperationState.SUCCEEDED:
                undoable[name] = (operation, contract.compensation)
        if not undoable:
            raise InvalidProposal("no succeeded step of this plan is undone by a tool")
        names = {name: f"undo-{name}" if len(name) <= 59 else f"undo-{i}"
                 for i, name in enumerate(undoable)}
        steps = []
        for one in reversed(plan.steps):
            name = one["step"]
            if name not in undoable:
                continue
            operation, compensation = undoable[name]
            result = self._status.result_data(operation.id)
            dependents = [
                names[other["step"]] for other in plan.steps
                if name in other["depends_on"] and other["step"] in undoable
            ]
            steps.append({
                "step": names[name],
                "operation_id": host_operation_id(compensation_id(operation.id, plan.host)),
                "tool_name": compensation.tool,
                "arguments": compensation_arguments(
                    compensation.arguments, operation.arguments or {}, result
                ),
                "depends_on": dependents,
            })
        body = plan.plan
        proposal = PlanProposal.model_validate({
            "plan_id": f"{host_operation_id(plan.id.removesuffix(PLAN_ID_SUFFIX))}-undo",
            "conversation_id": body["conversation_id"],
            "requested_by_user_id": body["requested_by_user_id"],
            "steps": steps,
        })
        context = plan.caller_context
        undoes = _Undoing(plan.id, by, {names[name]: op.id for name, (op, _) in undoable.items()})
        proposed = self.propose(proposal, context, plan.host, undoes=undoes)
        return proposed.model_copy(
            update={"plan_id": ledger_operation_id(plan.host, proposal.plan_id)}
        )

    def advance(self, plan_id: str) -> PlanStatus:
        """Release what may run, skip what no longer can, settle the plan once every
        step has its outcome; expire its approval request once its time has passed.
        Safe to call any number of times, from anywhere."""

        def command(plan: Plan) -> tuple[list[Operation], None]:
            now = self._clock()
            if (
                plan.state is PlanState.AWAITING_APPROVAL
                and plan.approval is not None
                and now >= plan.approval.expires_at
            ):
                plan.expire_approval(now)
            return self._advance(plan), None

        plan, _ = self._update(plan_id, command)
        return self._describe(plan, _shown(plan), local=False)

    def open_ids(self) -> list[str]:
        """Every plan still open (awaiting approval or running), found in the store: a
        scan, for a service's start (the plan follower learns the rest as it goes)."""
        open_ = []
        for plan_id in self._runner.tables.ids_ending(PLAN_ID_SUFFIX):
            try:
                if not self.get(plan_id).state.is_final:
                    open_.append(plan_id)
            except LedgerError:
                _log.warning("plan %s cannot be read", plan_id)
        return open_

    def _update(
        self, plan_id: str, command: Callable[[Plan], tuple[list[Operation], Any]]
    ) -> tuple[Plan, Any]:
        """Run `command` on the stored plan and save it with the operations it built, in
        one append; on a lost race, again on the fresh state."""
        for _ in range(_CONFLICT_RETRIES):
            # The steps it releases count against the budget until saved (or built
            # again, on a lost race).
            with budget_batch(self._budget):
                plan = self.get(plan_id)
                operations, answer = command(plan)
                if not plan.pending_events and not any(op.pending_events for op in operations):
                    return plan, answer
                try:
                    self._runner.save(plan, *operations)
                except IntegrityError:
                    _log.debug("lost a race on %s; retrying", plan_id)
                    for operation in operations:
                        self._runner.forget(operation.id)
                    continue
                return plan, answer
        raise OperationConflict("too many concurrent writers on this plan", operation_id=plan_id)

    # ------------------------------------------------------------------ running

    def _advance(self, plan: Plan, *, cancelled_by: str = "") -> list[Operation]:
        """The plan's next moves, on `plan` (its events pending) and on the operations
        returned (new steps, and running steps asked to stop), none saved."""
        if plan.state is not PlanState.RUNNING:
            return []
        now = self._clock()
        steps = {name: self._runner.get(op_id) for name, op_id in plan.released.items()}
        changed: list[Operation] = []
        if plan.cancel_requested:
            for one in plan.steps:
                if plan.step_state(one["step"]) is StepState.WAITING:
                    plan.skip_step(step=one["step"], reason="the plan was cancelled",
                                   because_of="", now=now)
            for operation in steps.values():
                if operation.state not in TERMINAL_STATES and not operation.cancel_requested:
                    try:
                        operation.request_cancel(
                            by=cancelled_by or "plan", reason=f"plan {plan.id} cancelled",
                            now=now,
                        )
                        changed.append(operation)
                    except IllegalTransition:
                        pass  # it cannot be cancelled now: it ends as it ends
        progress = not plan.cancel_requested
        while progress:
            progress = False
            for one in plan.steps:
                name = one["step"]
                if plan.step_state(name) is not StepState.WAITING:
                    continue
                blocked = self._blocking(plan, one["depends_on"], steps)
                if blocked is not None:
                    plan.skip_step(step=name, reason=blocked[1], because_of=blocked[0], now=now)
                    progress = True
                    continue
                if all(
                    need in steps and steps[need].state is OperationState.SUCCEEDED
                    for need in one["depends_on"]
                ):
                    released = self._release(plan, one, steps)
                    if isinstance(released, str):
                        # It cannot run as planned: skipped, and its dependents after it.
                        plan.skip_step(step=name, reason=released, because_of="", now=now)
                        progress = True
                        continue
                    operation, undone = released
                    plan.release_step(step=name, operation_id=operation.id, now=now)
                    steps[name] = operation
                    changed.append(operation)
                    if undone is not None:
                        changed.append(undone)
                    progress = True
        self._settle_if_done(plan, steps, now)
        return changed

    @staticmethod
    def _blocking(
        plan: Plan, needs: Sequence[str], steps: dict[str, Operation]
    ) -> tuple[str, str] | None:
        """(the step, why) when a dependency will never succeed; None otherwise."""
        for need in needs:
            if need in plan.skipped:
                return need, f"{need} was skipped"
            operation = steps.get(need)
            if operation is None:
                continue
            state = operation.state
            if state in TERMINAL_STATES and state is not OperationState.SUCCEEDED:
                return need, f"{need} ended {state.value}"
        return None

    def _release(
        self, plan: Plan, one: dict[str, Any], steps: dict[str, Operation]
    ) -> tuple[Operation, Operation | None] | str:
        """Build the operation of one step: its references replaced by the values they
        name, checked in full, ready at once where the plan's approval covers it; and,
        for a step that undoes another plan's, that step's operation with its
        `CompensationProposed` (saved in the same append: linked both ways).

        A step that cannot run as planned is not built, and the reason returned: its
        operation ID was taken meanwhile by another call (the host's own proposal, or
        another plan's step: a step never adopts an operation it did not create), or
        what it undoes was undone by another compensation already."""
        arguments = self._resolved(one["arguments"], steps)
        context = plan.caller_context
        local = host_operation_id(one["operation_id"])
        operation_id = one["operation_id"]
        if plan.retries and self._runner.tables.stored_ids([operation_id]):
            # A step that runs again is a new operation: its ID says which run it is.
            local = f"{local}-p{plan.retries}"
            operation_id = ledger_operation_id(plan.host, local)
        if self._runner.tables.stored_ids([operation_id]):
            return f"its operation ID {local} was taken by another call before it was released"
        body = plan.plan
        call = ToolProposal(
            proposal_id=local,
            conversation_id=body["conversation_id"],
            requested_by_user_id=body["requested_by_user_id"],
            tool_name=one["tool"],
            arguments=arguments,
            operation_id=local,
        )
        undone = None
        by = plan.proposed_by or f"host:{plan.host}"
        if one.get("compensates"):
            undone = self._runner.get(one["compensates"])
            earlier = undone.compensated_by
            if earlier is None or earlier == operation_id:
                undone.note_compensation(
                    compensation_id=operation_id, by=by, reason=f"undone by plan {plan.id}",
                    now=self._clock(),
                )
            elif self.plan_of(earlier) == plan.id:
                # A retry of this step: the first run is the compensation the undone
                # call names; this run names what it undoes in its own `Proposed`.
                undone = None
            else:
                return f"{one['compensates']} was undone by {earlier} already"
        operation, _ = self._submissions.step_operation(
            operation_id,
            call,
            context,
            plan.host,
            StepOf(
                plan_id=plan.id,
                step=one["step"],
                approval_id=plan.approval.approval_id if plan.approval is not None else None,
                approvers=tuple(plan.approvers),
                approved_risk=RiskLevel(one["risk"]),
                approved_version=str(one["tool_version"]),
                approval_expires_at=(
                    plan.approval.expires_at if plan.approval is not None else None
                ),
            ),
            compensates=(one["compensates"], by) if one.get("compensates") else None,
        )
        return operation, undone

    def _resolved(self, arguments: Any, steps: dict[str, Operation]) -> Any:
        """`arguments` with every reference replaced by the result field it names (the
        result as kept and bound to its event; a field that is not there is null)."""
        if isinstance(arguments, dict) and set(arguments) == {REFERENCE_KEY}:
            named = arguments[REFERENCE_KEY]
            source = steps[named["step"]]
            data = self._status.result_data(source.id)
            value = resolve_pointer(data, named["pointer"])
            return None if value is MISSING else value
        if isinstance(arguments, dict):
            return {key: self._resolved(value, steps) for key, value in arguments.items()}
        if isinstance(arguments, list):
            return [self._resolved(value, steps) for value in arguments]
        return arguments

    def _settle_if_done(self, plan: Plan, steps: dict[str, Operation], now: datetime) -> None:
        outcomes: dict[str, str] = {}
        for one in plan.steps:
            name = one["step"]
            if name in plan.skipped:
                outcomes[name] = "skipped"
            elif name in steps and steps[name].state in TERMINAL_STATES:
                outcomes[name] = steps[name].state.value
            else:
                return  # still waiting or running
        succeeded = sum(state == OperationState.SUCCEEDED.value for state in outcomes.values())
        if plan.cancel_requested:
            state = PlanState.CANCELLED
        elif succeeded == len(outcomes):
            state = PlanState.SUCCEEDED
        elif succeeded:
            state = PlanState.PARTIALLY_SUCCEEDED
        else:
            state = PlanState.FAILED
        plan.settle(state=state, steps=outcomes, now=now)

    # ----------------------------------------------------------------- helpers

    def plan_of(self, operation_id: str) -> str | None:
        """The plan an operation is a step of (None: a call of its own, or unknown)."""
        try:
            return self._runner.get(operation_id).plan
        except LedgerError:
            return None


_MAX_FINDINGS = 50
"""The most findings a refused plan records (as a refused call's check lists at most 50)."""


def _kept_rejected(body: dict[str, Any]) -> dict[str, Any]:
    """What is stored of a refused plan: all of it when small, else its shape with each
    step's arguments replaced by what was left out (`ledger.retention`)."""
    if len(orjson.dumps(body)) <= KEPT_REJECTED_BYTES:
        return body
    steps = []
    for step in body.get("steps", []):
        _, omitted = kept_arguments(step.get("arguments"), limit=0)
        steps.append({**step, "arguments": None, "arguments_omitted": omitted})
    return {**body, "steps": steps}


def _shown(plan: Plan) -> str:
    """A plan's ID as people and approvers see it: `<host>/<plan id>`."""
    return plan.id.removesuffix(PLAN_ID_SUFFIX)


_RETRYABLE = frozenset(
    state.value
    for state in (
        OperationState.FAILED,
        OperationState.REJECTED,
        OperationState.CANCELLED,
        OperationState.APPROVAL_DENIED,
        OperationState.APPROVAL_EXPIRED,
        OperationState.NEEDS_CLARIFICATION,
    )
)
"""Step states a retry of the plan runs again."""
