"""The ledger's contract suite: every test runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import io
import sqlite3
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import orjson
import pytest

from ledger import (
    ApprovalRefused,
    FindingKind,
    Ledger,
    LedgerError,
    OperationConflict,
    OperationNotFound,
    OperationState,
    ResultDisposition,
    StorageConfig,
    Submission,
)
from ledger.adapters.results import ResultStore
from ledger.domain.errors import InvalidArgument
from ledger.service import _sweeps as sweeps_module
from policy import ContractRegistry
from policy.catalog import CATALOG_DIR
from schemas import (
    DecisionOutcome,
    ErrorCategory,
    ErrorInfo,
    LeaseDecision,
    PreviewReport,
    ToolProposal,
)
from tests.ledger.helpers import (
    ALICE,
    EMAIL_PREVIEW,
    NO_HITS,
    email,
    event_types,
    make_ledger,
    previewed,
    proposal,
    registry_with_limit,
    result,
    search,
)

S = OperationState


@pytest.fixture
def ledger(storage: StorageConfig) -> Ledger:
    return make_ledger(storage)


def _succeed(ledger: Ledger, operation_id: str) -> None:
    grant = ledger.lease(operation_id, executor="exec-1")
    ledger.record_result(result(operation_id, grant.fencing_token, data=NO_HITS))


def test_happy_path_records_every_step(ledger: Ledger) -> None:
    submission = ledger.submit(search("op-1"), ALICE)
    assert submission.created
    assert submission.state is S.READY
    assert submission.decision is not None
    assert submission.decision.outcome is DecisionOutcome.READY
    _succeed(ledger, "op-1")
    assert ledger.get("op-1").state is S.SUCCEEDED
    assert event_types(ledger, "op-1") == [
        "Proposed", "Validated", "Readied", "LeaseClaimed", "Succeeded"
    ]


def test_same_id_and_call_returns_the_existing_operation(ledger: Ledger) -> None:
    ledger.submit(search("op-1"), ALICE)
    _succeed(ledger, "op-1")
    again = ledger.submit(search("op-1"), ALICE)
    assert (again.created, again.state, again.decision) == (False, S.SUCCEEDED, None)
    assert len(ledger.history("op-1")) == 5


def test_same_id_with_other_arguments_is_a_conflict_and_appends_nothing(ledger: Ledger) -> None:
    ledger.submit(search("op-1"), ALICE)
    with pytest.raises(OperationConflict) as caught:
        ledger.submit(search("op-1", query="something else"), ALICE)
    assert caught.value.to_info().category.value == "CONFLICT"
    assert len(ledger.history("op-1")) == 3


@pytest.mark.parametrize(
    "resent",
    [
        {"query": "refund policy", "top_k": 3},  # an object instead of text
        '{"top_k":3,"query":"refund policy"}',  # other key order, no spaces
        '  {\n  "query" : "refund policy",\n  "top_k" : 3.0 }  ',  # whitespace, 3.0 for 3
    ],
)
def test_a_retry_counts_by_its_arguments_meaning_not_their_bytes(
    ledger: Ledger, resent: Any
) -> None:
    """A host in another language resends the call: the same arguments, written as its
    JSON library writes them. Before: OPERATION_CONFLICT unless byte for byte."""
    first = ledger.submit(
        proposal("search_documents", '{"query": "refund policy", "top_k": 3}',
                 operation_id="op-1"), ALICE)
    again = ledger.submit(proposal("search_documents", resent, operation_id="op-1"), ALICE)
    assert (again.created, again.state) == (False, first.state)
    assert len(ledger.history("op-1")) == 3
    with pytest.raises(OperationConflict):  # what the call does still decides
        ledger.submit(proposal("search_documents", '{"query": "refund policy", "top_k": 4}',
                               operation_id="op-1"), ALICE)


def test_a_retry_of_an_operation_stored_before_fingerprints_were_canonical_matches(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ledger.service import _submission

    call = proposal("search_documents", '{"query": "refund policy",  "top_k": 3}',
                    operation_id="op-old")
    with monkeypatch.context() as before:  # stored by a ledger from before: bytes as sent
        before.setattr(_submission, "fingerprint", _submission._legacy_fingerprint)
        ledger.submit(call, ALICE)
    assert ledger.get("op-old").fingerprint == _submission._legacy_fingerprint(call, ALICE, "")
    again = ledger.submit(call, ALICE)
    assert again.created is False
    assert len(ledger.history("op-old")) == 3


def test_a_conflict_in_a_batch_refuses_that_item_alone(ledger: Ledger) -> None:
    ledger.submit(search("op-1"), ALICE)
    answers = ledger.submit_many(
        [(search("op-2"), ALICE), (search("op-1", query="other"), ALICE), (search("op-3"), ALICE)]
    )
    assert isinstance(answers[1], OperationConflict)
    assert [
        cast(Submission, a).state for a in answers if not isinstance(a, OperationConflict)
    ] == [S.READY] * 2
    assert len(ledger.history("op-1")) == 3  # the conflicting call appended nothing
    assert ledger.get("op-2").state is ledger.get("op-3").state is S.READY


def test_rejections_are_recorded_with_their_reasons(ledger: Ledger) -> None:
    submission = ledger.submit(proposal("search_documents", '{"top_k": 3', operation_id="bad"),
                               ALICE)
    assert submission.state is S.REJECTED
    operation = ledger.get("bad")
    assert operation.issues[0]["code"] == "json_syntax"
    assert event_types(ledger, "bad") == ["Proposed", "Rejected"]


def test_approval_is_bound_to_the_proposal_hash(ledger: Ledger) -> None:
    submission = ledger.submit(email("mail-1"), ALICE)
    assert submission.state is S.AWAITING_APPROVAL
    operation = ledger.get("mail-1")
    assert operation.approval is not None
    preview = operation.approval.effect_preview
    assert preview["arguments"]["recipient_ids"] == ["cus-0001"]
    assert preview["reversible"] is False
    shown = previewed(ledger, "mail-1")
    with pytest.raises(ApprovalRefused, match="proposal_hash_mismatch"):
        ledger.approve("mail-1", approver="lead", approver_roles=["support_lead"],
                       proposal_hash="0" * 64, preview_hash=shown)
    with pytest.raises(ApprovalRefused, match="requester_cannot_approve"):
        ledger.approve("mail-1", approver="alice", approver_roles=["support_lead"],
                       proposal_hash=preview["proposal_hash"], preview_hash=shown)
    ledger.approve("mail-1", approver="lead", approver_roles=["support_lead"],
                   proposal_hash=preview["proposal_hash"], preview_hash=shown)
    assert ledger.get("mail-1").state is S.READY
    with pytest.raises(ApprovalRefused, match="approval_consumed"):
        ledger.approve("mail-1", approver="lead2", approver_roles=["support_lead"],
                       proposal_hash=preview["proposal_hash"], preview_hash=shown)
    assert event_types(ledger, "mail-1").count("ApprovalRefused") == 3


def test_a_previewed_call_is_approved_only_for_the_preview_shown(ledger: Ledger) -> None:
    """Before: an approver approved a template name and customer IDs. Now the contract's
    preview comes first, the approval names its digest, and the lease hands it on."""
    ledger.submit(email("mail-p"), ALICE)
    operation = ledger.get("mail-p")
    assert operation.preview_requested and operation.preview_hash is None
    proposal_hash = operation.proposal_hash
    assert proposal_hash is not None
    lead: dict[str, Any] = {"approver": "lead", "approver_roles": ["support_lead"]}
    # Nothing to approve yet: the approver has not seen what the call would do.
    with pytest.raises(ApprovalRefused, match="preview_pending"):
        ledger.approve("mail-p", proposal_hash=proposal_hash, **lead)
    version = ledger.get("mail-p").version
    asked = ledger.lease("mail-p", executor="exec-p", tool="send_customer_email")
    assert asked.decision is LeaseDecision.PREVIEW
    assert asked.arguments == operation.arguments and asked.fencing_token is None
    assert asked.context is not None and asked.context.tenant == "acme"
    assert ledger.get("mail-p").version == version  # nothing appended
    # Another tool's executor learns nothing of it.
    with pytest.raises(OperationNotFound):
        ledger.leasing.record_preview("mail-p", tool="search_documents", executor="x",
                                      report=EMAIL_PREVIEW)
    shown = previewed(ledger, "mail-p")
    # A second preview (another executor, a redelivery) never replaces the first.
    other = PreviewReport(effect={"summary": "send 1 e-mail(s) to someone else"})
    answer = ledger.leasing.record_preview("mail-p", tool="send_customer_email",
                                           executor="exec-q", report=other)
    assert answer.decision is LeaseDecision.DONE
    assert ledger.get("mail-p").preview_hash == shown == EMAIL_PREVIEW.digest()
    assert event_types(ledger, "mail-p").count("PreviewRecorded") == 1
    # An approval of another preview, or of none, is refused and recorded.
    for wrong in (other.digest(), None):
        with pytest.raises(ApprovalRefused, match="preview_hash_mismatch"):
            ledger.approve("mail-p", proposal_hash=proposal_hash, preview_hash=wrong, **lead)
    ledger.approve("mail-p", proposal_hash=proposal_hash, preview_hash=shown, **lead)
    granted = [e for e in ledger.history("mail-p") if type(e).__name__ == "ApprovalGranted"]
    assert [e.preview_hash for e in granted] == [shown]
    lease = ledger.lease("mail-p", executor="exec-1", tool="send_customer_email")
    assert lease.decision is LeaseDecision.EXECUTE and lease.preview_hash == shown
    # Once decided, a preview changes nothing.
    ledger.leasing.record_preview("mail-p", tool=None, executor="exec-q", report=other)
    assert ledger.get("mail-p").preview_hash == shown


def test_a_call_the_tool_could_not_preview_cannot_be_approved(ledger: Ledger) -> None:
    """Before: the digest of a failed preview was approvable, and the same failure at the
    run matched it. Now there is no effect to approve: refused, and deniable."""
    ledger.submit(email("mail-f"), ALICE)
    proposal_hash = ledger.get("mail-f").proposal_hash or ""
    failed = PreviewReport(error=ErrorInfo(
        code="PREVIEW_UNSUPPORTED", category=ErrorCategory.INTERNAL, message="no preview"
    ))
    shown = previewed(ledger, "mail-f", failed)
    # Someone without the role learns nothing of the preview: the role is checked first.
    with pytest.raises(ApprovalRefused, match="not_an_approver"):
        ledger.approve("mail-f", approver="eve", approver_roles=["data_steward"],
                       proposal_hash=proposal_hash, preview_hash="0" * 64)
    with pytest.raises(ApprovalRefused, match="preview_failed"):
        ledger.approve("mail-f", approver="lead", approver_roles=["support_lead"],
                       proposal_hash=proposal_hash, preview_hash=shown)
    ledger.deny("mail-f", approver="lead", approver_roles=["support_lead"], reason="no preview")
    assert ledger.get("mail-f").state is S.APPROVAL_DENIED


def test_a_preview_that_cannot_be_stored_or_shown_is_refused_before_storing(
    ledger: Ledger,
) -> None:
    ledger.submit(email("mail-big"), ALICE)
    before = ledger.get("mail-big").version
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(40):
        node["x"] = {}
        node = node["x"]
    for effect in ({"body": "x" * (70 * 1024)}, deep, {"n": 2**70}, {"f": float("nan")}):
        with pytest.raises(InvalidArgument):
            ledger.leasing.record_preview("mail-big", tool=None, executor="e",
                                          report=PreviewReport(effect=effect))
    # What an error carries is checked as well.
    deep_details = PreviewReport(error=ErrorInfo(
        code="X", category=ErrorCategory.INTERNAL, message="m", safe_details=deep
    ))
    with pytest.raises(InvalidArgument):
        ledger.leasing.record_preview("mail-big", tool=None, executor="e", report=deep_details)
    assert ledger.get("mail-big").version == before


def _refund(operation_id: str, amount_cents: int) -> ToolProposal:
    return proposal(
        "request_refund",
        {"order_id": "order-1004", "amount_cents": amount_cents, "currency": "USD",
         "reason_code": "damaged"},
        operation_id=operation_id,
    )


def test_a_refund_above_500_needs_two_distinct_approvers_and_a_small_one_needs_one(
    ledger: Ledger,
) -> None:
    finance = ["finance_approver"]
    for operation_id, amount_cents, needed in (("refund-small", 10_000, 1),
                                               ("refund-large", 60_000, 2)):
        assert ledger.submit(_refund(operation_id, amount_cents), ALICE).state is (
            S.AWAITING_APPROVAL)
        approval = ledger.get(operation_id).approval
        assert approval is not None and approval.required_approvals == needed
        proposal_hash = approval.effect_preview["proposal_hash"]
        # The payment backend's preview (the amount against the order): both approvers
        # of a large refund approve the one recorded.
        payout = PreviewReport(effect={"amount": f"{amount_cents // 100}.00 USD"})
        shown = previewed(ledger, operation_id, payout)
        ledger.approve(operation_id, approver="fin-1", approver_roles=finance,
                       proposal_hash=proposal_hash, preview_hash=shown)
        if needed == 2:
            assert ledger.get(operation_id).state is S.AWAITING_APPROVAL
            with pytest.raises(ApprovalRefused, match="duplicate_approver"):
                ledger.approve(operation_id, approver="fin-1", approver_roles=finance,
                               proposal_hash=proposal_hash, preview_hash=shown)
            ledger.approve(operation_id, approver="fin-2", approver_roles=finance,
                           proposal_hash=proposal_hash, preview_hash=shown)
        assert ledger.get(operation_id).state is S.READY


def test_expired_approvals_are_swept(storage: StorageConfig) -> None:
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    ledger.submit(email("mail-1"), ALICE)
    assert ledger.expire_approvals() == []
    now[0] += timedelta(minutes=16)
    assert ledger.expire_approvals() == ["mail-1"]
    assert ledger.get("mail-1").state is S.APPROVAL_EXPIRED


def test_the_oldest_due_approval_expires_however_many_wait_behind_it(
    storage: StorageConfig,
) -> None:
    # The sweep once read only the newest 1,000 waiting rows: with more pending, the
    # oldest requests (the ones due) were never looked at and never expired.
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    unlimited = registry_with_limit(None, tool="send_customer_email")
    ledger = make_ledger(storage, clock=lambda: now[0], registry=unlimited)
    ledger.submit(email("mail-oldest"), ALICE)
    now[0] += timedelta(minutes=10)
    for n in range(1000):
        assert ledger.submit(email(f"mail-{n:04}"), ALICE).state is S.AWAITING_APPROVAL
    now[0] += timedelta(minutes=6)  # past the oldest request's 15 minutes only
    ledger.refresh()
    assert ledger.projector.approval_expiry_candidates(now[0]) == ["mail-oldest"]
    assert ledger.expire_approvals() == ["mail-oldest"]
    assert ledger.get("mail-oldest").state is S.APPROVAL_EXPIRED
    assert ledger.get("mail-0000").state is S.AWAITING_APPROVAL


def test_a_sweep_skips_what_changed_since_the_view_named_it(storage: StorageConfig) -> None:
    # The view's answer may be a moment old (asked off the loop, or by another
    # instance): a call cancelled or finished since is left alone, and the rest of
    # the sweep goes on.
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    for operation_id in ("mail-cancelled", "mail-due"):
        ledger.submit(email(operation_id), ALICE)
    for operation_id in ("op-finished", "op-due"):
        ledger.submit(search(operation_id), ALICE)
        ledger.lease(operation_id, executor="exec-1")
    now[0] += timedelta(minutes=16)
    ledger.refresh()
    approvals = ledger.projector.approval_expiry_candidates(now[0])
    leases = ledger.projector.lease_expiry_candidates(now[0])
    assert (approvals, sorted(leases)) == (
        ["mail-cancelled", "mail-due"], ["op-due", "op-finished"]
    )
    ledger.cancel("mail-cancelled", by="alice")
    finished = ledger.get("op-finished").fencing_token
    ledger.record_result(result("op-finished", finished, data=NO_HITS))
    assert ledger.expire_approvals(candidates=approvals) == ["mail-due"]
    # An operation the ledger does not hold (a view row outliving its events) is
    # named in the log and skipped, not the end of the sweep either.
    assert ledger.expire_leases(candidates=["op-nowhere", *sorted(leases)]) == ["op-due"]
    assert ledger.get("mail-cancelled").state is S.CANCELLED
    assert ledger.get("op-finished").state is S.SUCCEEDED
    assert ledger.get("op-due").state is S.OUTCOME_UNKNOWN


def test_a_sweep_expires_a_bounded_number_oldest_first_and_the_next_goes_on(
    storage: StorageConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sweeps_module, "MAX_PER_SWEEP", 3)
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    for n in range(5):
        ledger.submit(email(f"mail-{n}"), ALICE)
        now[0] += timedelta(seconds=1)
    now[0] += timedelta(minutes=16)
    assert ledger.expire_approvals() == ["mail-0", "mail-1", "mail-2"]
    assert ledger.expire_approvals() == ["mail-3", "mail-4"]


def test_an_operation_whose_events_cannot_be_read_does_not_stop_the_sweep(
    storage: StorageConfig,
) -> None:
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    for operation_id in ("mail-damaged", "mail-due"):
        ledger.submit(email(operation_id), ALICE)
        now[0] += timedelta(seconds=1)
    ledger.refresh()
    # An upgrade renamed an event class (or a row was damaged): the oldest due
    # request can no longer be loaded, and it comes first in every sweep.
    ledger.db.execute(
        f"UPDATE {ledger.events_table} SET topic = topic || 'Gone'"
        " WHERE originator_id = ? AND originator_version = 2",
        ("mail-damaged",),
    )
    later = make_ledger(storage, clock=lambda: now[0])  # nothing of it cached
    now[0] += timedelta(minutes=16)
    assert later.expire_approvals() == ["mail-due"]
    assert later.get("mail-due").state is S.APPROVAL_EXPIRED


def test_a_database_failing_ends_the_sweep_and_one_operations_bad_data_does_not(
    storage: StorageConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep asks `is_outage`, as the gateway does: a database that fails is no one
    operation's fault (the sweep ends, and says so); data the database refuses for one
    operation is that operation's (it is skipped, and the next expires)."""
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    for operation_id in ("mail-first", "mail-second"):
        ledger.submit(email(operation_id), ALICE)
        now[0] += timedelta(seconds=1)
    now[0] += timedelta(minutes=16)
    update = ledger.runner.update

    def failing(failure: Exception) -> Any:
        def first_fails(operation_id: str, command: Any, **options: Any) -> Any:
            if operation_id == "mail-first":
                raise failure
            return update(operation_id, command, **options)

        return first_fails

    monkeypatch.setattr(ledger.runner, "update", failing(sqlite3.OperationalError("locked")))
    with pytest.raises(sqlite3.OperationalError):
        ledger.expire_approvals()
    monkeypatch.setattr(ledger.runner, "update", failing(sqlite3.DataError("bad text")))
    assert ledger.expire_approvals() == ["mail-second"]


