"""The relay's pure half: a stored event → the NATS messages it means, without NATS."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from ledger._recent import Recent
from ledger.domain.event_kinds import EVENT_KINDS
from ledger.server.relay import RelayMessage, Route, learn_routes, messages_for
from schemas import (
    FeedEvent,
    OperationStatus,
    Subjects,
    WorkItem,
    WorkPurpose,
    feed_message_id,
    work_message_id,
)

_TOPIC = "ledger.domain.operation:Operation."
_ROUTE: Route = ("search_documents", "2.1.0", "h1", None)
_LIMIT = 1024 * 1024


def _row(position: int, version: int, kind: str, **state: Any) -> tuple[int, str, int, str, bytes]:
    state.setdefault("timestamp", "2026-11-29T10:00:00.000000Z")
    return (position, "h1/op-1", version, _TOPIC + kind, orjson.dumps(state))


class FakeLedger:
    """What the builder's ports answer: sensitive pointers and final statuses."""

    def __init__(self, status: OperationStatus | None = None) -> None:
        self.status = status
        self.asked: list[tuple[str, int, str]] = []
        self.finals: list[bool] = []

    def sensitive(self, tool: str) -> tuple[str, ...]:
        return ("/query",) if tool == "search_documents" else ()

    def final_status(
        self, operation_id: str, version: int, host: str, final: bool = True
    ) -> OperationStatus | None:
        self.asked.append((operation_id, version, host))
        self.finals.append(final)
        return self.status


def _build(row: Any, fake: FakeLedger, limit: int = _LIMIT) -> list[RelayMessage]:
    return messages_for(
        row, _ROUTE, limit=limit, sensitive=fake.sensitive, final_status=fake.final_status
    )


def test_every_event_is_one_feed_message_with_sensitive_values_hashed() -> None:
    fake = FakeLedger()
    row = _row(7, 1, "Proposed", tool="search_documents", arguments={"query": "secret"})
    [message] = _build(row, fake)
    assert (message.subject, message.message_id, message.feed, message.row) == (
        Subjects.feed("search_documents", "Proposed"), feed_message_id("h1/op-1", 1), True, row,
    )
    event = FeedEvent.model_validate_json(message.payload)
    assert (event.position, event.version, event.type) == (7, 1, "Proposed")
    assert b"secret" not in message.payload
    assert fake.asked == []


@pytest.mark.parametrize(("kind", "state", "attempt"), [
    ("Readied", {}, 1),
    ("RetryScheduled", {"after_attempt": 2}, 3),
])
def test_a_dispatch_event_is_also_a_work_item_per_attempt(
    kind: str, state: dict[str, Any], attempt: int
) -> None:
    feed, work = _build(_row(9, 4, kind, **state), FakeLedger())
    assert feed.feed and not work.feed
    assert (work.subject, work.message_id) == (
        Subjects.work("search_documents"), work_message_id("h1/op-1", attempt),
    )
    assert WorkItem.model_validate_json(work.payload) == WorkItem(
        operation_id="h1/op-1", tool="search_documents", tool_version="2.1.0", attempt=attempt
    )


@pytest.mark.parametrize(("kind", "state", "attempt", "lookup"), [
    ("OutcomeUnknown", {"attempt": 1}, 1, 1),
    ("LeaseExpired", {"attempt": 2, "fencing_token": 2}, 2, 1),
    ("ReconciliationInconclusive", {"attempt": 1, "round": 2}, 1, 3),
    ("LeaseExpired", {"fencing_token": 1}, 1, 1),  # stored before it named its attempt
])
def test_an_unknown_outcome_is_also_a_work_item_per_lookup(
    kind: str, state: dict[str, Any], attempt: int, lookup: int
) -> None:
    _feed, work = _build(_row(9, 4, kind, **state), FakeLedger())
    assert (work.subject, work.message_id) == (
        Subjects.work("search_documents"), work_message_id("h1/op-1", attempt, lookup),
    )
    assert work.message_id != work_message_id("h1/op-1", attempt)  # not the attempt's own
    assert WorkItem.model_validate_json(work.payload) == WorkItem(
        operation_id="h1/op-1", tool="search_documents", tool_version="2.1.0", attempt=attempt,
        purpose=WorkPurpose.RECONCILE, lookup=lookup,
    )


