"""The subject wildcards and message IDs, spelt once in `schemas`, pinned to their wire form.

Everything else (streams, consumers, permissions, subscriptions, tests) takes
them from `Subjects` and the ID functions; this file is where their spelling
is written down, so a change to the wire shows here first.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest

from schemas import (
    OPERATION_ID_PATTERN,
    TOKEN_PATTERN,
    Provenance,
    ResultEnvelope,
    Subjects,
    feed_message_id,
    new_operation_id,
    result_message_id,
    work_message_id,
)


def test_wildcards_have_their_wire_spelling() -> None:
    assert Subjects.all_proposals() == "ops.propose.*"
    assert Subjects.all_status_requests() == "ops.status.*"
    assert Subjects.all_lease_requests() == "ops.lease.*"
    assert Subjects.all_work() == "ops.exec.*"
    assert Subjects.all_work(any_depth=True) == "ops.exec.>"
    assert Subjects.all_results() == "ops.result.*"
    assert Subjects.all_feed() == "ops.feed.>"
    assert Subjects.all_feed("search_documents") == "ops.feed.search_documents.>"
    assert Subjects.all_outcomes() == "ops.outcome.>"
    assert Subjects.all_outcomes("h1") == "ops.outcome.h1.>"


def test_each_wildcard_covers_its_family() -> None:
    def covers(pattern: str, subject: str) -> bool:
        regex = re.escape(pattern).replace(r"\*", r"[^.]+").replace(">", r".+")
        return re.fullmatch(regex, subject) is not None

    assert covers(Subjects.all_proposals(), Subjects.propose("h1"))
    assert covers(Subjects.all_status_requests(), Subjects.status("h1"))
    assert covers(Subjects.all_lease_requests(), Subjects.lease("t"))
    assert covers(Subjects.all_work(), Subjects.work("t"))
    assert covers(Subjects.all_results(), Subjects.result("t"))
    assert covers(Subjects.all_feed(), Subjects.feed("t", "Proposed"))
    assert covers(Subjects.all_feed("t"), Subjects.feed("t", "Proposed"))
    assert not covers(Subjects.all_feed("u"), Subjects.feed("t", "Proposed"))
    assert covers(Subjects.all_outcomes("h1"), Subjects.outcome("h1", "op-1"))
    assert not covers(Subjects.all_outcomes("h2"), Subjects.outcome("h1", "op-1"))


@pytest.mark.parametrize("bad", ["a.b", "*", ">", ""])
def test_scoped_wildcards_take_checked_tokens(bad: str) -> None:
    with pytest.raises(ValueError, match="subject token"):
        Subjects.all_feed(bad)
    with pytest.raises(ValueError, match="subject token"):
        Subjects.all_outcomes(bad)


def test_message_ids_have_their_wire_spelling() -> None:
    assert work_message_id("h1/op-1", 2) == "h1/op-1:attempt-2"
    assert feed_message_id("h1/op-1", 3) == "h1/op-1:3"
    envelope = ResultEnvelope(
        operation_id="h1/op-1",
        fencing_token=4,
        ok=True,
        data={},
        provenance=Provenance(
            tool="search_documents", tool_version="1", executor="e", attempt=2,
            latency_ms=0, completed_at=datetime(2026, 1, 1, tzinfo=UTC),
        ),
    )
    assert result_message_id(envelope, "n0nce") == "search_documents:h1/op-1:2:4:n0nce"


def test_a_new_operation_id_is_one_format_for_sdk_and_ledger() -> None:
    minted = {new_operation_id() for _ in range(100)}
    assert len(minted) == 100
    for operation_id in minted:
        uuid4 = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
        assert re.fullmatch(f"op-{uuid4}", operation_id)
        assert re.fullmatch(TOKEN_PATTERN, operation_id)
        assert re.fullmatch(OPERATION_ID_PATTERN, operation_id)