def test_a_view_made_before_keeps_expiries_in_the_events_form_and_still_sweeps(
    storage: StorageConfig,
) -> None:
    """Views made before the one form hold the event's own text of the expiry ("Z",
    no fraction when it has none): the sweep still finds it due, to the second,
    and `audit verify` takes the same moment in that form as no fault."""
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    ledger.submit(email("mail-1"), ALICE)
    ledger.refresh()
    assert ledger.projector.rows()[0].approval_expires_at == "2026-11-29T12:15:00.000000Z"
    ledger.db.execute(
        "UPDATE opledger_operations SET approval_expires_at = ? WHERE operation_id = ?",
        ("2026-11-29T12:15:00Z", "mail-1"),
    )
    assert not [f for f in ledger.verify().findings if f.kind is FindingKind.VIEW_MISMATCH]
    almost = now[0] + timedelta(minutes=15) - timedelta(microseconds=1)
    assert ledger.projector.approval_expiry_candidates(almost) == []
    due = now[0] + timedelta(minutes=15)
    assert ledger.projector.approval_expiry_candidates(due) == ["mail-1"]
    # Another moment in that form is a fault.
    ledger.db.execute(
        "UPDATE opledger_operations SET approval_expires_at = ? WHERE operation_id = ?",
        ("2026-11-29T12:16:00Z", "mail-1"),
    )
    assert [f.kind for f in ledger.verify().findings] == [FindingKind.VIEW_MISMATCH]


