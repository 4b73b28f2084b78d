"""Operations another instance wrote are read for a batch in one query (`CommandRunner.load`),
on both backends: the same state a replay gives, and answers as if each were replayed."""

from __future__ import annotations

from typing import Any

import pytest

from ledger import StorageConfig
from ledger.domain.errors import LedgerError
from schemas import LeaseDecision, LeaseReply
from tests.ledger.helpers import ALICE, make_ledger, search


class _Counting:
    """Counts the reads of one method of an object, passing each through."""

    def __init__(self, target: Any, name: str) -> None:
        self.calls = 0
        original = getattr(target, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        setattr(target, name, counted)


def test_a_batch_on_operations_another_instance_wrote_reads_them_in_one_query(
    storage: StorageConfig,
) -> None:
    writer, other = make_ledger(storage), make_ledger(storage)
    ids = [f"op-load-{n}" for n in range(6)]
    for operation_id in ids:
        writer.submit(search(operation_id), ALICE)
    writer.lease(ids[0], executor="exec-1")  # another lease on it is busy, not granted

    assert all(other.runner.cached(operation_id) is None for operation_id in ids)
    queries = _Counting(other.runner.tables, "events_of")
    replays = _Counting(other.runner, "get")
    answers = other.leasing.lease_many(
        [(operation_id, "exec-2", "search_documents") for operation_id in ids]
        + [("op-load-unknown", "exec-2", "search_documents")]
    )
    assert queries.calls == 1
    # Only the unknown one is asked on its own (and is not found); nothing read is
    # checked again, though the busy answer appended nothing.
    assert replays.calls == 1
    assert isinstance(answers[-1], LedgerError)
    leases = [answer for answer in answers[:-1] if isinstance(answer, LeaseReply)]
    assert [lease.decision for lease in leases] == [LeaseDecision.BUSY] + [
        LeaseDecision.EXECUTE
    ] * 5
    # What the batch decided is stored, and what it read is the stored state.
    for operation_id in ids:
        assert writer.runner.get(operation_id).version == 4
        assert other.runner.cached(operation_id) is not None
        assert other.runner.cached(operation_id).version == 4  # type: ignore[union-attr]
    writer.close()
    other.close()


def test_load_gives_what_a_replay_gives_and_leaves_out_what_cannot_be_read(
    storage: StorageConfig,
) -> None:
    writer, other = make_ledger(storage), make_ledger(storage)
    for operation_id in ("op-same-0", "op-same-1", "op-same-2"):
        writer.submit(search(operation_id), ALICE)
    writer.lease("op-same-1", executor="exec-1")
    loaded = other.runner.load(["op-same-0", "op-same-1", "op-same-2", "op-same-none"])
    assert sorted(loaded) == ["op-same-0", "op-same-1", "op-same-2"]
    for operation_id, operation in loaded.items():
        replayed = writer.runner.get(operation_id)
        assert (operation.version, operation.state, operation.head_hash) == (
            replayed.version, replayed.state, replayed.head_hash
        )
        assert operation.history_bytes == replayed.history_bytes
    # An operation whose stored events cannot be read (a row written by hand) is left
    # out, for `get` to report on its own: it does not cost the others their read.
    table = other.runner.tables.tables.events_table
    other.db.execute(
        f"INSERT INTO {table} (originator_id, originator_version, topic, state)"
        " VALUES (?, 1, ?, ?)",
        ("op-same-bad", "ledger.domain.operation:Operation.Proposed", b"{}"),
    )
    other.runner.evict(["op-same-0", "op-same-1"])
    assert sorted(other.runner.load(["op-same-0", "op-same-bad", "op-same-1"])) == [
        "op-same-0", "op-same-1"
    ]
    # Copies held already, or a single one, are left to the cache and to `get`.
    assert other.runner.load(["op-same-0", "op-same-1"]) == {}
    assert other.runner.load(["op-same-none"]) == {}
    writer.close()
    other.close()


@pytest.mark.parametrize("held", [False, True], ids=["unheld", "held"])
def test_a_status_batch_of_the_relay_reads_unheld_operations_in_one_query(
    storage: StorageConfig, held: bool
) -> None:
    writer, other = make_ledger(storage), make_ledger(storage)
    ids = [f"op-status-{n}-{held}" for n in range(4)]
    for operation_id in ids:
        writer.submit(search(operation_id), ALICE)
    if held:
        other.runner.load(ids)
    queries = _Counting(other.runner.tables, "events_of")
    replays = _Counting(other.runner, "get")
    other.status_reader.prefetch(ids)
    states = [other.status_reader.status(i, known_version=3).state for i in ids]
    assert states == ["ready"] * 4
    assert (queries.calls, replays.calls) == ((0, 0) if held else (1, 0))
    # Read for these statuses only: the copies commands use are not crowded out.
    assert held or all(other.runner.cached(i) is None for i in ids)
    writer.close()
    other.close()
