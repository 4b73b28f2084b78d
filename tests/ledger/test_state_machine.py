"""Every (state, command) pair: allowed ones move to the expected state, others append nothing."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ledger import IllegalTransition, Operation, OperationState
from ledger.domain.operation import ALLOWED

S = OperationState
T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
LATER = T0 + timedelta(hours=2)  # past every expiry used below


def proposed() -> Operation:
    return Operation.propose(
        "op-1",
        proposal={"tool_name": "t"},
        fingerprint="f",
        actor="alice",
        tenant="acme",
        environment="test",
        tool="t",
        now=T0,
    )


def _validated() -> Operation:
    op = proposed()
    op.validate(
        tool_version="1.0.0",
        input_schema_hash="i",
        output_schema_hash="o",
        proposal_hash="h",
        arguments={"x": 1},
        applied_defaults=[],
        risk="high",
        risk_reasons=[],
        max_attempts=3,
        retry_on=["TRANSIENT"],
        now=T0,
    )
    return op


def _awaiting() -> Operation:
    op = _validated()
    op.request_approval(
        approval_id="apr-1",
        effect_preview={},
        approver_roles=["approver"],
        required_approvals=1,
        separation_of_duties=True,
        expires_at=T0 + timedelta(minutes=15),
        reason="r",
        now=T0,
    )
    return op


def _ready() -> Operation:
    op = _validated()
    op.mark_ready(T0)
    return op


def _executing() -> Operation:
    op = _ready()
    op.claim_lease(executor="e", ttl=timedelta(seconds=30), now=T0)
    return op


def _with(build: Callable[[], Operation], action: Callable[[Operation], Any]) -> Operation:
    op = build()
    action(op)
    return op


BUILDERS: dict[OperationState, Callable[[], Operation]] = {
    S.PROPOSED: proposed,
    S.NEEDS_CLARIFICATION: lambda: _with(
        proposed,
        lambda op: op.ask_clarification(
            question="Which customer do you mean?",
            issues=[{"code": "TARGET_AMBIGUOUS"}],
            tool_version="1.0.0",
            now=T0,
        ),
    ),
    S.REJECTED: lambda: _with(
        proposed,
        lambda op: op.reject(
            issues=[{"code": "missing"}],
            category="INVALID_INPUT",
            repairable=True,
            tool_version=None,
            now=T0,
        ),
    ),
    S.VALIDATED: _validated,
    S.AWAITING_APPROVAL: _awaiting,
    S.APPROVAL_DENIED: lambda: _with(
        _awaiting,
        lambda op: op.deny_approval(
            approval_id="apr-1", approver="bob", approver_roles=frozenset({"approver"}),
            reason="", now=T0,
        ),
    ),
    S.APPROVAL_EXPIRED: lambda: _with(_awaiting, lambda op: op.expire_approval(LATER)),
    S.READY: _ready,
    S.EXECUTING: _executing,
    S.CANCEL_REQUESTED: lambda: _with(
        _executing, lambda op: op.request_cancel(by="alice", reason="", now=T0)
    ),
    S.SUCCEEDED: lambda: _with(
        _executing,
        lambda op: op.record_result(
            fencing_token=1, executor="e", outcome="succeeded", output_hash="o1", now=T0
        ),
    ),
    S.FAILED: lambda: _with(
        _executing,
        lambda op: op.record_result(
            fencing_token=1,
            executor="e",
            outcome="failed",
            code="UPSTREAM",
            category="TRANSIENT",
            retryable=True,
            now=T0,
        ),
    ),
    S.OUTCOME_UNKNOWN: lambda: _with(_executing, lambda op: op.expire_lease(LATER)),
    S.RECONCILING: lambda: _with(
        lambda: _with(_executing, lambda op: op.expire_lease(LATER)),
        lambda op: op.start_reconciliation(by="ops", now=LATER),
    ),
    S.NEEDS_RESOLUTION: lambda: _with(
        lambda: _with(
            lambda: _with(_executing, lambda op: op.expire_lease(LATER)),
            lambda op: op.start_reconciliation(by="ops", now=LATER),
        ),
        lambda op: op.record_result(
            fencing_token=op.fencing_token, executor="e", outcome="unknown",
            code="RECONCILE_UNSUPPORTED", now=LATER,
        ),
    ),
    S.CANCELLED: lambda: _with(_ready, lambda op: op.request_cancel(by="a", reason="", now=T0)),
}

COMMANDS: dict[str, Callable[[Operation], Any]] = {
    "validate": lambda op: op.validate(
        tool_version="1.0.0",
        input_schema_hash="i",
        output_schema_hash="o",
        proposal_hash="h",
        arguments={},
        applied_defaults=[],
        risk="low",
        risk_reasons=[],
        max_attempts=1,
        retry_on=[],
        now=T0,
    ),
    "reject": lambda op: op.reject(
        issues=[{"code": "x"}],
        category="INVALID_INPUT",
        repairable=False,
        tool_version=None,
        now=T0,
    ),
    "request_approval": lambda op: op.request_approval(
        approval_id="apr-2",
        effect_preview={},
        approver_roles=["approver"],
        required_approvals=1,
        separation_of_duties=True,
        expires_at=LATER,
        reason="r",
        now=T0,
    ),
    "request_preview": lambda op: op.request_preview(T0),
    "mark_ready": lambda op: op.mark_ready(T0),
    "ask_clarification": lambda op: op.ask_clarification(
        question="Which one?", issues=[{"code": "TARGET_AMBIGUOUS"}], tool_version=None, now=T0
    ),
    "note_repair": lambda op: op.note_repair(by="op-2", now=T0),
    "grant_approval": lambda op: op.grant_approval(
        approval_id="apr-1",
        approver="bob",
        approver_roles=frozenset({"approver"}),
        proposal_hash="h",
        now=T0,
    ),
    "deny_approval": lambda op: op.deny_approval(
        approval_id="apr-1", approver="bob", approver_roles=frozenset({"approver"}), reason="",
        now=T0,
    ),
    "expire_approval": lambda op: op.expire_approval(LATER),
    "claim_lease": lambda op: op.claim_lease(executor="e2", ttl=timedelta(seconds=30), now=T0),
    "refuse_execution": lambda op: op.refuse_execution(
        code="permission_changed", reason="contract 1.0.0 no longer in force", now=T0
    ),
    "expire_lease": lambda op: op.expire_lease(LATER),
    "record_result": lambda op: op.record_result(
        fencing_token=op.fencing_token, executor="e", outcome="succeeded", output_hash="o1", now=T0
    ),
    "start_reconciliation": lambda op: op.start_reconciliation(by="ops", now=LATER),
    "reconcile": lambda op: op.reconcile(outcome="succeeded", by="ops", now=LATER),
    "schedule_retry": lambda op: op.schedule_retry(not_before=T0, now=T0),
    "note_retry": lambda op: op.note_retry(
        retry_id="h1/op-1-r1", by="operator:ops", reason="provider fixed", via="nats", now=T0
    ),
    "note_compensation": lambda op: op.note_compensation(
        compensation_id="h1/op-1-c", by="operator:ops", reason="the customer kept it", now=T0
    ),
    "request_cancel": lambda op: op.request_cancel(by="alice", reason="", now=T0),
    "confirm_cancelled": lambda op: op.confirm_cancelled(by="e", now=T0),
    "note_publication_set_aside": lambda op: op.note_publication_set_aside(
        position=7, version=1, reason="not publishable", now=T0
    ),
}

# Where each allowed command leads. Commands that only record (a refused or
# consumed approval, a stale or duplicate result, a late cancel) keep the state.
EXPECTED: dict[tuple[OperationState, str], OperationState] = {
    (S.PROPOSED, "validate"): S.VALIDATED,
    (S.PROPOSED, "reject"): S.REJECTED,
    (S.PROPOSED, "ask_clarification"): S.NEEDS_CLARIFICATION,
    (S.PROPOSED, "request_cancel"): S.CANCELLED,
    (S.REJECTED, "note_repair"): S.REJECTED,  # RepairProposed: a fact, not a state
    (S.VALIDATED, "request_approval"): S.AWAITING_APPROVAL,
    (S.VALIDATED, "mark_ready"): S.READY,
    (S.VALIDATED, "request_cancel"): S.CANCELLED,
    (S.AWAITING_APPROVAL, "grant_approval"): S.READY,
    (S.AWAITING_APPROVAL, "request_preview"): S.AWAITING_APPROVAL,  # a fact, not a state
    (S.AWAITING_APPROVAL, "deny_approval"): S.APPROVAL_DENIED,
    (S.AWAITING_APPROVAL, "expire_approval"): S.APPROVAL_EXPIRED,
    (S.AWAITING_APPROVAL, "request_cancel"): S.CANCELLED,
    (S.READY, "claim_lease"): S.EXECUTING,
    (S.READY, "refuse_execution"): S.REJECTED,
    (S.READY, "record_result"): S.READY,  # token 0: recorded as stale
    (S.READY, "request_cancel"): S.CANCELLED,
    (S.EXECUTING, "expire_lease"): S.OUTCOME_UNKNOWN,
    (S.EXECUTING, "record_result"): S.SUCCEEDED,
    (S.EXECUTING, "request_cancel"): S.CANCEL_REQUESTED,
    (S.CANCEL_REQUESTED, "expire_lease"): S.OUTCOME_UNKNOWN,
    (S.CANCEL_REQUESTED, "record_result"): S.SUCCEEDED,  # with CancelTooLate
    (S.CANCEL_REQUESTED, "request_cancel"): S.CANCEL_REQUESTED,
    (S.CANCEL_REQUESTED, "confirm_cancelled"): S.CANCELLED,
    (S.SUCCEEDED, "record_result"): S.SUCCEEDED,
    (S.SUCCEEDED, "request_cancel"): S.SUCCEEDED,  # CancelTooLate
    (S.SUCCEEDED, "note_compensation"): S.SUCCEEDED,  # the undo is a new operation
    (S.FAILED, "record_result"): S.FAILED,  # a different outcome: recorded, not applied
    (S.FAILED, "schedule_retry"): S.READY,
    (S.FAILED, "note_retry"): S.FAILED,  # the retry is a new operation; this one stands
    (S.FAILED, "request_cancel"): S.FAILED,  # CancelTooLate
    (S.OUTCOME_UNKNOWN, "record_result"): S.SUCCEEDED,  # the late report settles it
    (S.OUTCOME_UNKNOWN, "start_reconciliation"): S.RECONCILING,
    # A lookup whose executor ran out of time is started again (the builder's has no ttl).
    (S.RECONCILING, "start_reconciliation"): S.RECONCILING,
    # A cancel while the outcome is unknown is noted; the lookups go on, and a
    # not-applied outcome is then never retried.
    (S.OUTCOME_UNKNOWN, "request_cancel"): S.OUTCOME_UNKNOWN,
    (S.RECONCILING, "request_cancel"): S.RECONCILING,
    (S.NEEDS_RESOLUTION, "request_cancel"): S.NEEDS_RESOLUTION,
    (S.OUTCOME_UNKNOWN, "reconcile"): S.SUCCEEDED,
    (S.RECONCILING, "record_result"): S.SUCCEEDED,
    (S.RECONCILING, "reconcile"): S.SUCCEEDED,
    (S.NEEDS_RESOLUTION, "record_result"): S.SUCCEEDED,  # a lookup found it after all
    (S.NEEDS_RESOLUTION, "reconcile"): S.SUCCEEDED,  # a person said so
    (S.CANCELLED, "record_result"): S.CANCELLED,
    (S.CANCELLED, "request_cancel"): S.CANCELLED,
}
# grant_approval in states after the approval was consumed: refused and recorded.
for _state in (
    S.READY,
    S.EXECUTING,
    S.CANCEL_REQUESTED,
    S.SUCCEEDED,
    S.FAILED,
    S.OUTCOME_UNKNOWN,
    S.RECONCILING,
    S.NEEDS_RESOLUTION,
):
    EXPECTED[(_state, "grant_approval")] = _state
# The relay's note never changes the state, in any state.
for _state in S:
    EXPECTED[(_state, "note_publication_set_aside")] = _state

PAIRS = [(state, command) for state in S for command in COMMANDS]


def test_every_state_has_a_builder_and_every_command_a_rule() -> None:
    assert set(BUILDERS) == set(S)
    assert set(COMMANDS) == set(ALLOWED)
    assert len(PAIRS) == len(S) * len(COMMANDS) == 16 * 22


@pytest.mark.parametrize(("state", "command"), PAIRS, ids=[f"{s.value}-{c}" for s, c in PAIRS])
def test_state_command_pair(state: OperationState, command: str) -> None:
    build = BUILDERS[state]
    if (
        state
        in (
            S.READY,
            S.EXECUTING,
            S.CANCEL_REQUESTED,
            S.SUCCEEDED,
            S.FAILED,
            S.OUTCOME_UNKNOWN,
            S.RECONCILING,
            S.NEEDS_RESOLUTION,
        )
        and command == "grant_approval"
    ):
        # These states must come from an approved operation for this pair to mean anything.
        build = _approved_variant(state)
    operation = build()
    assert operation.state is state
    operation.collect_events()
    version = operation.version
    expected = EXPECTED.get((state, command))
    if expected is None:
        with pytest.raises(IllegalTransition):
            COMMANDS[command](operation)
        assert operation.collect_events() == []
        assert operation.version == version
        assert operation.state is state
    else:
        COMMANDS[command](operation)
        assert operation.state is expected


def _approved_variant(state: OperationState) -> Callable[[], Operation]:
    def approved_ready() -> Operation:
        op = _awaiting()
        op.grant_approval(
            approval_id="apr-1",
            approver="bob",
            approver_roles=frozenset({"approver"}),
            proposal_hash="h",
            now=T0,
        )
        return op

    def build() -> Operation:
        op = approved_ready()
        if state is S.READY:
            return op
        op.claim_lease(executor="e", ttl=timedelta(seconds=30), now=T0)
        follow: dict[OperationState, Callable[[Operation], Any]] = {
            S.EXECUTING: lambda o: None,
            S.CANCEL_REQUESTED: lambda o: o.request_cancel(by="a", reason="", now=T0),
            S.SUCCEEDED: lambda o: o.record_result(
                fencing_token=1, executor="e", outcome="succeeded", now=T0
            ),
            S.FAILED: lambda o: o.record_result(
                fencing_token=1,
                executor="e",
                outcome="failed",
                code="X",
                category="INTERNAL",
                now=T0,
            ),
            S.OUTCOME_UNKNOWN: lambda o: o.expire_lease(LATER),
            # Two steps in one lambda: a tuple of their (None) results.
            S.RECONCILING: lambda o: (
                o.expire_lease(LATER),  # type: ignore[func-returns-value]
                o.start_reconciliation(by="ops", now=LATER),  # type: ignore[func-returns-value]
            ),
            S.NEEDS_RESOLUTION: lambda o: (
                o.expire_lease(LATER),  # type: ignore[func-returns-value]
                o.start_reconciliation(by="ops", now=LATER),  # type: ignore[func-returns-value]
                o.record_result(
                    fencing_token=1, executor="e", outcome="unknown",
                    code="RECONCILE_UNSUPPORTED", now=LATER,
                ),
            ),
        }
        follow[state](op)
        return op

    return build


def test_allowed_table_matches_the_expectations() -> None:
    # ALLOWED is the aggregate's guard; EXPECTED is this test's independent statement.
    for state, command in PAIRS:
        assert ((state, command) in EXPECTED) == (state in ALLOWED[command]), (state, command)
