"""The Operation aggregate's rules: approvals bound to hashes, fencing, convergence, hashes."""

from __future__ import annotations

import dataclasses
import itertools
from datetime import timedelta
from typing import Any, cast

import pytest

from ledger import IllegalTransition, Operation, OperationState, ResultDisposition, TamperDetected
from ledger.domain.events import LedgerEvent
from ledger.errors import InvalidArgument
from tests.ledger.test_state_machine import T0, _awaiting, _executing, _ready

S = OperationState
APPROVER = frozenset({"approver"})


def _types(operation: Operation) -> list[str]:
    return [type(event).__name__ for event in operation.collect_events()]


def _two_person() -> Operation:
    op = _awaiting()
    assert op.approval is not None
    # As if requested with a two-person policy.
    op.approval = dataclasses.replace(op.approval, required_approvals=2)
    op.collect_events()
    return op


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"proposal_hash": "other"}, "proposal_hash_mismatch"),
        ({"approver": "alice"}, "requester_cannot_approve"),
        ({"approver_roles": frozenset({"viewer"})}, "not_an_approver"),
        ({"approval_id": "apr-forged"}, "unknown_approval"),
    ],
)
def test_refused_approvals_are_recorded_and_change_nothing(
    kwargs: dict[str, Any], reason: str
) -> None:
    op = _awaiting()
    op.collect_events()
    arguments: dict[str, Any] = {
        "approval_id": "apr-1",
        "approver": "bob",
        "approver_roles": APPROVER,
        "proposal_hash": "h",
        "now": T0,
    } | kwargs
    assert op.grant_approval(**arguments) == reason
    events = op.collect_events()
    assert [type(e).__name__ for e in events] == ["ApprovalRefused"]
    assert events[0].reason == reason  # type: ignore[attr-defined]
    assert op.state is S.AWAITING_APPROVAL
    assert op.approvers == []


def test_expired_approval_is_refused_and_expires_the_operation() -> None:
    op = _awaiting()
    op.collect_events()
    refusal = op.grant_approval(
        approval_id="apr-1",
        approver="bob",
        approver_roles=APPROVER,
        proposal_hash="h",
        now=T0 + timedelta(minutes=16),
    )
    assert refusal == "expired"
    assert _types(op) == ["ApprovalRefused", "ApprovalExpired"]
    assert op.state is S.APPROVAL_EXPIRED


def test_a_consumed_approval_cannot_be_used_again() -> None:
    op = _awaiting()
    assert (
        op.grant_approval(
            approval_id="apr-1", approver="bob", approver_roles=APPROVER, proposal_hash="h", now=T0
        )
        is None
    )
    assert op.state is S.READY
    op.collect_events()
    again = op.grant_approval(
        approval_id="apr-1", approver="carol", approver_roles=APPROVER, proposal_hash="h", now=T0
    )
    assert again == "approval_consumed"
    assert _types(op) == ["ApprovalRefused"]
    assert op.state is S.READY


def test_two_person_policy_needs_two_distinct_approvers() -> None:
    op = _two_person()
    grant: dict[str, Any] = {
        "approval_id": "apr-1", "approver_roles": APPROVER, "proposal_hash": "h", "now": T0
    }
    assert op.grant_approval(approver="bob", **grant) is None
    assert op.state is S.AWAITING_APPROVAL
    assert op.grant_approval(approver="bob", **grant) == "duplicate_approver"
    assert op.state is S.AWAITING_APPROVAL
    assert op.grant_approval(approver="carol", **grant) is None
    assert cast(S, op.state) is S.READY
    assert op.approvers == ["bob", "carol"]


def _m_of_n(required: int, shares: dict[str, int], roles: tuple[str, ...]) -> Operation:
    op = _awaiting()
    assert op.approval is not None
    op.approval = dataclasses.replace(
        op.approval, required_approvals=required, required_from=shares, approver_roles=roles
    )
    op.collect_events()
    return op


