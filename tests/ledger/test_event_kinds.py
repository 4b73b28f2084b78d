"""The event registry: every event type of `Operation` is in it, and what it says of
each type agrees with what the aggregate does."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

from ledger import IllegalTransition, Operation, OperationState
from ledger.domain.event_kinds import EVENT_KINDS, event_kind, event_types
from ledger.domain.operation import ALLOWED
from ledger.domain.states import TERMINAL_STATES
from schemas import PreviewReport, WorkPurpose
from tests.ledger.test_state_machine import BUILDERS, COMMANDS, T0


def _walks() -> Iterator[Operation]:
    """Every allowed (state, command) pair, and the results and approvals only recorded."""
    for state, build in BUILDERS.items():
        for command, allowed in ALLOWED.items():
            if state in allowed:
                operation = build()
                # Some allowed commands refuse in some states (no such approval
                # request): what they appended, if anything, is checked all the same.
                with contextlib.suppress(IllegalTransition):
                    COMMANDS[command](operation)
                yield operation
    stale = BUILDERS[OperationState.EXECUTING]()
    stale.expire_lease(T0 + timedelta(hours=2))
    stale.record_result(fencing_token=0, executor="old", outcome="succeeded", now=T0)
    yield stale
    conflicting = BUILDERS[OperationState.SUCCEEDED]()
    conflicting.record_result(
        fencing_token=1, executor="e", outcome="failed", code="X", category="TRANSIENT", now=T0
    )
    yield conflicting
    refused = BUILDERS[OperationState.AWAITING_APPROVAL]()
    refused.grant_approval(
        approval_id="apr-1",
        approver="bob",
        approver_roles=frozenset({"approver"}),
        proposal_hash="not-the-hash-shown",
        now=T0,
    )
    yield refused
    previewed = BUILDERS[OperationState.AWAITING_APPROVAL]()
    previewed.request_preview(T0)
    previewed.record_preview(
        executor="e", report=PreviewReport(effect={"summary": "send 1 e-mail"}), now=T0
    )
    yield previewed
    unknown = BUILDERS[OperationState.EXECUTING]()
    unknown.record_result(fencing_token=1, executor="e", outcome="unknown", now=T0)
    yield unknown
    inconclusive = BUILDERS[OperationState.RECONCILING]()
    inconclusive.record_result(
        fencing_token=inconclusive.fencing_token, executor="e", outcome="unknown", now=T0
    )
    yield inconclusive
    exhausted = BUILDERS[OperationState.RECONCILING]()
    exhausted.record_result(
        fencing_token=exhausted.fencing_token, executor="e", outcome="unknown",
        code="RECONCILE_UNSUPPORTED", now=T0,
    )
    yield exhausted


def test_every_event_type_is_registered() -> None:
    missing = {event.__name__ for event in event_types()} - {k.name for k in EVENT_KINDS.values()}
    assert not missing, f"event types missing from EVENT_KINDS: {sorted(missing)}"
    assert set(EVENT_KINDS) == event_types()


def test_the_registry_states_agree_with_the_aggregate_for_every_event() -> None:
    seen: set[str] = set()
    for operation in _walks():
        replayed: Operation | None = None
        for event in operation.collect_events():
            assert isinstance(event, Operation.Event)
            before = replayed.state if replayed is not None else OperationState.PROPOSED
            replayed = event.mutate(replayed)
            assert replayed is not None
            kind = EVENT_KINDS[type(event)]
            fields = event.model_dump(mode="json")
            assert kind.state_after(fields, before) is replayed.state, (
                f"{kind.name} from {before}: the registry says "
                f"{kind.state_after(fields, before)}, the aggregate {replayed.state}"
            )
            # Settling means: the operation just reached a final state, so its host is
            # told. Dispatching means: it just became ready, so a work item goes out.
            # (Or a failure the retry policy would run again ended cancelled instead.)
            reached = replayed.state in TERMINAL_STATES and (
                before not in TERMINAL_STATES
                or (before is OperationState.FAILED and replayed.state is OperationState.CANCELLED)
            )
            assert kind.settles is reached, (
                f"{kind.name} from {before} to {replayed.state}: settles={kind.settles}"
            )
            # Dispatching means: it just became ready, so an attempt's work item goes
            # out; or its outcome just became unknown (again), so a lookup's does.
            became_ready = replayed.state is OperationState.READY and before is not (
                OperationState.READY
            )
            expected = (
                WorkPurpose.PREVIEW
                if isinstance(event, Operation.PreviewRequested)
                else WorkPurpose.EXECUTE
                if became_ready
                else WorkPurpose.RECONCILE
                if replayed.state is OperationState.OUTCOME_UNKNOWN
                and before is not OperationState.OUTCOME_UNKNOWN
                else None
            )
            assert kind.dispatches is expected, (
                f"{kind.name} from {before} to {replayed.state}: dispatches={kind.dispatches}"
            )
            # Notifying means: it needs a person, and is not final.
            needs_person = replayed.state is OperationState.NEEDS_RESOLUTION
            assert kind.notifies is (needs_person and before is not replayed.state), kind
            assert kind.summary(event)  # every type has a summary that renders
            assert event_kind(f"ledger.domain.operation:Operation.{kind.name}") is kind
            seen.add(kind.name)
    unseen = {kind.name for kind in EVENT_KINDS.values()} - seen
    assert not unseen, f"no walk produced {sorted(unseen)}: add one, or the check is vacuous"
