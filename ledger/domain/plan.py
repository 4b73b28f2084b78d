"""The Plan aggregate: several tool calls proposed, checked and approved as one unit.

A plan's steps are ordinary operations (`Operation`), each with its own ID,
lease, fencing and reconciliation; the plan holds what binds them: the steps
and their edges as checked (`PlanValidated`, hashed into `plan_hash`), the one
approval of the whole plan, which step was released as which operation, which
were skipped and why, and how the plan ended. Like an operation's, its events
are past-tense classes chained by `prev_hash` and sealed with the rest of the
ledger.

Event names repeat "Plan" where an operation's event has the same word
(`PlanProposed`, not `Proposed`): the relay, the feed and the audit tools
know an event by the last part of its topic, and must never mistake a plan's
for an operation's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from eventsourcing.domain import BaseAggregate

from ledger.domain.approval_rules import (
    Refusal,
    approval_refusal,
    check_approver_name,
    same_person,
)
from ledger.domain.errors import IllegalTransition, InvalidArgument
from ledger.domain.events import ChainedEvent, LedgerCreatedEvent, start_chain
from ledger.domain.hashing import GENESIS_HASH
from ledger.domain.values import Approval, ApprovalGiven
from schemas import RuntimeContext

__all__ = [
    "PLAN_FEED_TOKEN",
    "PLAN_ID_SUFFIX",
    "Plan",
    "PlanState",
    "StepState",
    "is_plan_id",
    "plan_host",
    "plan_ledger_id",
]

PLAN_ID_SUFFIX = "~plan"
"""Appended to a plan's ledger ID: plans and operations share the event store, and a
host may use one local ID for both; `~` is in no operation ID, so they never meet."""


PLAN_FEED_TOKEN = "_plan"
"""The feed's subject token for plan events (`ops.feed._plan.<type>`): where an
operation's events have their tool's name, which never starts with `_`."""


def plan_ledger_id(operation_style_id: str) -> str:
    """The ledger's ID of a plan, from `<host>/<plan id>` (see `PLAN_ID_SUFFIX`)."""
    return f"{operation_style_id}{PLAN_ID_SUFFIX}"


def is_plan_id(aggregate_id: str) -> bool:
    """Whether an aggregate ID in the event store is a plan's (else an operation's)."""
    return aggregate_id.endswith(PLAN_ID_SUFFIX)


def plan_host(plan_id: str) -> str:
    """The host that proposed a plan, from its ledger ID ("" for none)."""
    scoped, _, _ = plan_id.rpartition("/")
    return scoped


class PlanState(StrEnum):
    """Where a plan stands: its own decisions, then what its steps came to."""

    PROPOSED = "proposed"
    REJECTED = "rejected"
    AWAITING_APPROVAL = "awaiting_approval"
    APPROVAL_DENIED = "approval_denied"
    APPROVAL_EXPIRED = "approval_expired"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    PARTIALLY_SUCCEEDED = "partially_succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        """Whether the plan will do nothing more unless a person retries it."""
        return self not in (PlanState.PROPOSED, PlanState.AWAITING_APPROVAL, PlanState.RUNNING)


class StepState(StrEnum):
    """What the plan knows of one step apart from its operation's own state."""

    WAITING = "waiting"
    """Not released: its dependencies have not all succeeded yet (or the plan waits)."""
    RELEASED = "released"
    """Its operation exists; that operation's state says the rest."""
    SKIPPED = "skipped"
    """Never run: a dependency did not succeed, or the plan was cancelled first."""


_SETTLED = frozenset(
    {
        PlanState.SUCCEEDED,
        PlanState.PARTIALLY_SUCCEEDED,
        PlanState.FAILED,
        PlanState.CANCELLED,
    }
)