def _grant(op: Operation, approver: str, *roles: str) -> str | None:
    return op.grant_approval(
        approval_id="apr-1", approver=approver, approver_roles=frozenset(roles),
        proposal_hash="h", now=T0, via="nats",
    )


def test_three_of_n_runs_only_on_the_third_distinct_approver() -> None:
    op = _m_of_n(3, {}, ("lead",))
    assert _grant(op, "bob", "lead") is None
    assert _grant(op, "carol", "lead") is None
    assert op.state is S.AWAITING_APPROVAL
    assert _grant(op, "carol", "lead") == "duplicate_approver"
    assert op.state is S.AWAITING_APPROVAL
    assert _grant(op, "dave", "lead") is None
    assert cast(S, op.state) is S.READY
    granted = [e for e in op.collect_events() if type(e).__name__ == "ApprovalGranted"]
    assert [(e.approver, e.approver_roles, e.via) for e in granted] == [  # type: ignore[attr-defined]
        ("bob", ["lead"], "nats"), ("carol", ["lead"], "nats"), ("dave", ["lead"], "nats")
    ]


def test_named_roles_are_filled_by_distinct_people() -> None:
    """Three approvers, one of them from compliance and one from finance: a person who
    holds both roles counts for one of them only."""
    op = _m_of_n(3, {"compliance": 1, "finance": 1}, ("lead", "compliance", "finance"))
    assert _grant(op, "both", "compliance", "finance") is None
    assert _grant(op, "bob", "lead") is None
    assert _grant(op, "carol", "lead") is None
    # Three people, but compliance and finance rest on one: not yet.
    assert op.state is S.AWAITING_APPROVAL
    assert _grant(op, "fin", "finance") is None
    assert cast(S, op.state) is S.READY  # `both` fills compliance, `fin` finance


def test_a_role_share_can_be_filled_by_reassigning_who_counts_for_what() -> None:
    # The first approver holds both roles and is first matched to compliance; the
    # second holds compliance only, so the first must move to finance.
    op = _m_of_n(2, {"compliance": 1, "finance": 1}, ("compliance", "finance"))
    assert _grant(op, "both", "compliance", "finance") is None
    assert _grant(op, "comp", "compliance") is None
    assert op.state is S.READY


def test_deny_by_someone_without_an_approver_role_is_refused_and_recorded() -> None:
    op = _awaiting()
    op.collect_events()
    refusal = op.deny_approval(
        approval_id="apr-1", approver="mallory", approver_roles=frozenset({"viewer"}),
        reason="no", now=T0, via="nats",
    )
    assert refusal == "not_an_approver"
    (event,) = op.collect_events()
    assert (type(event).__name__, event.decision, event.approver) == (  # type: ignore[attr-defined]
        "ApprovalRefused", "deny", "mallory"
    )
    assert op.state is S.AWAITING_APPROVAL
    assert op.deny_approval(
        approval_id="apr-1", approver="bob", approver_roles=APPROVER, reason="no", now=T0
    ) is None
    assert cast(S, op.state) is S.APPROVAL_DENIED


@pytest.mark.parametrize("spelling", ["Alice", "ALICE", " alice", "alice ", "aLiCe"])
def test_the_requester_cannot_approve_under_another_spelling(spelling: str) -> None:
    op = _awaiting()  # requested by alice, separation of duties on
    assert _grant(op, spelling, "approver") == "requester_cannot_approve"
    assert op.state is S.AWAITING_APPROVAL


def test_one_person_under_two_spellings_is_one_approver() -> None:
    """fin-1 over NATS, FIN-1 on the page: one person, who counts once."""
    op = _m_of_n(2, {}, ("finance",))
    assert _grant(op, "fin-1", "finance") is None
    assert _grant(op, " FIN-1", "finance") == "duplicate_approver"
    assert op.state is S.AWAITING_APPROVAL
    assert _grant(op, "fin-2", "finance") is None
    assert cast(S, op.state) is S.READY


