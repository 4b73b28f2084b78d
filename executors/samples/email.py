"""Sample executor of `send_customer_email`, over a fake e-mail provider kept in SQLite.

The provider behaves like a real transactional mail API with idempotency keys:

- every call to `send` is recorded as a request, whatever became of it
  (`count_send_requests`): this is what shows whether an executor called the
  provider again, which the provider's own deduplication would otherwise hide;
- every accepted send is recorded (one row per send, one per message);
- a second send with the same key does not send again: it returns the first
  send's message IDs (and refuses a *different* message under a used key);
- a send can be looked up by key, which is what `reconcile` does.

It lives in a SQLite file named by the executor's secret `email_provider_db`
(`OPLEDGER_SECRET_EMAIL_PROVIDER_DB`), so two executor processes, and the
test that counts side effects with `count_sends` and `count_send_requests`,
share one provider.

- a send still in flight under a key is known as such (`in_progress`), the
  way a provider answers "409: a request with this key is in progress".

Test hooks:

- with `OPLEDGER_TEST_CRASH_AFTER_SEND=1` the process exits hard (status
  137, like SIGKILL) right after the provider recorded a new send and before
  any result is published or the work item acked. Redelivery must then
  converge on exactly one send.
- with `OPLEDGER_TEST_SEND_HANG_S=<seconds>` the provider hangs that long
  inside each new send (in progress, nothing sent yet) before it sends: past
  the contract's timeout, the call's outcome is unknown, and only the
  lookups after it can tell when it landed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from executors._api import Precondition, Reconciliation, ToolContext, ToolError, tool
from executors.samples._world import CUSTOMERS_OPTED_OUT, customer_address
from schemas import ErrorCategory

__all__ = [
    "CRASH_AFTER_SEND_ENV",
    "EMAIL_DB_SECRET",
    "SEND_HANG_ENV",
    "FakeEmailProvider",
    "IdempotencyKeyReused",
    "SendRecord",
    "count_messages",
    "count_send_requests",
    "count_sends",
    "send_customer_email",
]

EMAIL_DB_SECRET = "email_provider_db"
"""The secret naming the provider's SQLite file (`OPLEDGER_SECRET_EMAIL_PROVIDER_DB`)."""
CRASH_AFTER_SEND_ENV = "OPLEDGER_TEST_CRASH_AFTER_SEND"
"""Set to `1` to make the executor die right after a new send (tests only)."""
SEND_HANG_ENV = "OPLEDGER_TEST_SEND_HANG_S"
"""Set to a number of seconds to make each new send hang that long first (tests only)."""

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS sends ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
    " idempotency_key TEXT NOT NULL UNIQUE,"
    " request_hash TEXT NOT NULL,"
    " template TEXT NOT NULL,"
    " recipient_ids TEXT NOT NULL,"
    " rejected_recipient_ids TEXT NOT NULL,"
    " message_ids TEXT NOT NULL,"
    " sent_at TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS messages ("
    " message_id TEXT PRIMARY KEY,"
    " idempotency_key TEXT NOT NULL,"
    " recipient_id TEXT NOT NULL,"
    " address TEXT NOT NULL,"
    " subject TEXT NOT NULL,"
    " body TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS send_requests ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
    " idempotency_key TEXT NOT NULL,"
    " outcome TEXT NOT NULL,"  # sent, deduplicated or refused
    " requested_at TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS in_flight ("
    " idempotency_key TEXT PRIMARY KEY,"
    " started_at TEXT NOT NULL)",
    # Customers who unsubscribed at the provider: never sent to, whatever was approved.
    "CREATE TABLE IF NOT EXISTS suppressions ("
    " customer_id TEXT PRIMARY KEY,"
    " since TEXT NOT NULL)",
)
_REQUEST = "INSERT INTO send_requests (idempotency_key, outcome, requested_at) VALUES (?, ?, ?)"
_SUBJECTS = {
    "support_received": "We received your request {ticket_id}",
    "refund_review_requested": "Your refund for {order_id} is being reviewed",
    "order_shipped": "Your order {order_id} has shipped",
}


class IdempotencyKeyReused(Exception):
    """A used idempotency key came back with a different message."""


