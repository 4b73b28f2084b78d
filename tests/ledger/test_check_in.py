"""A running executor's check-in (`LeaseRequest.holding`): read only, scoped to its
tool, and the way a cancel reaches it. Both backends.

Found in review: the ledger side had no test; only the executor's fakes used it.
"""

from __future__ import annotations

import pytest

from ledger import OperationNotFound, StorageConfig
from schemas import LeaseDecision
from tests.ledger.helpers import ALICE, make_ledger, search


def test_a_check_in_appends_nothing_and_says_go_on_cancel_or_done(
    storage: StorageConfig,
) -> None:
    ledger = make_ledger(storage)
    ledger.submit(search("op-ci"), ALICE)
    token = ledger.lease("op-ci", executor="exec-1").fencing_token
    assert token is not None
    version = ledger.get("op-ci").version
    check_in = ledger.leasing.check_in
    assert check_in("op-ci", tool="search_documents", holding=token).decision is (
        LeaseDecision.EXECUTE
    )
    assert check_in("op-ci", tool="search_documents", holding=token + 1).decision is (
        LeaseDecision.DONE  # not the lease it holds
    )
    with pytest.raises(OperationNotFound):  # another tool's executor: as if no such ID
        check_in("op-ci", tool="send_customer_email", holding=token)
    assert ledger.get("op-ci").version == version  # nothing appended by any of them
    ledger.cancel("op-ci", by="host:h1")
    reply = check_in("op-ci", tool="search_documents", holding=token)
    assert reply.decision is LeaseDecision.CANCEL and reply.fencing_token == token