@pytest.mark.parametrize("name", ["", "   "])
def test_a_decision_without_a_name_is_not_taken(name: str) -> None:
    op = _awaiting()
    op.collect_events()
    with pytest.raises(InvalidArgument):
        _grant(op, name, "approver")
    with pytest.raises(InvalidArgument):
        op.deny_approval(approval_id="apr-1", approver=name, approver_roles=APPROVER,
                         reason="", now=T0)
    assert op.collect_events() == []


def test_a_denial_after_the_approval_expired_expires_it() -> None:
    op = _awaiting()
    op.collect_events()
    refusal = op.deny_approval(
        approval_id="apr-1", approver="bob", approver_roles=APPROVER, reason="late",
        now=T0 + timedelta(hours=1),
    )
    assert refusal == "expired"
    assert _types(op) == ["ApprovalExpired"]
    assert op.state is S.APPROVAL_EXPIRED


def test_what_a_request_still_waits_for_names_the_missing_role() -> None:
    op = _m_of_n(3, {"compliance": 1}, ("lead", "compliance"))
    assert op.approval is not None
    for name in ("a", "b", "c"):
        assert op.approval.still_needed(op.approvals_given) in (
            f"{3 - len(op.approvals_given)} more approver(s)",
        )
        assert _grant(op, name, "lead") is None
    assert op.approval.still_needed(op.approvals_given) == "an approver holding compliance"


def test_a_refused_command_says_why_in_words_and_where_to_look() -> None:
    """Before: `cannot deny approval an operation that is succeeded`."""
    op = _ready()
    with pytest.raises(IllegalTransition) as caught:
        op.deny_approval(approval_id="apr-1", approver="bob", approver_roles=APPROVER,
                         reason="", now=T0)
    assert caught.value.message == (
        "cannot deny the approval now: the operation is ready (it is still under way);"
        " `opledger ops show` says what happened"
    )


def test_each_claim_gets_a_larger_fencing_token_and_history_keeps_every_lease() -> None:
    op = _executing()
    assert op.fencing_token == 1
    op.record_result(
        fencing_token=1,
        executor="e",
        outcome="failed",
        code="TIMEOUT",
        category="TRANSIENT",
        retryable=True,
        now=T0,
    )
    op.schedule_retry(not_before=T0, now=T0)
    token = op.claim_lease(executor="e2", ttl=timedelta(seconds=30), now=T0)
    assert token == 2
    assert op.attempt == 2
    assert [lease.fencing_token for lease in op.leases] == [1, 2]
    assert [lease.executor for lease in op.leases] == ["e", "e2"]


def test_a_stale_executor_result_is_recorded_and_changes_nothing() -> None:
    op = _executing()
    op.record_result(
        fencing_token=1,
        executor="e",
        outcome="failed",
        code="TIMEOUT",
        category="TRANSIENT",
        retryable=True,
        now=T0,
    )
    op.schedule_retry(not_before=T0, now=T0)
    op.claim_lease(executor="e2", ttl=timedelta(seconds=30), now=T0)
    op.collect_events()
    stale = op.record_result(
        fencing_token=1, executor="e", outcome="succeeded", output_hash="x", now=T0
    )
    assert stale is ResultDisposition.STALE
    assert _types(op) == ["StaleResultRecorded"]
    assert op.state is S.EXECUTING


def test_the_same_result_twice_converges_and_a_different_one_is_only_recorded() -> None:
    op = _executing()
    first = op.record_result(
        fencing_token=1, executor="e", outcome="succeeded", output_hash="out-1", now=T0
    )
    assert first is ResultDisposition.ACCEPTED
    op.collect_events()
    again = op.record_result(
        fencing_token=1, executor="e", outcome="succeeded", output_hash="out-1", now=T0
    )
    assert again is ResultDisposition.DUPLICATE
    assert op.collect_events() == []
    other = op.record_result(
        fencing_token=1, executor="e", outcome="failed", code="X", category="INTERNAL", now=T0
    )
    assert other is ResultDisposition.CONFLICTING
    assert _types(op) == ["ConflictingOutcomeRecorded"]
    assert op.state is S.SUCCEEDED
    assert op.outcome is not None
    assert op.outcome is not None
    assert op.outcome.output_hash == "out-1"