class Plan(BaseAggregate[str]):
    """A plan of tool calls, keyed by `<host>/<plan id>~plan`."""

    class Event(ChainedEvent):
        """Base of the plan's events: keeps the hash chain as they apply."""

    class PlanProposed(Event, LedgerCreatedEvent):
        """A host proposed a plan. Nothing has been checked yet."""

        plan: dict[str, Any]
        """The plan as the host sent it (`PlanProposal`)."""
        fingerprint: str
        host: str
        actor: str
        tenant: str
        environment: str
        capabilities: list[str]
        proposed_by: str | None = None
        """Who proposed it when not the host: the person who asked to undo another
        plan's steps (`compensates`)."""
        compensates: str | None = None
        """The plan whose succeeded steps this one undoes (a compensation plan)."""
        omitted_when_none = frozenset({"proposed_by", "compensates"})

        def apply(self, aggregate: Any) -> None:
            start_chain(aggregate)
            super().apply(aggregate)

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = PlanState.PROPOSED
            aggregate.plan = self.plan
            aggregate.fingerprint = self.fingerprint
            aggregate.host = self.host
            aggregate.actor = self.actor
            aggregate.tenant = self.tenant
            aggregate.environment = self.environment
            aggregate.capabilities = tuple(self.capabilities)
            aggregate.proposed_by = self.proposed_by
            aggregate.compensates = self.compensates
            aggregate.plan_hash = None
            aggregate.risk = None
            aggregate.steps = ()
            aggregate.issues = []
            aggregate.approval = None
            aggregate.approvals_given = ()
            aggregate.released = {}
            aggregate.skipped = {}
            aggregate.cancel_requested = False
            aggregate.settled_as = None
            aggregate.retries = 0

    class PlanRejected(Event):
        """The plan's check found faults: nothing of it runs."""

        issues: list[dict[str, Any]]

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = PlanState.REJECTED
            aggregate.issues = self.issues

    class PlanValidated(Event):
        """The plan passed its check: the steps as checked, their order, its hash."""

        plan_hash: str
        risk: str
        steps: list[dict[str, Any]]
        """Per step, in the proposal's order: `step`, `operation_id` (the ledger's),
        `tool`, `tool_version`, `arguments` (normalized, references kept),
        `depends_on`, `risk`, `needs_approval`, `proposal_hash`."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.plan_hash = self.plan_hash
            aggregate.risk = self.risk
            aggregate.steps = tuple(self.steps)

    class PlanApprovalRequested(Event):
        """The plan as a whole waits for people: one approval stands for every step."""

        approval_id: str
        effect_preview: dict[str, Any]
        approver_roles: list[str]
        required_approvals: int
        required_from: dict[str, int]
        separation_of_duties: bool
        expires_at: datetime
        reason: str

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = PlanState.AWAITING_APPROVAL
            aggregate.approval = Approval(
                approval_id=self.approval_id,
                effect_preview=self.effect_preview,
                approver_roles=tuple(self.approver_roles),
                required_approvals=self.required_approvals,
                separation_of_duties=self.separation_of_duties,
                expires_at=self.expires_at,
                reason=self.reason,
                required_from=dict(self.required_from),
            )

    class PlanApprovalGranted(Event):
        """One approver approved the plan whose hash they name."""

        approval_id: str
        approver: str
        plan_hash: str
        approver_roles: list[str]
        via: str

        def apply_to(self, aggregate: Any) -> None:
            given = ApprovalGiven(self.approver, frozenset(self.approver_roles), self.via)
            aggregate.approvals_given = (*aggregate.approvals_given, given)

    class PlanApprovalRefused(Event):
        """An approval or denial that did not count, and why (recorded for auditors)."""

        approval_id: str
        approver: str
        plan_hash: str
        reason: str
        decision: str = "approve"
        via: str = ""

    class PlanDenied(Event):
        """An approver denied the plan: none of it runs."""

        approval_id: str
        approver: str
        reason: str
        approver_roles: list[str]
        via: str

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = PlanState.APPROVAL_DENIED

    class PlanExpired(Event):
        """Nobody approved the plan in time: none of it runs."""

        approval_id: str

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = PlanState.APPROVAL_EXPIRED

    class PlanStarted(Event):
        """The plan may run: approved as a whole, or needing no approval."""

        approvers: list[str]

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = PlanState.RUNNING

    class StepReleased(Event):
        """A step's dependencies all succeeded: its operation was proposed."""

        step: str
        operation_id: str

        def apply_to(self, aggregate: Any) -> None:
            aggregate.released = {**aggregate.released, self.step: self.operation_id}

    class StepSkipped(Event):
        """A step will not run: a dependency did not succeed, or the plan was cancelled."""

        step: str
        reason: str
        because_of: str = ""
        """The step whose outcome decided it (empty for a cancellation)."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.skipped = {**aggregate.skipped, self.step: self.reason}

    class PlanCancelRequested(Event):
        """Someone cancelled the plan: what has not started never will."""

        by: str
        reason: str

        def apply_to(self, aggregate: Any) -> None:
            aggregate.cancel_requested = True

    class PlanSettled(Event):
        """Every step has its outcome (or was skipped): how the plan ended."""

        state: str
        steps: dict[str, str]
        """Step -> its outcome (`succeeded`, `failed`, `skipped`, ...)."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = PlanState(self.state)
            aggregate.settled_as = PlanState(self.state)

    class PlanRetried(Event):
        """A person runs the plan's failed and skipped steps again; succeeded ones stay."""

        by: str
        reason: str
        steps: list[str]
        """The steps that run again (released afresh as new operations)."""

        def apply_to(self, aggregate: Any) -> None:
            aggregate.state = PlanState.RUNNING
            aggregate.settled_as = None
            aggregate.retries += 1
            again = set(self.steps)
            aggregate.released = {
                step: op for step, op in aggregate.released.items() if step not in again
            }
            aggregate.skipped = {
                step: why for step, why in aggregate.skipped.items() if step not in again
            }

    # ------------------------------------------------------------ state

    # TYPE_CHECKING: class-level annotations would make the library turn the
    # aggregate into a dataclass with a generated __init__.
    if TYPE_CHECKING:
        state: PlanState
        plan: dict[str, Any]
        fingerprint: str
        host: str
        actor: str
        tenant: str
        environment: str
        capabilities: tuple[str, ...]
        proposed_by: str | None
        compensates: str | None
        plan_hash: str | None
        risk: str | None
        steps: tuple[dict[str, Any], ...]
        issues: list[dict[str, Any]]
        approval: Approval | None
        approvals_given: tuple[ApprovalGiven, ...]
        released: dict[str, str]
        skipped: dict[str, str]
        cancel_requested: bool
        settled_as: PlanState | None
        retries: int
        head_hash: str
        history_bytes: int

    # ------------------------------------------------------------ commands

    @classmethod
    def propose(
        cls,
        plan_id: str,
        *,
        plan: dict[str, Any],
        fingerprint: str,
        host: str,
        actor: str,
        tenant: str,
        environment: str,
        capabilities: Iterable[str],
        now: datetime,
        proposed_by: str | None = None,
        compensates: str | None = None,
    ) -> Plan:
        """Record a new plan under `plan_id` (the ledger's); `proposed_by` and
        `compensates`: the person who proposed it to undo plan `compensates`."""
        return cls._create(
            cls.PlanProposed,
            id=plan_id,
            timestamp=now,
            prev_hash=GENESIS_HASH,
            plan=plan,
            fingerprint=fingerprint,
            host=host,
            actor=actor,
            tenant=tenant,
            environment=environment,
            capabilities=sorted(capabilities),
            proposed_by=proposed_by,
            compensates=compensates,
        )

    def _trigger(self, event_class: type[Event], now: datetime, **kwargs: Any) -> None:
        self.trigger_event(event_class, timestamp=now, prev_hash=self.head_hash, **kwargs)

    def _guard(self, doing: str, *allowed: PlanState) -> None:
        if self.state not in allowed:
            raise IllegalTransition(
                f"cannot {doing} now: the plan is {self.state.value}",
                operation_id=self.id,
                state=self.state.value,
                command=doing,
            )

    def reject(self, *, issues: list[dict[str, Any]], now: datetime) -> None:
        """Record that the plan's check refused it."""
        self._guard("reject the plan", PlanState.PROPOSED)
        self._trigger(self.PlanRejected, now, issues=issues)

    def validate(
        self, *, plan_hash: str, risk: str, steps: list[dict[str, Any]], now: datetime
    ) -> None:
        """Record that the plan passed its check, with its steps as checked."""
        self._guard("validate the plan", PlanState.PROPOSED)
        if self.plan_hash is not None:
            raise IllegalTransition("the plan was validated already", operation_id=self.id)
        self._trigger(self.PlanValidated, now, plan_hash=plan_hash, risk=risk, steps=steps)

    def request_approval(
        self,
        *,
        approval_id: str,
        effect_preview: dict[str, Any],
        approver_roles: list[str],
        required_approvals: int,
        required_from: Mapping[str, int],
        separation_of_duties: bool,
        expires_at: datetime,
        reason: str,
        now: datetime,
    ) -> None:
        """Ask for one approval of exactly this plan."""
        self._guard("ask for approval", PlanState.PROPOSED)
        if self.plan_hash is None:
            raise IllegalTransition("the plan was not validated", operation_id=self.id)
        if required_approvals < 1:
            raise InvalidArgument("required_approvals must be at least 1")
        self._trigger(
            self.PlanApprovalRequested,
            now,
            approval_id=approval_id,
            effect_preview=effect_preview,
            approver_roles=approver_roles,
            required_approvals=required_approvals,
            required_from=dict(required_from),
            separation_of_duties=separation_of_duties,
            expires_at=expires_at,
            reason=reason,
        )

    def start(self, now: datetime) -> None:
        """A validated plan that needs no approval may run."""
        self._guard("start the plan", PlanState.PROPOSED)
        if self.plan_hash is None:
            raise IllegalTransition("the plan was not validated", operation_id=self.id)
        self._trigger(self.PlanStarted, now, approvers=[])

    def grant_approval(
        self,
        *,
        approval_id: str,
        approver: str,
        approver_roles: frozenset[str],
        plan_hash: str,
        now: datetime,
        via: str = "",
    ) -> Refusal | None:
        """Approve the plan whose hash the approver names; returns the refusal reason
        (recorded as an event) when refused. The last approval the request needs
        starts the plan."""
        check_approver_name(approver)
        if self.approval is None:
            raise IllegalTransition(
                f"the plan is {self.state.value}: it asks for no approval",
                operation_id=self.id,
                state=self.state.value,
                command="approve the plan",
            )
        refusal = approval_refusal(
            self.approval,
            approval_id=approval_id,
            approver=approver,
            approver_roles=approver_roles,
            named_hash=plan_hash,
            current_hash=self.plan_hash,
            requester=self.actor,
            given=self.approvals_given,
            open_=self.state is PlanState.AWAITING_APPROVAL,
            now=now,
        )
        if refusal is not None:
            self._trigger(
                self.PlanApprovalRefused,
                now,
                approval_id=approval_id,
                approver=approver,
                plan_hash=plan_hash,
                reason=refusal,
                via=via,
            )
            if refusal == "expired":
                self._trigger(self.PlanExpired, now, approval_id=self.approval.approval_id)
            return refusal
        self._trigger(
            self.PlanApprovalGranted,
            now,
            approval_id=approval_id,
            approver=approver,
            plan_hash=plan_hash,
            approver_roles=sorted(approver_roles & set(self.approval.approver_roles)),
            via=via,
        )
        if self.approval.quorum_met(self.approvals_given):
            self._trigger(
                self.PlanStarted, now, approvers=[one.approver for one in self.approvals_given]
            )
        return None

    def deny_approval(
        self,
        *,
        approval_id: str,
        approver: str,
        approver_roles: frozenset[str],
        reason: str,
        now: datetime,
        via: str = "",
    ) -> Refusal | None:
        """Deny the plan: none of it runs. Only an approver of this request may."""
        check_approver_name(approver)
        self._guard("deny the plan", PlanState.AWAITING_APPROVAL)
        assert self.approval is not None
        if approval_id != self.approval.approval_id:
            raise IllegalTransition("no such approval request", operation_id=self.id)
        if now >= self.approval.expires_at:
            self._trigger(self.PlanExpired, now, approval_id=self.approval.approval_id)
            return Refusal("expired")
        held = approver_roles & set(self.approval.approver_roles)
        if not held:
            refusal = Refusal("not_an_approver")
            self._trigger(
                self.PlanApprovalRefused,
                now,
                approval_id=approval_id,
                approver=approver,
                plan_hash=self.plan_hash or "",
                reason=refusal,
                decision="deny",
                via=via,
            )
            return refusal
        self._trigger(
            self.PlanDenied,
            now,
            approval_id=approval_id,
            approver=approver,
            reason=reason[:500],
            approver_roles=sorted(held),
            via=via,
        )
        return None

    def expire_approval(self, now: datetime) -> None:
        """Expire the approval request, if its time has passed."""
        self._guard("expire the approval", PlanState.AWAITING_APPROVAL)
        assert self.approval is not None
        if now < self.approval.expires_at:
            raise IllegalTransition("the approval has not expired yet", operation_id=self.id)
        self._trigger(self.PlanExpired, now, approval_id=self.approval.approval_id)

    def release_step(self, *, step: str, operation_id: str, now: datetime) -> None:
        """Record that `step` was released as operation `operation_id`."""
        self._guard("release a step", PlanState.RUNNING)
        self._known_step(step)
        if step in self.released or step in self.skipped:
            raise IllegalTransition(f"step {step!r} was released or skipped already",
                                    operation_id=self.id)
        missing = [need for need in self.step(step)["depends_on"] if need not in self.released]
        if missing:
            raise IllegalTransition(
                f"step {step!r} depends on {missing}, not released yet", operation_id=self.id
            )
        self._trigger(self.StepReleased, now, step=step, operation_id=operation_id)

    def skip_step(self, *, step: str, reason: str, because_of: str, now: datetime) -> None:
        """Record that `step` will not run, and why."""
        self._guard("skip a step", PlanState.RUNNING)
        self._known_step(step)
        if step in self.released or step in self.skipped:
            raise IllegalTransition(f"step {step!r} was released or skipped already",
                                    operation_id=self.id)
        self._trigger(self.StepSkipped, now, step=step, reason=reason, because_of=because_of)

    def request_cancel(self, *, by: str, reason: str, now: datetime) -> bool:
        """Cancel the plan: its unreleased steps are skipped, and its running ones are
        asked to stop. Returns False (nothing appended) when it was asked already or
        has ended."""
        if self.state.is_final and self.state not in _SETTLED:
            return False  # never ran: nothing to cancel
        if self.cancel_requested or self.state in _SETTLED:
            return False
        self._guard("cancel the plan", PlanState.PROPOSED, PlanState.AWAITING_APPROVAL,
                    PlanState.RUNNING)
        self._trigger(self.PlanCancelRequested, now, by=by, reason=reason[:500])
        return True

    def settle(self, *, state: PlanState, steps: Mapping[str, str], now: datetime) -> None:
        """Record how the plan ended, once every step has its outcome."""
        self._guard("settle the plan", PlanState.RUNNING)
        if state not in _SETTLED:
            raise InvalidArgument(f"a plan does not end {state.value}")
        unsettled = [
            one["step"] for one in self.steps
            if one["step"] not in self.released and one["step"] not in self.skipped
        ]
        if unsettled:
            raise IllegalTransition(f"steps {unsettled} have no outcome yet",
                                    operation_id=self.id)
        self._trigger(self.PlanSettled, now, state=state.value, steps=dict(steps))

    def retry(self, *, by: str, reason: str, steps: list[str], now: datetime) -> None:
        """Run the failed and skipped `steps` again (never a succeeded one: the caller
        names only steps that did not succeed, and the plan checks they exist)."""
        if self.state not in (PlanState.PARTIALLY_SUCCEEDED, PlanState.FAILED):
            raise IllegalTransition(
                f"only a plan that failed or partially succeeded is retried, not one that is"
                f" {self.state.value}",
                operation_id=self.id,
            )
        if not steps:
            raise IllegalTransition("no step of the plan needs to run again",
                                    operation_id=self.id)
        for step in steps:
            self._known_step(step)
        self._trigger(self.PlanRetried, now, by=by, reason=reason[:500], steps=steps)

    # ------------------------------------------------------------ queries

    def step(self, name: str) -> dict[str, Any]:
        """One step as checked."""
        for one in self.steps:
            if one["step"] == name:
                return one
        raise InvalidArgument(f"no step {name!r} in this plan")

    def _known_step(self, name: str) -> None:
        self.step(name)

    def step_state(self, name: str) -> StepState:
        """Whether a step waits, was released, or was skipped."""
        if name in self.skipped:
            return StepState.SKIPPED
        if name in self.released:
            return StepState.RELEASED
        return StepState.WAITING

    @property
    def approvers(self) -> list[str]:
        """Who approved it, in order."""
        return [one.approver for one in self.approvals_given]

    @property
    def caller_context(self) -> RuntimeContext:
        """The trusted runtime context it was proposed under (its steps run under it)."""
        return RuntimeContext(
            principal=self.actor,
            tenant=self.tenant,
            capabilities=frozenset(self.capabilities),
            environment=self.environment,
        )

    def is_requester(self, name: str) -> bool:
        """Whether `name` is the person the plan was proposed for."""
        return same_person(name) == same_person(self.actor)