def test_expired_leases_are_swept_and_only_they(storage: StorageConfig) -> None:
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    for operation_id in ("op-short", "op-long"):
        ledger.submit(search(operation_id), ALICE)
    short = ledger.lease("op-short", executor="exec-1")
    assert short.lease_expires_at is not None
    now[0] = short.lease_expires_at - timedelta(seconds=1)  # leased a little later
    ledger.lease("op-long", executor="exec-1")
    assert ledger.expire_leases() == []
    now[0] = short.lease_expires_at + timedelta(seconds=1)
    ledger.refresh()
    # The view names only the lease that ran out: the sweep loads nothing else.
    assert ledger.projector.lease_expiry_candidates(now[0]) == ["op-short"]
    assert ledger.expire_leases() == ["op-short"]
    assert ledger.get("op-short").state is S.OUTCOME_UNKNOWN
    assert ledger.get("op-long").state is S.EXECUTING


def test_a_view_without_lease_expiries_gets_the_column_and_still_sweeps(
    storage: StorageConfig,
) -> None:
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    first = make_ledger(storage, clock=lambda: now[0])
    first.submit(search("op-1"), ALICE)
    lease = first.lease("op-1", executor="exec-1")
    assert lease.lease_expires_at is not None
    first.refresh()
    first.db.execute("ALTER TABLE opledger_operations DROP COLUMN lease_expires_at")
    first.close()
    now[0] = lease.lease_expires_at + timedelta(seconds=1)
    second = make_ledger(storage, clock=lambda: now[0])  # an older view, upgraded
    assert second.projector.lease_expiry_candidates(now[0]) == ["op-1"]  # unknown: looked at
    assert second.expire_leases() == ["op-1"]