def test_retry_needs_a_retryable_category_and_attempts_left() -> None:
    op = _executing()
    op.record_result(
        fencing_token=1,
        executor="e",
        outcome="failed",
        code="BAD",
        category="INVALID_INPUT",
        retryable=False,
        now=T0,
    )
    with pytest.raises(IllegalTransition):
        op.schedule_retry(not_before=T0, now=T0)
    op = _executing()  # max_attempts is 3 in these fixtures
    for token in (1, 2, 3):
        op.record_result(
            fencing_token=token,
            executor="e",
            outcome="failed",
            code="TIMEOUT",
            category="TRANSIENT",
            retryable=True,
            now=T0,
        )
        if token < 3:
            op.schedule_retry(not_before=T0, now=T0)
            op.claim_lease(executor="e", ttl=timedelta(seconds=30), now=T0)
    assert not op.can_retry
    with pytest.raises(IllegalTransition):
        op.schedule_retry(not_before=T0, now=T0)


def test_cancel_while_running_then_success_is_too_late() -> None:
    op = _executing()
    op.request_cancel(by="alice", reason="changed my mind", now=T0)
    assert op.state is S.CANCEL_REQUESTED
    op.collect_events()
    op.record_result(fencing_token=1, executor="e", outcome="succeeded", output_hash="o", now=T0)
    assert _types(op) == ["CancelTooLate", "Succeeded"]
    assert cast(S, op.state) is S.SUCCEEDED


def test_cancel_before_running_is_immediate() -> None:
    op = _ready()
    op.collect_events()
    op.request_cancel(by="alice", reason="", now=T0)
    assert _types(op) == ["CancelRequested", "Cancelled"]
    with pytest.raises(IllegalTransition):
        op.claim_lease(executor="e", ttl=timedelta(seconds=5), now=T0)


def test_lease_cannot_expire_early() -> None:
    op = _executing()
    with pytest.raises(IllegalTransition):
        op.expire_lease(T0 + timedelta(seconds=29))
    op.expire_lease(T0 + timedelta(seconds=30))
    assert op.state is S.OUTCOME_UNKNOWN


def test_events_chain_by_hash_and_replay_detects_a_broken_link() -> None:
    op = _executing()
    events = cast("list[LedgerEvent]", op.collect_events())
    assert events[0].prev_hash == "0" * 64
    for before, after in itertools.pairwise(events):
        from ledger.domain.events import event_hash

        assert after.prev_hash == event_hash(before)
    rebuilt = None
    for event in events:
        rebuilt = event.mutate(rebuilt)
    assert rebuilt is not None
    assert rebuilt.head_hash == op.head_hash
    forged = events[2].model_copy(update={"prev_hash": "f" * 64})
    rebuilt = None
    with pytest.raises(TamperDetected):
        for event in [*events[:2], forged]:
            rebuilt = event.mutate(rebuilt)


def test_an_inconclusive_reconciliation_is_recorded_and_leaves_the_outcome_unknown() -> None:
    op = _executing()
    op.expire_lease(T0 + timedelta(seconds=30))
    op.start_reconciliation(by="exec-2", now=T0 + timedelta(seconds=31))
    op.collect_events()
    disposition = op.record_result(fencing_token=1, executor="exec-2", outcome="unknown",
                                   reason="provider cannot tell", now=T0 + timedelta(seconds=32))
    assert disposition is ResultDisposition.ACCEPTED
    assert _types(op) == ["ReconciliationInconclusive"]
    assert op.state is S.OUTCOME_UNKNOWN
    # It can be reconciled again later, by a person or a new attempt.
    op.start_reconciliation(by="operator", now=T0 + timedelta(seconds=60))
    op.reconcile(outcome="failed", by="operator", code="NOT_APPLIED", category="TRANSIENT",
                 retryable=True, now=T0 + timedelta(seconds=61))
    assert cast(S, op.state) is S.FAILED


