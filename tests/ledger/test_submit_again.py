"""A proposal sent again under an ID stored long ago, on both backends.

The submission's fast path does not ask the database which IDs of a batch exist
(a new proposal's ID is new); an ID stored before, and no longer in this
process's cache, is caught by the append itself. These tests hold that path to
the answers the lookup gave: the same call again converges on the stored
operation, another call under that ID is a conflict for its sender alone, and
the new proposals of the same batch are stored exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ledger import StorageConfig
from ledger.domain.errors import LedgerError, OperationConflict
from ledger.service import Submission
from tests.ledger.helpers import ALICE, email, make_ledger, search


def test_an_old_id_in_a_batch_converges_and_the_new_ones_are_stored_once(
    storage: StorageConfig,
) -> None:
    earlier = make_ledger(storage)
    stored = earlier.submit(search("op-old"), ALICE, "host-a")
    stored_events = [type(event).__name__ for event in earlier.history(stored.operation_id)]
    earlier.close()
    # Another instance (or this one, long after): it has no copy of op-old.
    ledger = make_ledger(storage)
    assert ledger.runner.cached(stored.operation_id) is None
    answers = ledger.submissions.submit_many(
        [
            (search("op-new-1"), ALICE, "host-a"),
            (search("op-old"), ALICE, "host-a"),  # the same call again
            (email("op-old"), ALICE, "host-a"),  # another call under the same ID
            (search("op-new-2"), ALICE, "host-a"),
        ]
    )
    new_1, again, conflict, new_2 = answers
    assert isinstance(again, Submission) and not again.created
    assert again.operation_id == stored.operation_id and again.state == stored.state
    assert isinstance(conflict, OperationConflict)
    for answer in (new_1, new_2):
        assert isinstance(answer, Submission) and answer.created
    # The old operation untouched; the new ones stored once each.
    assert [type(e).__name__ for e in ledger.history(stored.operation_id)] == stored_events
    for answer in (new_1, new_2):
        assert isinstance(answer, Submission)
        history = ledger.history(answer.operation_id)
        assert type(history[0]).__name__ == "Proposed"
        assert sum(type(event).__name__ == "Proposed" for event in history) == 1


def test_the_same_call_again_while_cached_appends_nothing(storage: StorageConfig) -> None:
    ledger = make_ledger(storage)
    first = ledger.submit(search("op-1"), ALICE, "host-a")
    before = len(ledger.history(first.operation_id))
    again = ledger.submissions.submit_many([(search("op-1"), ALICE, "host-a")])[0]
    assert isinstance(again, Submission) and not again.created
    assert len(ledger.history(first.operation_id)) == before
    refused = ledger.submissions.submit_many([(email("op-1"), ALICE, "host-a")])[0]
    assert isinstance(refused, LedgerError) and isinstance(refused, OperationConflict)


class _Counting:
    """Counts the calls of a real method it stands in front of (nothing is faked)."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self._method = method
        self.calls = 0
        self.failures = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        try:
            return self._method(*args, **kwargs)
        except Exception:
            self.failures += 1
            raise


def test_new_proposals_are_stored_without_asking_which_ids_exist(storage: StorageConfig) -> None:
    ledger = make_ledger(storage)
    lookups = _Counting(ledger.runner.tables.stored_ids)
    ledger.runner.tables.stored_ids = lookups  # type: ignore[method-assign]
    answers = ledger.submissions.submit_many(
        [(search(f"op-{n}"), ALICE, "host-a") for n in range(5)]
    )
    assert all(isinstance(answer, Submission) and answer.created for answer in answers)
    assert lookups.calls == 0


def test_after_an_old_id_the_next_batches_ask_first_instead_of_failing_again(
    storage: StorageConfig,
) -> None:
    """A host resending old IDs costs one failed append, not one per batch: for a while
    after it, batches look the IDs up first, as before the fast path."""
    earlier = make_ledger(storage)
    for n in range(3):
        earlier.submit(search(f"op-old-{n}"), ALICE, "host-a")
    earlier.close()
    ledger = make_ledger(storage)
    appends = _Counting(ledger.runner.events.events.put)
    ledger.runner.events.events.put = appends  # type: ignore[method-assign]
    for n in range(3):
        answers = ledger.submissions.submit_many(
            [(search(f"op-new-{n}"), ALICE, "host-a"), (search(f"op-old-{n}"), ALICE, "host-a")]
        )
        fresh, again = answers
        assert isinstance(fresh, Submission) and fresh.created
        assert isinstance(again, Submission) and not again.created
    assert appends.failures == 1  # the first batch only
    assert appends.calls == 4  # its failed try, then one append per batch