def test_the_view_names_operations_left_ready(ledger: Ledger) -> None:
    ledger.submit(search("s-ready"), ALICE)
    ledger.submit(search("s-claimed"), ALICE)
    ledger.lease("s-claimed", executor="exec-1")
    ledger.refresh()
    now = datetime.now(UTC)
    version = ledger.get("s-ready").tool_version
    assert ledger.projector.waiting_since_before(now + timedelta(seconds=1)) == [
        ("s-ready", "search_documents", version, 0, "ready", None)
    ]
    assert ledger.projector.waiting_since_before(now - timedelta(hours=1)) == []


def test_fencing_retry_and_stale_results(storage: StorageConfig) -> None:
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    ledger.submit(search("op-1"), ALICE)
    first = ledger.lease("op-1", executor="exec-1")
    failure = {"code": "UPSTREAM_TIMEOUT", "category": "TRANSIENT", "message": "timeout",
               "retryable": True}
    disposition = ledger.record_result(result("op-1", first.fencing_token, ok=False,
                                              error=failure))
    assert disposition is ResultDisposition.ACCEPTED
    assert ledger.get("op-1").state is S.READY  # retry scheduled by the contract's policy
    now[0] += timedelta(minutes=1)  # past the contract's backoff
    second = ledger.lease("op-1", executor="exec-2")
    assert (second.fencing_token, second.attempt) == (2, 2)
    late = ledger.record_result(result("op-1", first.fencing_token, data=NO_HITS))
    assert late is ResultDisposition.STALE
    assert ledger.get("op-1").state is S.EXECUTING
    ok = result("op-1", second.fencing_token, attempt=2, data=NO_HITS, executor="exec-2")
    assert ledger.record_result(ok) is ResultDisposition.ACCEPTED
    assert ledger.record_result(ok) is ResultDisposition.DUPLICATE
    operation = ledger.get("op-1")
    assert operation.state is S.SUCCEEDED
    assert [lease.executor for lease in operation.leases] == ["exec-1", "exec-2"]
    assert operation.outcome is not None
    kept = ledger.results.get(operation.outcome.result_ref)
    assert kept is not None
    assert kept.provenance.executor == "exec-2"


