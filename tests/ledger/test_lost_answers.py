"""Appends whose answer PostgreSQL never sent: stored, and not told.

A connection cut after the server committed an append and before the ledger read
the answer (a network fault, a server restart, a proxy's timeout) leaves the
ledger not knowing whether its events are stored. Tried again blindly, the append
fails on its own events, and the ledger took that for a race lost to another
writer: a budgeted call went uncounted, and a lease that was granted was answered
as if someone else held it. Each test cuts the connection at that moment through
a real proxy (`tests.ledger.lost_reply`) to the real server.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

import psycopg
import pytest
from eventsourcing.persistence import StoredEvent

from ledger import Ledger, OperationState, StorageConfig, Submission
from ledger.adapters.recorders import ArrayInsertRecorder
from ledger.domain.states import ResultDisposition
from schemas import LeaseDecision, LeaseReply
from tests.ledger.helpers import (
    ALICE,
    NO_HITS,
    event_types,
    make_ledger,
    registry_with_limit,
    result,
    search,
)
from tests.ledger.lost_reply import LostReplyProxy

S = OperationState


@dataclass
class _Through:
    ledger: Ledger
    proxy: LostReplyProxy


@pytest.fixture
def through(postgres_storage: StorageConfig) -> Iterator[_Through]:
    """A ledger (search_documents limited to 2 an hour) that reaches PostgreSQL through
    a proxy that can lose one answer."""
    proxy = LostReplyProxy(postgres_storage.postgres_dsn or "")
    storage = StorageConfig.postgres(proxy.dsn, schema=postgres_storage.postgres_schema)
    ledger = make_ledger(storage, registry=registry_with_limit(2))
    try:
        yield _Through(ledger, proxy)
    finally:
        ledger.close()
        proxy.close()


def _lose(through: _Through, operation_id: str, event: str) -> None:
    # An append holds its operations' IDs and its events' topics; reads hold IDs only.
    through.proxy.lose_reply_to(operation_id, f"Operation.{event}")


def _assert_lost(through: _Through) -> None:
    assert through.proxy.lost.is_set(), "no answer was lost: the attack did not happen"


def test_a_call_whose_append_answer_was_lost_counts_against_the_budget(
    through: _Through,
) -> None:
    ledger = through.ledger
    assert ledger.budget is not None
    ledger.budget.view_kept_current()  # as a service runs it: the view is not asked again
    assert ledger.submit(search("op-first"), ALICE).state is S.READY
    _lose(through, "op-lost", "Proposed")
    assert ledger.submit(search("op-lost"), ALICE).state is S.READY
    _assert_lost(through)
    assert event_types(ledger, "op-lost") == ["Proposed", "Validated", "Readied"]
    # Two calls are stored; the limit is two an hour.
    assert ledger.submit(search("op-third"), ALICE).state is S.REJECTED


def test_a_lease_whose_append_answer_was_lost_is_granted_once(through: _Through) -> None:
    ledger = through.ledger
    ledger.submit(search("op-1"), ALICE)
    _lose(through, "op-1", "LeaseClaimed")
    grant = ledger.lease("op-1", executor="exec-1")
    _assert_lost(through)
    # The executor that asked holds the lease it was granted, not "somebody else's".
    assert grant.decision is LeaseDecision.EXECUTE, grant
    assert event_types(ledger, "op-1") == ["Proposed", "Validated", "Readied", "LeaseClaimed"]
    disposition = ledger.record_result(result("op-1", grant.fencing_token, data=NO_HITS))
    assert disposition is ResultDisposition.ACCEPTED
    assert ledger.get("op-1").state is S.SUCCEEDED


def test_a_result_whose_append_answer_was_lost_is_accepted_once(through: _Through) -> None:
    ledger = through.ledger
    ledger.submit(search("op-1"), ALICE)
    grant = ledger.lease("op-1", executor="exec-1")
    _lose(through, "op-1", "Succeeded")
    disposition = ledger.record_result(result("op-1", grant.fencing_token, data=NO_HITS))
    _assert_lost(through)
    assert disposition is ResultDisposition.ACCEPTED
    assert event_types(ledger, "op-1") == [
        "Proposed", "Validated", "Readied", "LeaseClaimed", "Succeeded"
    ]
    # Sent again (the executor's redelivery): the same outcome, nothing appended.
    again = ledger.record_result(result("op-1", grant.fencing_token, data=NO_HITS))
    assert again is ResultDisposition.DUPLICATE
    assert len(event_types(ledger, "op-1")) == 5


@contextlib.contextmanager
def _events_table_locked(storage: StorageConfig) -> Iterator[None]:
    """Another writer's transaction holds the events table's lock (as an append does)."""
    with psycopg.connect(storage.postgres_dsn or "") as conn:
        conn.execute(
            f'LOCK TABLE "{storage.postgres_schema}".{storage.events_table} IN EXCLUSIVE MODE'
        )
        yield


@pytest.mark.parametrize("event", ["Proposed", "LeaseClaimed"])
def test_an_append_cut_while_it_waits_for_the_lock_and_committed_later_is_kept(
    through: _Through, postgres_storage: StorageConfig, event: str
) -> None:
    """Cut while another writer holds the table's lock, the append is not dead: the
    server runs it once the lock is free. The append tried again waits behind it, fails
    on its events, and is looked into: found, as sent."""
    ledger = through.ledger
    assert ledger.budget is not None
    ledger.budget.view_kept_current()
    assert ledger.submit(search("op-first"), ALICE).state is S.READY
    operation_id = "op-lost" if event == "Proposed" else "op-first"
    through.proxy.lose_reply_to(operation_id, f"Operation.{event}", at_once=True)
    with ThreadPoolExecutor(max_workers=1) as pool:
        with _events_table_locked(postgres_storage):
            answer: Future[object] = (
                pool.submit(ledger.submit, search("op-lost"), ALICE)
                if event == "Proposed"
                else pool.submit(ledger.lease, "op-first", executor="exec-1")
            )
            assert through.proxy.lost.wait(10), "the append was never sent"
            time.sleep(0.5)  # the library tries again, and queues for the lock behind it
        answered = answer.result(timeout=60)
    if event == "Proposed":
        assert isinstance(answered, Submission) and answered.state is S.READY
        assert event_types(ledger, "op-lost") == ["Proposed", "Validated", "Readied"]
        assert ledger.submit(search("op-third"), ALICE).state is S.REJECTED
    else:
        assert isinstance(answered, LeaseReply)
        assert answered.decision is LeaseDecision.EXECUTE, answered
        assert event_types(ledger, "op-first").count("LeaseClaimed") == 1


def test_without_the_append_function_a_lost_commit_answer_is_kept_too(
    through: _Through, postgres_storage: StorageConfig
) -> None:
    """A schema served without the append function (made by an earlier release) appends
    with the library's statements in a transaction, and the library tries again on its
    own after a cut: the `IntegrityError` that follows is looked into the same way."""
    ledger = through.ledger
    with psycopg.connect(postgres_storage.postgres_dsn or "", autocommit=True) as conn:
        schema = postgres_storage.postgres_schema
        for (name,) in conn.execute(
            "SELECT proname FROM pg_proc JOIN pg_namespace n ON n.oid = pronamespace"
            " WHERE nspname = %s AND proname LIKE 'opledger_append_%%'",
            (schema,),
        ).fetchall():
            conn.execute(f'DROP FUNCTION "{schema}"."{name}"')
    ledger.submit(search("op-1"), ALICE)
    recorder = ledger.runner.events.events.recorder
    assert isinstance(recorder, ArrayInsertRecorder) and recorder._function_missing
    _lose(through, "op-1", "LeaseClaimed")
    grant = ledger.lease("op-1", executor="exec-1")
    _assert_lost(through)
    assert grant.decision is LeaseDecision.EXECUTE, grant
    assert event_types(ledger, "op-1").count("LeaseClaimed") == 1


def test_only_the_exact_events_sent_count_as_stored(postgres_storage: StorageConfig) -> None:
    """After a cut connection, events found stored are this append only if every one is
    there with the state sent: another writer's events at the same versions are a race
    lost, as before."""
    ledger = make_ledger(postgres_storage)
    try:
        recorder = ledger.runner.events.events.recorder
        assert isinstance(recorder, ArrayInsertRecorder)
        now = datetime.now(UTC).isoformat().encode()
        sent = [
            StoredEvent(
                originator_id="op-x", originator_version=v, topic="t:E", state=now + b"%d" % v
            )
            for v in (1, 2)
        ]
        assert recorder._stored_as_sent(sent) is None  # none stored
        positions = recorder.insert_events(sent)
        assert positions is not None
        assert recorder._stored_as_sent(sent) == list(positions)
        other = [sent[0], StoredEvent(originator_id="op-x", originator_version=2, topic="t:E",
                                      state=b"another writer's")]
        assert recorder._stored_as_sent(other) is None
        longer = [*sent, StoredEvent(originator_id="op-x", originator_version=3, topic="t:E",
                                     state=b"3")]
        assert recorder._stored_as_sent(longer) is None
        assert recorder._stored_as_sent([]) is None  # texts alone: no events to find
    finally:
        ledger.close()
