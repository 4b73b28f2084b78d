"""The fake e-mail provider: idempotency keys, counting, lookup, and the crash hook."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from executors import ItemAction, ItemProcessor, ProcessorOptions
from executors.samples.email import (
    CRASH_AFTER_SEND_ENV,
    EMAIL_DB_SECRET,
    FakeEmailProvider,
    IdempotencyKeyReused,
    SendRecord,
    count_messages,
    count_send_requests,
    count_sends,
    send_customer_email,
)
from schemas import LeaseDecision
from tests.executors.helpers import FakeLedger, contract, process, reply, work_item

RECIPIENTS = [("cus-0001", "a@example.test"), ("cus-0002", "b@example.test")]


def _send(provider: FakeEmailProvider, key: str, body: str = "hello") -> SendRecord:
    return provider.send(
        idempotency_key=key,
        template="support_received",
        subject="We received your request TCK-1",
        body=body,
        recipients=RECIPIENTS,
    )


def test_a_send_is_recorded_once_per_key(tmp_path: Path) -> None:
    db = tmp_path / "mail.db"
    provider = FakeEmailProvider(db)
    first = provider.send(
        idempotency_key="op-1",
        template="support_received",
        subject="s",
        body="b",
        recipients=RECIPIENTS,
        rejected_recipient_ids=["cus-0007"],
    )
    again = provider.send(
        idempotency_key="op-1",
        template="support_received",
        subject="s",
        body="b",
        recipients=RECIPIENTS,
        rejected_recipient_ids=["cus-0007"],
    )
    assert first.created
    assert not again.created
    assert again.message_ids == first.message_ids
    assert len(first.message_ids) == 2
    assert count_sends(db) == 1
    assert count_sends(db, "op-1") == 1
    assert count_messages(db) == 2
    assert count_send_requests(db, "op-1") == 2  # the repeat was a call, not a send
    assert first.as_output() == {
        "accepted_count": 2,
        "rejected_recipient_ids": ["cus-0007"],
        "provider_message_ids": list(first.message_ids),
    }


def test_different_keys_are_different_sends(tmp_path: Path) -> None:
    db = tmp_path / "mail.db"
    provider = FakeEmailProvider(db)
    one = _send(provider, "op-1")
    two = _send(provider, "op-2")
    assert count_sends(db) == 2
    assert count_sends(db, "op-1") == 1
    assert count_sends(db, "op-3") == 0
    assert count_messages(db, "op-2") == 2
    assert one != two


def test_a_used_key_with_another_message_is_refused(tmp_path: Path) -> None:
    provider = FakeEmailProvider(tmp_path / "mail.db")
    _send(provider, "op-1", body="first")
    with pytest.raises(IdempotencyKeyReused):
        _send(provider, "op-1", body="second")
    assert count_sends(tmp_path / "mail.db") == 1
    assert count_send_requests(tmp_path / "mail.db") == 2


def test_lookup_by_key(tmp_path: Path) -> None:
    provider = FakeEmailProvider(tmp_path / "mail.db")
    assert provider.lookup("op-1") is None
    sent = _send(provider, "op-1")
    found = provider.lookup("op-1")
    assert found is not None
    assert found.message_ids == sent.message_ids
    assert not found.created
    # A second provider object on the same file (another process) sees it too.
    assert FakeEmailProvider(tmp_path / "mail.db").lookup("op-1") == found


def test_counting_a_provider_that_never_existed_is_zero(tmp_path: Path) -> None:
    assert count_sends(tmp_path / "absent.db") == 0
    assert not (tmp_path / "absent.db").exists()


def test_concurrent_sends_under_one_key_deliver_once(tmp_path: Path) -> None:
    db = tmp_path / "mail.db"
    FakeEmailProvider(db)
    results: list[SendRecord] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        provider = FakeEmailProvider(db)
        barrier.wait()
        results.append(_send(provider, "op-race"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert count_sends(db) == 1
    assert count_messages(db) == 2
    assert count_send_requests(db, "op-race") == 8
    assert sum(1 for r in results if r.created) == 1
    assert len({r.message_ids for r in results}) == 1


_CRASHING_EXECUTOR = textwrap.dedent(
    """
    import asyncio, sys
    from executors import ItemProcessor, ProcessorOptions
    from executors.samples.email import send_customer_email
    from schemas import LeaseDecision
    from tests.executors.helpers import FakeLedger, contract, process, reply, work_item

    db = sys.argv[1]
    arguments = {"recipient_ids": ["cus-0001"], "template": "support_received",
                 "variables": {"ticket_id": "TCK-7"}}
    processor = ItemProcessor(send_customer_email, contract("send_customer_email"),
                              ProcessorOptions("exec-a", secrets={"email_provider_db": db}))
    ledger = FakeLedger(reply(LeaseDecision.EXECUTE, "op-crash", "send_customer_email",
                              arguments=arguments, fencing_token=1, attempt=1))
    process(processor, work_item("op-crash", "send_customer_email"), ledger)
    print("survived")
    """
)


def test_crash_after_send_then_redelivery_converges_on_one_send(tmp_path: Path) -> None:
    db = tmp_path / "mail.db"
    env = {**os.environ, CRASH_AFTER_SEND_ENV: "1"}
    done = subprocess.run(
        [sys.executable, "-c", _CRASHING_EXECUTOR, str(db)],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 137, done.stderr
    assert "survived" not in done.stdout
    assert count_sends(db, "op-crash") == 1
    first = FakeEmailProvider(db).lookup("op-crash")
    assert first is not None

    processor = ItemProcessor(
        send_customer_email,
        contract("send_customer_email"),
        ProcessorOptions("exec-b", secrets={EMAIL_DB_SECRET: str(db)}),
    )
    arguments = {
        "recipient_ids": ["cus-0001"],
        "template": "support_received",
        "variables": {"ticket_id": "TCK-7"},
    }
    # The ledger may lease it again (an idempotent retry) ...
    again = process(
        processor,
        work_item("op-crash", "send_customer_email", attempt=2),
        FakeLedger(
            reply(
                LeaseDecision.EXECUTE,
                "op-crash",
                "send_customer_email",
                arguments=arguments,
                fencing_token=2,
                attempt=2,
            )
        ),
        delivery=2,
    )
    # ... or ask to reconcile; both report the first send and send nothing new.
    settled = process(
        processor,
        work_item("op-crash", "send_customer_email"),
        FakeLedger(
            reply(LeaseDecision.RECONCILE, "op-crash", "send_customer_email", fencing_token=2)
        ),
        delivery=3,
    )
    for disposition in (again, settled):
        assert disposition.action is ItemAction.PUBLISH
        assert disposition.envelope is not None
        assert disposition.envelope.ok
        assert disposition.envelope.data is not None
        assert disposition.envelope.data["provider_message_ids"] == list(first.message_ids)
    assert again.reason == "already_applied"
    assert settled.reason == "reconciled"
    assert count_sends(db) == 1
    assert count_messages(db) == 1
    # Neither the retry nor the reconciliation called the provider again.
    assert count_send_requests(db, "op-crash") == 1
