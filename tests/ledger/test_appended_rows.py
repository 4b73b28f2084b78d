"""The relay takes this process's appended rows without reading them back, and still
never skips or repeats a row (`ledger.server.relay.AppendedRows`), on both backends.

The attacks: another writer's rows between ours, a row written by hand, positions a
failed transaction used up, a relay that does not read for a long time, and writers
on other threads appending while the relay follows the log.
"""

from __future__ import annotations

import threading
import time

import pytest
from eventsourcing.persistence import IntegrityError, StoredEvent

from ledger import Ledger, StorageConfig
from ledger.adapters.event_tables import StoredRow
from ledger.server.relay import AppendedRows
from tests.ledger.helpers import ALICE, make_ledger, search


def _listening(ledger: Ledger, kept: int = 2_000) -> AppendedRows:
    appended = AppendedRows(ledger.stored_rows_after, kept=kept)
    ledger.runner.on_stored(appended.add)
    return appended


def _follow(appended: AppendedRows, position: int, limit: int = 500) -> list[StoredRow]:
    """Every row after `position`, as the relay takes them (batch by batch)."""
    taken: list[StoredRow] = []
    while rows := appended.rows_after(position, limit):
        taken.extend(rows)
        position = rows[-1][0]
    return taken


def _table(ledger: Ledger) -> list[StoredRow]:
    return list(ledger.stored_rows_after(0, 1_000_000))


def _submit(ledger: Ledger, *operation_ids: str) -> None:
    for operation_id in operation_ids:
        ledger.submit(search(operation_id), ALICE)


def test_the_rows_handed_over_are_the_rows_stored(storage: StorageConfig) -> None:
    # Served without a read, and exactly as a read of the table gives them: same
    # positions, IDs, versions, topics and state bytes.
    ledger = make_ledger(storage)
    appended = _listening(ledger)
    _submit(ledger, "op-1", "op-2", "op-3")
    grant = ledger.lease("op-2", executor="exec-1")
    assert grant.fencing_token is not None

    taken = _follow(appended, 0)

    assert taken == _table(ledger)
    assert (appended.served, appended.reads) == (len(taken), 1)  # the read that found the end
    assert [type(value) for value in taken[0]] == [int, str, int, str, bytes]


def test_another_writers_rows_between_ours_are_read_not_skipped(storage: StorageConfig) -> None:
    # Two instances on one database: the relay's instance holds its own rows, but
    # the other one's lie between them. They are read, in order, once each.
    ours, theirs = make_ledger(storage), make_ledger(storage)
    appended = _listening(ours)
    _submit(ours, "op-1")
    _submit(theirs, "op-2")
    _submit(ours, "op-3")

    taken = _follow(appended, 0)

    assert taken == _table(ours)
    assert any(row[1].endswith("op-2") for row in taken)  # theirs, between ours
    assert appended.reads == 2  # the gap, then the end


def test_another_writers_rows_after_what_was_taken_are_read(storage: StorageConfig) -> None:
    # The same, once the relay has taken our first rows.
    ours, theirs = make_ledger(storage), make_ledger(storage)
    appended = _listening(ours)
    _submit(ours, "op-1")
    first = _follow(appended, 0)
    _submit(theirs, "op-2")
    _submit(ours, "op-3")

    taken = _follow(appended, first[-1][0])

    assert first + taken == _table(ours)
    assert any(row[1].endswith("op-2") for row in taken)
    assert appended.reads == 3  # the end once, then the gap, then the end again


def test_a_row_written_by_hand_between_ours_is_read(storage: StorageConfig) -> None:
    ledger = make_ledger(storage)
    appended = _listening(ledger)
    _submit(ledger, "op-1")
    stored = _table(ledger)[-1]
    ledger.db.execute(
        f"INSERT INTO {ledger.events_table} (originator_id, originator_version, topic, state)"
        " VALUES (?, ?, ?, ?)",
        ("forged", 1, stored[3], stored[4]),
    )
    _submit(ledger, "op-2")

    taken = _follow(appended, 0)

    assert taken == _table(ledger)
    assert "forged" in {row[1] for row in taken}


def test_positions_a_failed_append_used_up_are_no_hole_in_what_is_taken(
    storage: StorageConfig,
) -> None:
    # A lost race (a duplicate version) is refused after PostgreSQL's sequence gave
    # out its positions: the next append's rows do not follow the last ones. (Another
    # writer's event: the same bytes would be this append's own, stored already.)
    ledger = make_ledger(storage)
    appended = _listening(ledger)
    _submit(ledger, "op-1")
    recorder = ledger.runner.events.events.recorder
    stored = _table(ledger)[0]
    with pytest.raises(IntegrityError):
        recorder.insert_events([StoredEvent(stored[1], stored[2], stored[3], b"another")])
    _submit(ledger, "op-2")

    assert _follow(appended, 0) == _table(ledger)


def test_a_relay_that_does_not_take_them_keeps_a_bounded_number(
    storage: StorageConfig,
) -> None:
    # Another instance relays (or the relay is stopped): the rows are not taken.
    # They are dropped past the bound, and the relay, once it follows, reads them.
    ledger = make_ledger(storage)
    appended = _listening(ledger, kept=10)
    _submit(ledger, *(f"op-{n}" for n in range(8)))  # three or four rows each

    assert appended.kept[0] <= 10
    assert _follow(appended, 0) == _table(ledger)


def test_the_rows_kept_are_bounded_in_bytes(storage: StorageConfig) -> None:
    # A proposal's arguments may be large: the rows kept are bounded by their
    # states' bytes as well as by their count; the relay then reads them.
    ledger = make_ledger(storage)
    appended = _listening(ledger)
    bounded = AppendedRows(ledger.stored_rows_after, kept_bytes=4_000)
    ledger.runner.on_stored(bounded.add)
    _submit(ledger, *(f"op-{n}" for n in range(8)))

    assert appended.kept[1] > 4_000  # what the count alone would have kept
    assert 0 < bounded.kept[1] <= 4_000
    assert _follow(bounded, 0) == _table(ledger)


def test_writers_on_other_threads_while_the_relay_follows(storage: StorageConfig) -> None:
    # Two instances, each writing on a thread of its own, append while a follower on
    # a third takes rows in batches of 7: it ends with every row of the table, once
    # each, in position order, whatever came from memory and whatever was read.
    ours, theirs = make_ledger(storage), make_ledger(storage)
    appended = _listening(ours)
    done = threading.Event()
    failures: list[BaseException] = []
    taken: list[StoredRow] = []

    def write(ledger: Ledger, prefix: str) -> None:
        try:
            for n in range(40):
                ledger.submit(search(f"{prefix}-{n}"), ALICE)
        except BaseException as exc:  # reported below
            failures.append(exc)

    def follow() -> None:
        position = 0
        while True:
            finished = done.is_set()
            rows = appended.rows_after(position, 7)
            taken.extend(rows)
            if rows:
                position = rows[-1][0]
            elif finished:
                return
            time.sleep(0.005)  # so that appends of both instances pile up between turns

    writers = [
        threading.Thread(target=write, args=(ledger, prefix))
        for ledger, prefix in ((ours, "a"), (theirs, "b"))
    ]
    follower = threading.Thread(target=follow)
    follower.start()
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    done.set()
    follower.join()

    assert failures == []
    table = _table(ours)
    assert len({row[1] for row in table}) == 80  # every proposal stored
    assert taken == table  # how much came from memory depends on the threads' timing