def test_state_survives_a_restart(storage: StorageConfig) -> None:
    first = make_ledger(storage)
    first.submit(search("op-1"), ALICE)
    first.lease("op-1", executor="exec-1")
    first.close()
    second = make_ledger(storage)
    operation = second.get("op-1")
    assert (operation.state, operation.fencing_token) == (S.EXECUTING, 1)


def test_replay_as_of_any_event(ledger: Ledger) -> None:
    ledger.submit(search("op-1"), ALICE)
    _succeed(ledger, "op-1")
    states = [ledger.get("op-1", version=v).state for v in range(1, 6)]
    assert states == [S.PROPOSED, S.VALIDATED, S.READY, S.EXECUTING, S.SUCCEEDED]


def test_view_rebuild_is_identical_and_matches_the_aggregates(ledger: Ledger) -> None:
    ledger.submit_many([(search(f"op-{n}"), ALICE) for n in range(5)])
    ledger.submit(email("mail-1"), ALICE)
    ledger.submit(proposal("search_documents", {"top_k": 3}, operation_id="bad"), ALICE)
    _succeed(ledger, "op-1")
    ledger.cancel("op-2", by="alice")
    ledger.refresh()
    before = ledger.projector.rows()
    digest_before = ledger.projector.digest_rows()
    assert ledger.projector.rebuild() == sum(len(ledger.history(r.operation_id)) for r in before)
    assert ledger.projector.rows() == before
    assert ledger.projector.digest_rows() == digest_before
    for row in before:
        operation = ledger.get(row.operation_id)
        assert row.state == operation.state.value
        assert row.last_version == operation.version
    by_id = {row.operation_id: row for row in before}
    assert by_id["mail-1"].approvals_required == 1
    assert by_id["op-1"].attempts == 1


def test_budget_is_counted_from_the_ledger_across_restarts(storage: StorageConfig) -> None:
    registry = registry_with_limit(2)
    first = make_ledger(storage, registry=registry)
    assert first.submit(search(), ALICE).state is S.READY
    assert first.submit(search(), ALICE).state is S.READY
    first.close()
    second = make_ledger(storage, registry=registry)
    third = second.submit(search(), ALICE)
    assert third.state is S.REJECTED
    assert third.decision is not None
    assert [issue.code for issue in third.decision.issues] == ["BUDGET_EXCEEDED"]


def test_budget_holds_within_one_batch(storage: StorageConfig) -> None:
    ledger = make_ledger(storage, registry=registry_with_limit(3))
    submitted = cast("list[Submission]", ledger.submit_many([(search(), ALICE) for _ in range(5)]))
    states = [s.state for s in submitted]
    assert states == [S.READY] * 3 + [S.REJECTED] * 2


def test_export_hashes_sensitive_arguments(ledger: Ledger) -> None:
    ledger.submit(email("mail-1"), ALICE)
    # The tool's preview renders the sensitive body into its text: hashed whole.
    rendered = PreviewReport(effect={"body": "Hello,\n\nThanks for writing to us.\n\nTCK-42"})
    previewed(ledger, "mail-1", rendered)
    out = io.BytesIO()
    assert ledger.export(out) == 5
    text = out.getvalue().decode()
    assert "Thanks for writing to us." not in text
    assert "TCK-42" not in text
    records = [orjson.loads(line) for line in text.splitlines()]
    proposed = records[0]["event"]["proposal"]["arguments"]
    assert set(proposed["body"]) == {"sha256"}
    assert proposed["recipient_ids"] == ["cus-0001"]
    assert records[1]["event"]["arguments"]["body"] == proposed["body"]
    assert records[2]["event"]["effect_preview"]["arguments"]["body"] == proposed["body"]
    assert [r["type"] for r in records] == [
        "Proposed", "Validated", "ApprovalRequested", "PreviewRequested", "PreviewRecorded"
    ]
    assert set(records[4]["event"]["report"]) == {"sha256"}
    assert records[4]["event"]["preview_hash"] == rendered.digest()
    assert records[1]["prev_hash"] == records[0]["event_hash"]


