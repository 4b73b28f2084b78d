"""What an append's NOTIFY says (`ledger.adapters.notices`): made and read back, and what
a payload in no such form, or a hostile one, reads as."""

from __future__ import annotations

from ledger.adapters.notices import (
    AppendNotice,
    new_writer,
    notice_head,
    notice_payloads,
    read_notice,
)


def test_payloads_name_every_operation_once_under_postgresqls_limit() -> None:
    ids = [f"{'h' * 128}/{n:0128d}" for n in range(120)] + ["h/x~plan"]
    payloads = notice_payloads("t_1.opledger_events", "a1b2c3", ids + ids[:5])
    assert len(payloads) > 1
    assert all(len(payload.encode()) < 8000 for payload in payloads)
    read = [read_notice(payload) for payload in payloads]
    assert all(n is not None and (n.store, n.writer) == ("t_1.opledger_events", "a1b2c3")
               for n in read)
    assert [i for n in read if n is not None for i in n.operation_ids] == ids
    assert notice_payloads("s.t", "w", []) == []


def test_a_payload_in_no_such_form_says_only_that_someone_appended() -> None:
    # The library's own empty NOTIFY, and a release before the format.
    assert read_notice("") is None
    assert read_notice("host/op-1") is None
    assert read_notice("s.t w") is None
    assert read_notice(" w host/op-1") is None
    # The release before the store was named sent the IDs alone: not read as a store,
    # a writer and IDs (no operation ID holds a dot; a store always does).
    assert read_notice("host/op-1 host/op-2 host/op-3") is None
    assert notice_head("host/op-1 host/op-2 host/op-3") is None
    assert notice_head("s.t w host/op-1 x") == ("s.t", "w")


def test_tokens_that_are_no_operation_id_are_dropped_and_a_flood_of_them_is_refused() -> None:
    notice = read_notice("s.t w host/op-1 bad;id 'x' host/op-2 " + "é")
    assert notice == AppendNotice("s.t", "w", ("host/op-1", "host/op-2"))
    # More names than any append could fit in one payload: no append sent it.
    assert read_notice("s.t w " + " ".join("a" for _ in range(4000))) is None
    assert new_writer() != new_writer()