@dataclass(frozen=True, slots=True)
class SendRecord:
    """One send as the provider recorded it."""

    idempotency_key: str
    template: str
    recipient_ids: tuple[str, ...]
    rejected_recipient_ids: tuple[str, ...]
    message_ids: tuple[str, ...]
    sent_at: str
    created: bool = False
    """True only for the call that recorded it (not for a deduplicated repeat or a lookup)."""

    def as_output(self) -> dict[str, Any]:
        """The send as `send_customer_email` reports it."""
        return {
            "accepted_count": len(self.message_ids),
            "rejected_recipient_ids": list(self.rejected_recipient_ids),
            "provider_message_ids": list(self.message_ids),
        }


def _record(row: Sequence[Any], *, created: bool = False) -> SendRecord:
    key, template, recipients, rejected, message_ids, sent_at = row
    return SendRecord(
        idempotency_key=key,
        template=template,
        recipient_ids=tuple(json.loads(recipients)),
        rejected_recipient_ids=tuple(json.loads(rejected)),
        message_ids=tuple(json.loads(message_ids)),
        sent_at=sent_at,
        created=created,
    )


_COLUMNS = "idempotency_key, template, recipient_ids, rejected_recipient_ids, message_ids, sent_at"
_SELECT = f"SELECT {_COLUMNS} FROM sends WHERE idempotency_key = ?"
_SELECT_WITH_HASH = f"SELECT {_COLUMNS}, request_hash FROM sends WHERE idempotency_key = ?"