# --------------------------------------------------------------------- tampering


def _tampered_ledger(ledger: Ledger) -> Ledger:
    for n in range(3):
        ledger.submit(search(f"op-{n}"), ALICE)
        _succeed(ledger, f"op-{n}")
    ledger.refresh()
    report = ledger.verify()
    assert report.ok, [f.describe() for f in report.findings]
    assert report.events_checked == report.sealed_events == 15
    return ledger


def _state(ledger: Ledger, operation_id: str, version: int) -> bytes:
    rows = ledger.db.query(
        f"SELECT state FROM {ledger.events_table}"
        " WHERE originator_id = ? AND originator_version = ?",
        (operation_id, version),
    )
    return bytes(rows[0][0])


def _kinds(ledger: Ledger) -> set[tuple[FindingKind, str, int | None]]:
    return {(f.kind, f.operation_id, f.version) for f in ledger.verify().findings}


def test_verify_detects_a_modified_event(ledger: Ledger) -> None:
    _tampered_ledger(ledger)
    state = orjson.loads(_state(ledger, "op-1", 2))
    state["arguments"]["query"] = "salaries of everyone"
    ledger.db.execute(
        f"UPDATE {ledger.events_table} SET state = ?"
        " WHERE originator_id = ? AND originator_version = ?",
        (orjson.dumps(state), "op-1", 2),
    )
    kinds = _kinds(ledger)
    assert (FindingKind.MODIFIED, "op-1", 2) in kinds
    assert (FindingKind.CHAIN_BROKEN, "op-1", 3) in kinds
    assert all(operation == "op-1" for _, operation, _ in kinds)


def test_verify_detects_a_deleted_event(ledger: Ledger) -> None:
    _tampered_ledger(ledger)
    ledger.db.execute(
        f"DELETE FROM {ledger.events_table} WHERE originator_id = ? AND originator_version = ?",
        ("op-2", 4),
    )
    kinds = _kinds(ledger)
    assert (FindingKind.DELETED, "op-2", 4) in kinds
    assert (FindingKind.VERSION_GAP, "op-2", 5) in kinds


def test_verify_detects_an_inserted_event(ledger: Ledger) -> None:
    _tampered_ledger(ledger)
    # A forged approval slipped in outside the notification order, with a valid-looking chain.
    forged = orjson.loads(_state(ledger, "op-0", 5))
    forged["originator_version"] = 6
    position = "rowid" if not ledger.db.is_postgres else "notification_id"
    ledger.db.execute(
        f"INSERT INTO {ledger.events_table}"
        f" (originator_id, originator_version, topic, state, {position}) VALUES (?, ?, ?, ?, ?)",
        ("op-0", 6, "ledger.domain.operation:Operation.Succeeded", orjson.dumps(forged), -1),
    )
    assert (FindingKind.INSERTED, "op-0", 6) in _kinds(ledger)


def test_verify_detects_reordered_events(ledger: Ledger) -> None:
    _tampered_ledger(ledger)
    # Swap two sealed events of different operations in the global order.
    first, second = _state(ledger, "op-0", 5), _state(ledger, "op-1", 5)
    ledger.db.execute(f"DELETE FROM {ledger.events_table} WHERE originator_version = 5"
                      " AND originator_id IN ('op-0', 'op-1')")
    position = "rowid" if not ledger.db.is_postgres else "notification_id"
    sealed = {row[1]: row[0] for row in ledger.projector.digest_rows() if row[2] == 5}
    # Each operation's last event now sits at the other's sealed position.
    for operation, other, body in (("op-0", "op-1", second), ("op-1", "op-0", first)):
        ledger.db.execute(
            f"INSERT INTO {ledger.events_table} (originator_id, originator_version, topic, state,"
            f" {position}) VALUES (?, 5, ?, ?, ?)",
            (other, "ledger.domain.operation:Operation.Succeeded", body, sealed[operation]),
        )
    kinds = {(kind, operation) for kind, operation, _ in _kinds(ledger)}
    assert (FindingKind.REORDERED, "op-1") in kinds
    assert (FindingKind.REORDERED, "op-0") in kinds


def test_verify_with_an_anchored_head(ledger: Ledger) -> None:
    _tampered_ledger(ledger)
    head = ledger.verify().head_digest
    assert ledger.verify(expected_head=head).ok
    report = ledger.verify(expected_head="f" * 64)
    assert [f.kind for f in report.findings] == [FindingKind.HEAD_MISMATCH]


# ------------------------------------------------------------------ lease protocol


def test_lease_protocol_converges_after_a_lost_executor(storage: StorageConfig) -> None:
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0], lease_grace=timedelta(seconds=5))
    ledger.submit(search("op-1"), ALICE)
    first = ledger.lease("op-1", executor="exec-1")
    assert first.decision is LeaseDecision.EXECUTE
    assert first.arguments == {"query": "refund policy", "source_types": ["policy", "manual"],
                               "top_k": 8}
    assert (first.fencing_token, first.attempt) == (1, 1)
    # The executor dies; the redelivered item reaches another executor at once: busy.
    assert ledger.lease("op-1", executor="exec-2").decision is LeaseDecision.BUSY
    # Once the lease has run out, the next one must reconcile, never run again.
    now[0] += timedelta(seconds=60)
    second = ledger.lease("op-1", executor="exec-2")
    assert second.decision is LeaseDecision.RECONCILE
    assert second.fencing_token == 1
    assert ledger.get("op-1").state is S.RECONCILING
    reconciled = result("op-1", 1, data=NO_HITS, executor="exec-2")
    assert ledger.record_result(reconciled) is ResultDisposition.ACCEPTED
    assert ledger.get("op-1").state is S.SUCCEEDED
    assert ledger.lease("op-1", executor="exec-3").decision is LeaseDecision.DONE
    status = ledger.status("op-1")
    assert (status.state, status.final) == ("succeeded", True)
    assert status.result is not None
    assert status.result.provenance.executor == "exec-2"
    assert event_types(ledger, "op-1")[3:] == [
        "LeaseClaimed", "LeaseExpired", "ReconciliationStarted", "Reconciled",
    ]