def _failed(op: Operation, retryable: bool = False) -> Operation:
    op.record_result(
        fencing_token=op.fencing_token,
        executor="e",
        outcome="failed",
        code="PROVIDER_DOWN" if retryable else "BAD",
        category="TRANSIENT" if retryable else "INVALID_INPUT",
        retryable=retryable,
        now=T0,
    )
    return op


def _retry(op: Operation, reason: str = "the template was fixed") -> None:
    op.note_retry(retry_id=f"{op.id}-r1", by="operator:ops-lead", reason=reason, via="nats",
                  now=T0)


def test_a_retry_is_noted_on_the_failed_call_which_keeps_its_outcome() -> None:
    op = _failed(_executing())  # a failure the policy never retries
    assert not op.can_retry
    op.collect_events()
    _retry(op)
    (event,) = op.collect_events()
    assert type(event).__name__ == "RetryProposed"
    assert (event.retry_id, event.by, event.via) == (  # type: ignore[attr-defined]
        f"{op.id}-r1", "operator:ops-lead", "nats"
    )
    # Announced as final, and final it stays: the retry runs as the new operation.
    assert op.state is S.FAILED and op.retried_as == f"{op.id}-r1"
    with pytest.raises(IllegalTransition, match="already run again"):
        _retry(op)


def test_a_cancelled_call_is_never_retried() -> None:
    op = _failed(_executing(), retryable=True)
    op.request_cancel(by="alice", reason="", now=T0)  # after the failure: too late, noted
    with pytest.raises(IllegalTransition, match="cancelled"):
        _retry(op)
    assert op.retried_as is None


def test_a_retry_needs_a_reason_and_a_failure() -> None:
    op = _failed(_executing())
    with pytest.raises(InvalidArgument):
        _retry(op, reason="  ")
    with pytest.raises(InvalidArgument):
        _retry(op, reason="x" * 501)
    with pytest.raises(IllegalTransition):
        _retry(_ready())  # nothing failed


def test_a_success_reported_after_all_refuses_the_retry() -> None:
    # The lease ran out, a person said it never happened, then the hung call's
    # success arrived: evidence the effect exists. Running it again would repeat it.
    op = _executing()
    op.expire_lease(now=T0 + timedelta(minutes=5))
    op.reconcile(outcome="failed", by="operator:o", reason="no record", code="NOT_APPLIED",
                 category="TRANSIENT", retryable=False, now=T0 + timedelta(minutes=6))
    assert op.state is S.FAILED
    op.record_result(fencing_token=op.fencing_token, executor="e", outcome="succeeded",
                     output_hash="x", now=T0 + timedelta(minutes=7))
    assert op.state is S.FAILED and op.success_reported_late
    with pytest.raises(IllegalTransition, match="succeeded after all"):
        _retry(op)


def test_fields_a_later_release_added_are_left_out_while_empty() -> None:
    """An upgrade can be rolled back: the release before the trace and retry fields
    reads a proposal stored without them exactly as before."""
    import orjson

    from ledger.domain.events import encoded_event

    plain = Operation.propose(
        "h1/op-p", proposal={}, fingerprint="f", actor="a", tenant="t", environment="e",
        tool="search_documents", now=T0,
    )
    proposed = cast(Operation.Proposed, plain.collect_events()[0])
    stored = orjson.loads(encoded_event(proposed))
    assert not {"trace_parent", "retries", "proposed_by"} & stored.keys()
    assert stored["repairs"] is None  # a field of the earlier releases stays as it was
    # As the earlier release's model would: no field it does not know.
    earlier = set(type(proposed).model_fields) - {
        "trace_parent", "retries", "proposed_by"
    }
    assert stored.keys() <= earlier
    traced = Operation.propose(
        "h1/op-t", proposal={}, fingerprint="f", actor="a", tenant="t", environment="e",
        tool="search_documents", now=T0,
        trace_parent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    first = cast(Operation.Proposed, traced.collect_events()[0])
    assert orjson.loads(encoded_event(first))["trace_parent"].startswith("00-0af7")