class FakeEmailProvider:
    """A transactional e-mail provider with idempotency keys, in one SQLite file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self._connection() as db:
            for statement in _SCHEMA:
                db.execute(statement)

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        # Autocommit mode plus explicit BEGIN IMMEDIATE: two processes sending
        # under one key serialize on the write lock, and the second sees the first.
        with closing(sqlite3.connect(self.path, timeout=30, isolation_level=None)) as db:
            yield db

    def send(
        self,
        *,
        idempotency_key: str,
        template: str,
        subject: str,
        body: str,
        recipients: Sequence[tuple[str, str]],
        rejected_recipient_ids: Sequence[str] = (),
        hang_s: float = 0.0,
    ) -> SendRecord:
        """Send one message to each (customer ID, address), once per idempotency key.

        `hang_s`: a hung provider (tests): the send is in flight that long first.
        """
        if hang_s > 0 and self.lookup(idempotency_key) is None:
            with self._connection() as db:
                db.execute(
                    "INSERT OR IGNORE INTO in_flight VALUES (?, ?)",
                    (idempotency_key, datetime.now(UTC).isoformat()),
                )
            time.sleep(hang_s)
        recipient_ids = [customer for customer, _ in recipients]
        request_hash = hashlib.sha256(
            json.dumps(
                [template, subject, body, list(recipients), list(rejected_recipient_ids)],
                sort_keys=True,
            ).encode()
        ).hexdigest()
        with self._connection() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                sent_at = datetime.now(UTC).isoformat()
                existing = db.execute(_SELECT_WITH_HASH, (idempotency_key,)).fetchone()
                if existing is not None:
                    reused = existing[-1] != request_hash
                    outcome = "refused" if reused else "deduplicated"
                    db.execute(_REQUEST, (idempotency_key, outcome, sent_at))
                    db.execute("COMMIT")
                    if reused:
                        raise IdempotencyKeyReused(idempotency_key)
                    return _record(existing[:-1])
                message_ids = [f"msg-{uuid.uuid4().hex}" for _ in recipients]
                db.execute(_REQUEST, (idempotency_key, "sent", sent_at))
                db.execute(
                    "INSERT INTO sends (idempotency_key, request_hash, template, recipient_ids,"
                    " rejected_recipient_ids, message_ids, sent_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        idempotency_key,
                        request_hash,
                        template,
                        json.dumps(recipient_ids),
                        json.dumps(list(rejected_recipient_ids)),
                        json.dumps(message_ids),
                        sent_at,
                    ),
                )
                db.executemany(
                    "INSERT INTO messages (message_id, idempotency_key, recipient_id, address,"
                    " subject, body) VALUES (?, ?, ?, ?, ?, ?)",
                    [
                        (message_id, idempotency_key, customer, address, subject, body)
                        for message_id, (customer, address) in zip(
                            message_ids, recipients, strict=True
                        )
                    ],
                )
                db.execute("DELETE FROM in_flight WHERE idempotency_key = ?", (idempotency_key,))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        return SendRecord(
            idempotency_key=idempotency_key,
            template=template,
            recipient_ids=tuple(recipient_ids),
            rejected_recipient_ids=tuple(rejected_recipient_ids),
            message_ids=tuple(message_ids),
            sent_at=sent_at,
            created=True,
        )

    def lookup(self, idempotency_key: str) -> SendRecord | None:
        """The send recorded under this key, if any."""
        with self._connection() as db:
            row = db.execute(_SELECT, (idempotency_key,)).fetchone()
        return None if row is None else _record(row)

    def suppress(self, customer_id: str) -> None:
        """The customer unsubscribed: no message goes to them from now on."""
        with self._connection() as db:
            db.execute(
                "INSERT OR IGNORE INTO suppressions VALUES (?, ?)",
                (customer_id, datetime.now(UTC).isoformat()),
            )

    def suppressed(self, customer_ids: Sequence[str]) -> frozenset[str]:
        """Which of these customers unsubscribed at the provider."""
        marks = ", ".join("?" * len(customer_ids))
        with self._connection() as db:
            rows = db.execute(
                f"SELECT customer_id FROM suppressions WHERE customer_id IN ({marks})",
                tuple(customer_ids),
            ).fetchall()
        return frozenset(str(row[0]) for row in rows)

    def in_progress(self, idempotency_key: str) -> bool:
        """Whether a send under this key has started and not yet finished."""
        with self._connection() as db:
            row = db.execute(
                "SELECT 1 FROM in_flight WHERE idempotency_key = ?", (idempotency_key,)
            ).fetchone()
        return row is not None


def _count(path: str | Path, table: str, operation_id: str | None) -> int:
    if not Path(path).exists():
        return 0
    query = f"SELECT COUNT(*) FROM {table}"  # table is one of our literals, never input
    parameters: tuple[str, ...] = ()
    if operation_id is not None:
        query += " WHERE idempotency_key = ?"
        parameters = (operation_id,)
    with closing(sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True, timeout=30)) as db:
        try:
            (count,) = db.execute(query, parameters).fetchone()
        except sqlite3.OperationalError:
            return 0  # no table yet: nothing was ever sent
    return int(count)


def count_sends(path: str | Path, operation_id: str | None = None) -> int:
    """How many sends the provider recorded (all, or under one operation's key)."""
    return _count(path, "sends", operation_id)


def count_send_requests(path: str | Path, operation_id: str | None = None) -> int:
    """How many times `send` was called (all, or under one operation's key), sent or not."""
    return _count(path, "send_requests", operation_id)


def count_messages(path: str | Path, operation_id: str | None = None) -> int:
    """How many messages (one per accepted recipient) the provider delivered."""
    return _count(path, "messages", operation_id)


# ------------------------------------------------------------------- the tool


def _render(arguments: Mapping[str, Any]) -> tuple[str, str]:
    template = str(arguments["template"])
    variables = dict(arguments.get("variables") or {})
    try:
        subject = _SUBJECTS[template].format(**variables)
    except (KeyError, IndexError):
        raise ToolError(
            ErrorCategory.INVALID_INPUT,
            "TEMPLATE_RENDER_FAILED",
            f"the variables do not fill template '{template}'",
        ) from None
    greeting = f"Hello {variables.get('display_name', 'customer')},"
    body = "\n\n".join(part for part in (greeting, arguments.get("body"), subject) if part)
    return subject, body


def _resolve(
    recipient_ids: Sequence[str], suppressed: frozenset[str] = frozenset()
) -> tuple[list[tuple[str, str]], list[str]]:
    """Addresses from the executor's own directory; opted-out customers (and those who
    unsubscribed at the provider, `suppressed`) are rejected."""
    unknown = [rid for rid in recipient_ids if customer_address(rid) is None]
    if unknown:
        raise ToolError(
            ErrorCategory.NOT_FOUND,
            "RECIPIENT_NOT_FOUND",
            "a recipient does not exist or is not visible",
            safe_details={"count": len(unknown)},
        )
    accepted: list[tuple[str, str]] = []
    rejected: list[str] = []
    for rid in recipient_ids:
        if rid in CUSTOMERS_OPTED_OUT or rid in suppressed:
            rejected.append(rid)
        else:
            address = customer_address(rid)
            assert address is not None
            accepted.append((rid, address))
    return accepted, rejected


def _provider(context: ToolContext) -> FakeEmailProvider:
    try:
        return FakeEmailProvider(context.secret(EMAIL_DB_SECRET))
    except sqlite3.Error:
        raise ToolError(
            ErrorCategory.TRANSIENT, "PROVIDER_UNAVAILABLE", "the mail provider is unavailable"
        ) from None


@tool("send_customer_email", version="1.0.0", required_secrets=(EMAIL_DB_SECRET,))
def send_customer_email(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
    """Render the template and send it to each recipient, keyed by the operation ID."""
    subject, body = _render(arguments)
    provider = _provider(context)
    accepted, rejected = _recipients(arguments, provider)
    if not accepted:
        raise ToolError(
            ErrorCategory.POLICY_DENIED,
            "RECIPIENT_OPTED_OUT",
            "every recipient has opted out of customer e-mail",
        )
    try:
        record = provider.send(
            idempotency_key=context.idempotency_key,
            template=str(arguments["template"]),
            subject=subject,
            body=body,
            recipients=accepted,
            rejected_recipient_ids=rejected,
            hang_s=float(os.environ.get(SEND_HANG_ENV) or 0),
        )
    except IdempotencyKeyReused:
        raise ToolError(
            ErrorCategory.CONFLICT,
            "DUPLICATE_SEND",
            "this operation already sent a different message",
        ) from None
    except sqlite3.Error:
        # The commit may or may not have happened: only a lookup can tell.
        raise ToolError(
            ErrorCategory.TRANSIENT,
            "PROVIDER_UNAVAILABLE",
            "the mail provider did not confirm the send",
            outcome_unknown=True,
        ) from None
    if record.created and os.environ.get(CRASH_AFTER_SEND_ENV) == "1":
        # The side effect exists; nothing about it has been published or acked.
        os._exit(137)
    return record.as_output()


def _recipients(
    arguments: Mapping[str, Any], provider: FakeEmailProvider
) -> tuple[list[tuple[str, str]], list[str]]:
    """Who a send reaches (customer ID, address) and who it does not, as of now: the
    send and its preview resolve them the same way, so the preview is what a send does."""
    recipient_ids = list(arguments["recipient_ids"])
    try:
        suppressed = provider.suppressed(recipient_ids)
    except sqlite3.Error:
        raise ToolError(
            ErrorCategory.TRANSIENT, "PROVIDER_UNAVAILABLE", "the mail provider is unavailable"
        ) from None
    return _resolve(recipient_ids, suppressed)


@send_customer_email.previewer
def _what_would_be_sent(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
    """The message as rendered and who receives it, resolved as a send would: no send."""
    subject, body = _render(arguments)
    accepted, rejected = _recipients(arguments, _provider(context))
    return {
        "summary": f"send {len(accepted)} e-mail(s): {subject}",
        "subject": subject,
        "body": body,
        "recipients": [{"customer_id": rid, "address": address} for rid, address in accepted],
        "not_sent_to": [
            {"customer_id": rid, "reason": "opted out of customer e-mail"} for rid in rejected
        ],
        "reversible": False,
    }


@send_customer_email.precondition
def _not_sent_yet(arguments: Mapping[str, Any], context: ToolContext) -> Precondition:
    record = _provider(context).lookup(context.idempotency_key)
    if record is not None:
        return Precondition.already_applied(record.as_output(), "already sent under this key")
    _resolve(list(arguments["recipient_ids"]))  # raises RECIPIENT_NOT_FOUND before any send
    return Precondition.ok()


@send_customer_email.reconciler
def _lookup_send(operation_id: str, context: ToolContext) -> Reconciliation:
    provider = _provider(context)
    record = provider.lookup(operation_id)
    if record is None and provider.in_progress(operation_id):
        # Neither sent nor not sent: "not applied" now could be wrong a moment later.
        return Reconciliation.unknown("a send under this key is still in progress")
    if record is None:
        return Reconciliation.not_applied("the provider has no send under this operation's key")
    return Reconciliation.applied(record.as_output())