def test_an_executor_of_another_tool_can_neither_lease_nor_settle_an_operation(
    ledger: Ledger,
) -> None:
    ledger.submit(search("s-1"), ALICE)
    before = event_types(ledger, "s-1")
    with pytest.raises(OperationNotFound) as foreign_lease:
        ledger.lease("s-1", executor="mail-exec", tool="send_customer_email")
    with pytest.raises(OperationNotFound) as made_up:
        ledger.lease("s-0", executor="mail-exec", tool="send_customer_email")
    # Another tool's operation is answered exactly like an ID nobody used.
    assert _answer(foreign_lease.value, "s-1") == _answer(made_up.value, "s-0")
    assert event_types(ledger, "s-1") == before
    assert ledger.get("s-1").state is S.READY
    grant = ledger.lease("s-1", executor="exec-1")
    before = event_types(ledger, "s-1")
    # The right fencing token, from the wrong tool's executor: refused, nothing recorded.
    foreign = result("s-1", grant.fencing_token, tool="send_customer_email")
    assert ledger.record_result(foreign) is ResultDisposition.REFUSED
    assert ledger.record_results([foreign]) == [ResultDisposition.REFUSED]
    assert event_types(ledger, "s-1") == before
    assert ledger.get("s-1").state is S.EXECUTING
    assert ledger.record_result(result("s-1", grant.fencing_token)) is ResultDisposition.ACCEPTED
    assert ledger.get("s-1").state is S.SUCCEEDED


def _answer(error: Exception, operation_id: str) -> str:
    """An error as its requester sees it, with the ID it asked about made generic."""
    assert isinstance(error, LedgerError)
    return error.to_info().model_dump_json().replace(operation_id, "<id>")


def test_status_for_another_host_is_reported_like_a_missing_operation(ledger: Ledger) -> None:
    ledger.submit(search("op-1"), ALICE, host="h1")
    assert ledger.status("op-1", host="h1").state == "ready"
    with pytest.raises(OperationNotFound):
        ledger.status("op-1", host="h2")
    with pytest.raises(OperationNotFound):
        ledger.status("op-missing", host="h1")


def test_status_is_never_an_outdated_copy_when_another_instance_wrote(
    storage: StorageConfig,
) -> None:
    first, second = make_ledger(storage), make_ledger(storage)
    first.submit(search("op-1"), ALICE)  # `first` now holds a copy at `ready`
    assert first.status("op-1").state == "ready"
    second.lease("op-1", executor="exec-1")
    assert first.status("op-1").state == "executing"
    first.close()
    second.close()


def test_status_of_a_pending_approval_is_not_final(ledger: Ledger) -> None:
    ledger.submit(email("mail-1"), ALICE)
    status = ledger.status("mail-1")
    assert (status.state, status.final, status.result) == ("awaiting_approval", False, None)


def test_a_retry_is_not_leased_before_its_backoff(storage: StorageConfig) -> None:
    """Before: attempt 2 was leased at once, whatever `not_before` and the tool said."""
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    for operation_id, retry_after_ms in (("op-policy", None), ("op-tool", 60_000)):
        ledger.submit(search(operation_id), ALICE)
        first = ledger.lease(operation_id, executor="exec-1")
        failure = {"code": "RATE_LIMITED", "category": "TRANSIENT", "message": "slow down",
                   "retryable": True, "retry_after_ms": retry_after_ms}
        ledger.record_result(result(operation_id, first.fencing_token, ok=False, error=failure))
    contract = ledger.checker.catalog["search_documents"]
    backoff = timedelta(milliseconds=contract.retry.backoff_ms(1))
    assert timedelta(0) < backoff < timedelta(seconds=60)
    expected = {"op-policy": now[0] + backoff, "op-tool": now[0] + timedelta(seconds=60)}
    for operation_id, not_before in expected.items():
        early = ledger.lease(operation_id, executor="exec-2")
        assert (early.decision, early.not_before) == (LeaseDecision.BUSY, not_before)
        assert ledger.get(operation_id).fencing_token == 1  # nothing leased, nothing appended
    now[0] += backoff
    assert ledger.lease("op-policy", executor="exec-2").decision is LeaseDecision.EXECUTE
    assert ledger.lease("op-tool", executor="exec-2").decision is LeaseDecision.BUSY
    now[0] = expected["op-tool"]
    second = ledger.lease("op-tool", executor="exec-2")
    assert (second.decision, second.attempt) == (LeaseDecision.EXECUTE, 2)


def _approved_email(ledger: Ledger, operation_id: str) -> None:
    ledger.submit(email(operation_id), ALICE)
    approval = ledger.get(operation_id).approval
    assert approval is not None
    ledger.approve(operation_id, approver="lead", approver_roles=["support_lead"],
                   proposal_hash=approval.effect_preview["proposal_hash"],
                   preview_hash=previewed(ledger, operation_id))