def test_needing_a_person_is_announced_to_the_host_as_not_final() -> None:
    status = OperationStatus(operation_id="op-1", state="needs_resolution", final=False)
    fake = FakeLedger(status)
    _feed, notice = _build(_row(10, 8, "ResolutionNeeded", rounds=3, reason="r", by="e"), fake)
    assert (notice.subject, notice.message_id) == (Subjects.outcome("h1", "op-1"), None)
    assert OperationStatus.model_validate_json(notice.payload) == status
    assert fake.finals == [False]  # asked for a state that needs a person, not a final one


def test_a_settling_event_announces_the_final_status_to_its_host_in_its_namespace() -> None:
    status = OperationStatus(operation_id="op-1", state="succeeded", final=True)
    fake = FakeLedger(status)
    _feed, notice = _build(_row(10, 6, "Succeeded"), fake)
    assert fake.asked == [("op-1", 6, "h1")]
    assert (notice.subject, notice.message_id, notice.feed) == (
        Subjects.outcome("h1", "op-1"), None, False,
    )
    assert OperationStatus.model_validate_json(notice.payload) == status


def test_no_notice_without_a_final_status_or_when_it_is_too_large() -> None:
    assert len(_build(_row(10, 6, "Succeeded"), FakeLedger(None))) == 1
    big = OperationStatus(operation_id="op-1", state="succeeded", final=True,
                          outcome={"text": "x" * 5000})
    assert len(_build(_row(10, 6, "Succeeded"), FakeLedger(big), limit=4000)) == 1


def test_a_record_too_large_for_a_message_goes_without_its_body() -> None:
    [message] = _build(_row(3, 2, "Validated", blob="y" * 5000), FakeLedger(), limit=4000)
    event = FeedEvent.model_validate_json(message.payload)
    assert (event.event, event.event_omitted) == ({}, True)
    with pytest.raises(ValueError, match="without its body"):
        _build(_row(3, 2, "Validated"), FakeLedger(), limit=10)


def test_a_row_that_is_no_event_raises_for_the_relay_to_set_aside() -> None:
    with pytest.raises(orjson.JSONDecodeError):
        _build((1, "h1/op-1", 1, _TOPIC + "Proposed", b"not json"), FakeLedger())


def test_routes_are_learnt_from_the_events_that_name_them() -> None:
    routes: Recent[str, Route] = Recent(10)
    learn_routes([
        _row(1, 1, "Proposed", tool="search_documents", host="h1"),
        (2, "h1/op-2", 1, _TOPIC + "Proposed", b"junk"),
        _row(3, 2, "Validated", tool_version="2.1.0"),
    ], routes)
    assert routes.get("h1/op-1") == ("search_documents", "2.1.0", "h1", None)
    assert routes.get("h1/op-2") is None


def test_the_registry_names_the_dispatching_and_settling_events() -> None:
    """The relay's sets before the registry, plus ExecutionRefused (a refusal at the lease)."""
    kinds = EVENT_KINDS.values()
    assert {kind.name for kind in kinds if kind.dispatches is WorkPurpose.EXECUTE} == {
        "Readied", "RetryScheduled",
    }
    # An unknown outcome is looked up, by a work item of its own: never left for good.
    assert {kind.name for kind in kinds if kind.dispatches is WorkPurpose.RECONCILE} == {
        "LeaseExpired", "OutcomeUnknown", "ReconciliationInconclusive",
    }
    assert {kind.name for kind in kinds if kind.notifies} == {"ResolutionNeeded"}
    assert {kind.name for kind in kinds if kind.settles} == {
        "Succeeded", "Failed", "Rejected", "ApprovalDenied", "ApprovalExpired", "Cancelled",
        "Reconciled", "ExecutionRefused", "ClarificationNeeded",
    }


def test_a_traced_operations_work_item_carries_its_trace_and_an_untraced_one_none() -> None:
    traced = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    row = _row(9, 3, "Readied")
    fake = FakeLedger()
    (_, item) = messages_for(
        row,
        ("search_documents", "2.1.0", "h1", traced),
        limit=_LIMIT,
        sensitive=fake.sensitive,
        final_status=fake.final_status,
    )
    assert item.subject == Subjects.work("search_documents")
    assert item.headers is not None
    # The same trace; the parent is the dispatch span (or the stored one, untraced here).
    assert item.headers["traceparent"].split("-")[1] == traced.split("-")[1]
    (_, plain) = _build(row, fake)
    assert plain.headers is None