def test_an_approval_that_lapsed_before_the_lease_is_not_run(storage: StorageConfig) -> None:
    """Before: an e-mail approved, then leased 30 days after its approval's expiry, ran."""
    now = [datetime(2026, 11, 29, 12, 0, tzinfo=UTC)]
    ledger = make_ledger(storage, clock=lambda: now[0])
    _approved_email(ledger, "mail-late")
    approval = ledger.get("mail-late").approval
    assert approval is not None
    now[0] = approval.expires_at + timedelta(days=30)
    reply = ledger.lease("mail-late", executor="exec-1", tool="send_customer_email")
    assert (reply.decision, reply.reason) == (LeaseDecision.DONE, "approval_expired")
    assert reply.arguments is None and reply.fencing_token is None  # nothing to run with
    operation = ledger.get("mail-late")
    assert operation.state is S.APPROVAL_EXPIRED and operation.fencing_token == 0
    assert event_types(ledger, "mail-late")[-1] == "ExecutionRefused"
    status = ledger.status("mail-late")
    assert status.final
    assert status.outcome == {"status": "approval_expired", "code": "approval_expired"}
    # A redelivered work item converges on the same answer, appending nothing.
    assert ledger.lease("mail-late", executor="exec-2").decision is LeaseDecision.DONE
    assert event_types(ledger, "mail-late").count("ExecutionRefused") == 1


def test_the_lease_records_what_it_checked(storage: StorageConfig) -> None:
    ledger = make_ledger(storage)
    _approved_email(ledger, "mail-ok")
    reply = ledger.lease("mail-ok", executor="exec-1", tool="send_customer_email")
    assert reply.decision is LeaseDecision.EXECUTE
    operation = ledger.get("mail-ok")
    assert operation.approval is not None
    claimed = ledger.history("mail-ok")[-1]
    assert type(claimed).__name__ == "LeaseClaimed"
    assert claimed.checked == {
        "contract_version": operation.tool_version,
        "approval_valid_until": operation.approval.expires_at.isoformat(),
    }


def test_a_call_checked_against_a_contract_no_longer_in_force_is_refused(
    storage: StorageConfig,
) -> None:
    """The contract changed between the check and the lease: permission_changed, not run."""
    first = make_ledger(storage)
    first.submit(search("op-old-contract"), ALICE)
    pinned = first.get("op-old-contract").tool_version
    first.close()
    bumped = ContractRegistry()
    for contract in ContractRegistry.from_directory(CATALOG_DIR).pin_latest().values():
        if contract.name == "search_documents":
            contract = contract.model_copy(update={"version": "9.0.0"})
        bumped.register(contract)
    second = make_ledger(storage, registry=bumped)
    reply = second.lease("op-old-contract", executor="exec-1", tool="search_documents")
    assert (reply.decision, reply.reason) == (LeaseDecision.DONE, "rejected")
    operation = second.get("op-old-contract")
    assert operation.state is S.REJECTED and operation.fencing_token == 0
    refused = second.history("op-old-contract")[-1]
    assert type(refused).__name__ == "ExecutionRefused"
    assert refused.code == "permission_changed"
    assert pinned in refused.reason and "9.0.0" in refused.reason
    assert second.status("op-old-contract").outcome == {
        "status": "rejected", "category": "POLICY_DENIED", "code": "permission_changed"
    }
    second.close()


def test_a_success_whose_data_breaks_the_output_schema_is_not_recorded_as_one(
    storage: StorageConfig,
) -> None:
    """Before: whatever a result said was recorded; a 'success' with any data succeeded."""
    ledger = make_ledger(storage)
    ledger.submit(search("op-read"), ALICE)
    read = ledger.lease("op-read", executor="exec-1", tool="search_documents")
    broken = {"items": [{"source_id": "doc-1"}], "truncated": False, "next_cursor": None,
              "admin": True}
    assert ledger.record_result(result("op-read", read.fencing_token, data=broken)) is (
        ResultDisposition.ACCEPTED
    )
    operation = ledger.get("op-read")
    assert operation.state is S.FAILED  # a read: it failed, and may be retried by policy
    failed = next(e for e in ledger.history("op-read") if type(e).__name__ == "Failed")
    assert (failed.code, failed.category, failed.retryable) == (
        "OUTPUT_CONTRACT_VIOLATION", "INTERNAL", False
    )
    assert ledger.results.get_text(ResultStore.reference("op-read", 1)) is None  # not kept

    _approved_email(ledger, "mail-broken")
    write = ledger.lease("mail-broken", executor="exec-1", tool="send_customer_email")
    assert write.decision is LeaseDecision.EXECUTE
    claim = result("mail-broken", write.fencing_token, data={"sent": "yes, trust me"},
                   tool="send_customer_email")
    claim = claim.model_copy(update={"provenance": claim.provenance.model_copy(
        update={"tool_version": write.tool_version})})
    ledger.record_result(claim)
    # A write may have had its effect: unknown, for reconciliation, never "succeeded".
    assert ledger.get("mail-broken").state is S.OUTCOME_UNKNOWN
    unknown = ledger.history("mail-broken")[-1]
    assert type(unknown).__name__ == "OutcomeUnknown"
    assert unknown.reason.startswith("the output breaks the contract's output schema")


def test_a_fault_only_under_a_redacted_pointer_does_not_count(storage: StorageConfig) -> None:
    """What the executor redacted is its placeholder, not the tool's output."""
    ledger = make_ledger(storage)
    ledger.submit(search("op-redacted"), ALICE)
    lease = ledger.lease("op-redacted", executor="exec-1", tool="search_documents")
    data = {"items": [], "truncated": False, "next_cursor": 12345}  # redacted to a number
    envelope = result("op-redacted", lease.fencing_token, data=data).model_copy(
        update={"redactions": ("/next_cursor",)}
    )
    ledger.record_result(envelope)
    assert ledger.get("op-redacted").state is S.SUCCEEDED
