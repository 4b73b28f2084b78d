"""Small in-process fake backends for the sample executors: documents, orders, tickets.

They mirror `policy.catalog.sample_targets()` (tenant `acme`): the same
document IDs, revisions, lengths and snapshots, the same orders and
customers, so that a call the checker accepts also runs here. State lives in
this process only (the e-mail provider, which must be shared between
processes, is in `email.py`). `reset_world()` restores the initial state.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from typing import Any

__all__ = [
    "CUSTOMERS_OPTED_OUT",
    "Document",
    "Order",
    "Snapshot",
    "World",
    "customer_address",
    "reset_world",
    "world",
]

CUSTOMERS_OPTED_OUT = frozenset({"cus-0007"})
"""Customers who declined customer e-mail: sends to them are rejected, not delivered."""


def customer_address(customer_id: str) -> str | None:
    """The e-mail address of a known customer (the executor's own directory), else None.

    The model never proposes addresses; the executor resolves them here (seed 001).
    """
    if not customer_id.startswith("cus-"):
        return None
    digits = customer_id[4:]
    if not digits.isdigit():
        return None
    number = int(digits)
    if 1 <= number <= 600:
        return f"customer-{number:04d}@acme.example.test"
    return None


# -------------------------------------------------------------- documents


def _compose(sections: tuple[tuple[str, str], ...], length: int) -> tuple[str, dict[str, int]]:
    """The full text of sections, padded to `length`, and where each section starts."""
    parts: list[str] = []
    offsets: dict[str, int] = {}
    position = 0
    for section_id, text in sections:
        block = f"## {section_id}\n{text}\n\n"
        offsets[section_id] = position + len(f"## {section_id}\n")
        parts.append(block)
        position += len(block)
    body = "".join(parts)
    filler = "Appendix text kept for the record; it holds no further rules. "
    while len(body) < length:
        body += filler
    return body[:length], offsets


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A fixed revision of a document."""

    id: str
    document_id: str
    revision: str
    sequence: int
    sections: tuple[tuple[str, str], ...]
    length: int

    @property
    def text(self) -> str:
        """The snapshot's full text (exactly `length` characters)."""
        return _compose(self.sections, self.length)[0]

    def section_span(self, section_id: str) -> tuple[int, int] | None:
        """Character offsets of one section's text, if the snapshot has it."""
        _, offsets = _compose(self.sections, self.length)
        text = dict(self.sections).get(section_id)
        if text is None:
            return None
        start = offsets[section_id]
        return start, start + len(text)


@dataclass(frozen=True, slots=True)
class Document:
    """A document at its current revision; `snapshot` holds that revision's content."""

    id: str
    title: str
    source_type: str
    effective_date: date
    snapshot: Snapshot
    snapshot_ids: tuple[str, ...]
    tenant: str = "acme"
    """Whose document it is: only calls run for this tenant may see it."""

    @property
    def revision(self) -> str:
        """The current revision."""
        return self.snapshot.revision


_REFUND_V7 = (
    ("scope", "This policy covers refunds of physical goods bought in the Acme store."),
    ("refund-window", "Refunds are accepted within 14 days of delivery."),
    ("retention", "Refund records are kept for 5 years."),
    ("exceptions", "Digital goods are not refundable."),
)
_REFUND_V8 = (
    ("scope", "This policy covers refunds of physical goods bought in the Acme store."),
    ("refund-window", "Refunds are accepted within 30 days of delivery."),
    ("retention", "Refund records are kept for 5 years."),
    ("exceptions", "Digital goods and gift cards are not refundable."),
    ("partial-refunds", "A partial refund is possible when only part of an order is returned."),
)
_SHIPPING_V8 = (
    ("shipping-rules", "Orders ship within 2 business days. Shipping rules differ by region."),
    ("carriers", "Parcels go by national post or courier, chosen by weight."),
    ("delays", "Customers are told about any shipping delay longer than 3 days."),
)
_INCIDENT_V1 = (
    ("summary", "Payment outage on 2026-04-12: card payments failed for 47 minutes."),
    ("cause", "An expired certificate at the payment gateway."),
    ("follow-up", "Certificates are now renewed automatically 30 days before expiry."),
)
_FAQ_V3 = (
    ("refund-window", "How long is the refund window? 30 days after delivery."),
    (
        "effective-date",
        "2026 환불 정책 발효일: 2026-03-01. The 2026 refund policy applies from then.",
    ),
)


_GLOBEX_REFUNDS = (
    ("refund-window", "Globex refunds: the refund policy allows 60 days after delivery."),
)


def _documents() -> dict[str, Document]:
    snapshots = _snapshots()
    return {
        "document-a": Document(
            "document-a",
            "Refund policy",
            "policy",
            date(2026, 3, 1),
            snapshots["snap-a-8"],
            ("snap-a-7", "snap-a-8"),
        ),
        "document-b": Document(
            "document-b",
            "Shipping manual",
            "manual",
            date(2026, 2, 1),
            snapshots["snap-b-8"],
            ("snap-b-8",),
        ),
        "document-c": Document(
            "document-c",
            "Payment outage 2026-04",
            "incident",
            date(2026, 4, 12),
            snapshots["snap-c-1"],
            ("snap-c-1",),
        ),
        "document-d": Document(
            "document-d",
            "Refund FAQ",
            "faq",
            date(2026, 5, 1),
            snapshots["snap-d-3"],
            ("snap-d-3",),
        ),
        # Another tenant's: the same words, so a search that ignored the tenant finds it.
        "globex-refunds": Document(
            "globex-refunds",
            "Globex refund policy",
            "policy",
            date(2026, 1, 1),
            snapshots["snap-g-1"],
            ("snap-g-1",),
            tenant="globex",
        ),
    }


def _snapshots() -> dict[str, Snapshot]:
    # Lengths, revisions and sequences as in policy.catalog.sample_targets().
    return {
        snapshot.id: snapshot
        for snapshot in (
            Snapshot("snap-a-7", "document-a", "7", 7, _REFUND_V7, 47_200),
            Snapshot("snap-a-8", "document-a", "8", 8, _REFUND_V8, 48_000),
            Snapshot("snap-b-8", "document-b", "8", 8, _SHIPPING_V8, 12_500),
            Snapshot("snap-c-1", "document-c", "1", 1, _INCIDENT_V1, 3_000),
            Snapshot("snap-d-3", "document-d", "3", 3, _FAQ_V3, 2_000),
            Snapshot("snap-g-1", "globex-refunds", "1", 1, _GLOBEX_REFUNDS, 1_000),
        )
    }


# ----------------------------------------------------------------- orders


@dataclass(slots=True)
class Order:
    """One order; `refunded_cents` grows as refunds are requested."""

    id: str
    customer_id: str
    status: str
    currency: str
    amount_cents: int
    refunded_cents: int
    placed_at: datetime

    def as_output(self) -> dict[str, Any]:
        """The order as `query_orders` reports it."""
        return {
            "order_id": self.id,
            "status": self.status,
            "customer_id": self.customer_id,
            "amount_cents": self.amount_cents,
            "currency": self.currency,
            "placed_at": self.placed_at.isoformat().replace("+00:00", "Z"),
        }


def _orders() -> dict[str, Order]:
    base = datetime(2026, 1, 5, 9, 30, tzinfo=UTC)
    fixed = [
        Order("order-1001", "cus-0001", "delivered", "USD", 12_000, 2_000, base),
        Order("order-1002", "cus-0002", "paid", "EUR", 8_000, 0, base + timedelta(days=40)),
        Order("order-1003", "cus-0001", "refunded", "USD", 4_500, 4_500, base + timedelta(days=60)),
        Order("order-1004", "cus-0001", "delivered", "USD", 250_000, 0, base + timedelta(days=90)),
    ]
    statuses = ("pending", "paid", "shipped", "delivered", "cancelled")
    generated = [
        Order(
            f"order-{1100 + n}",
            f"cus-{(n % 5) + 1:04d}",
            statuses[n % len(statuses)],
            ("USD", "EUR", "GBP")[n % 3],
            1_000 + 750 * n,
            0,
            base + timedelta(days=3 * n, hours=n),
        )
        for n in range(30)
    ]
    return {order.id: order for order in fixed + generated}


# ---------------------------------------------------------------- the world


@dataclass(slots=True)
class World:
    """Every fake backend of this process, behind one lock."""

    documents: dict[str, Document] = field(default_factory=_documents)
    snapshots: dict[str, Snapshot] = field(default_factory=_snapshots)
    orders: dict[str, Order] = field(default_factory=_orders)
    refunds: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Idempotency key → refund record."""
    earlier_refunds: list[dict[str, Any]] = field(default_factory=lambda: [
        # The 20.00 already refunded on order-1001 (its `refunded_cents`), requested
        # before these executors ran: what a cancel of an older refund finds.
        {"refund_id": "rf-order-1001-1", "order_id": "order-1001", "amount_cents": 2000,
         "currency": "USD", "status": "requested"},
    ])
    cancellations: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Idempotency key → refund cancellation record."""
    tickets: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Idempotency key → ticket record."""
    deletions: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Idempotency key → deletion record."""
    lock: threading.RLock = field(default_factory=threading.RLock)

    def create_ticket(self, key: str, record: dict[str, Any]) -> dict[str, Any]:
        """Create a ticket once per idempotency key; a repeat returns the first ticket."""
        with self.lock:
            existing = self.tickets.get(key)
            if existing is not None:
                return existing
            stored = {**record, "ticket_id": f"TCK-{len(self.tickets) + 1001}"}
            self.tickets[key] = stored
            return stored

    def request_refund(
        self, key: str, order_id: str, amount_cents: int, currency: str
    ) -> dict[str, Any]:
        """Record a refund once per idempotency key and book it on the order."""
        with self.lock:
            existing = self.refunds.get(key)
            if existing is not None:
                return existing
            order = self.orders[order_id]
            order.refunded_cents += amount_cents
            record = {
                "refund_id": f"rf-{uuid.uuid4().hex[:16]}",
                "order_id": order_id,
                "amount_cents": amount_cents,
                "currency": currency,
                "status": "pending_review" if amount_cents > 50_000 else "requested",
            }
            self.refunds[key] = record
            return record

    def cancel_refund(self, key: str, refund_id: str, order_id: str) -> dict[str, Any] | None:
        """Take a requested refund back once per idempotency key (the order's refundable
        amount grows again); None when this backend holds no such refund."""
        with self.lock:
            existing = self.cancellations.get(key)
            if existing is not None:
                return existing
            refund = next(
                (r for r in (*self.refunds.values(), *self.earlier_refunds)
                 if r["refund_id"] == refund_id and r["order_id"] == order_id),
                None,
            )
            if refund is None:
                return None
            cancelled = refund["status"] != "cancelled"
            if cancelled:
                self.orders[order_id].refunded_cents -= int(refund["amount_cents"])
                refund["status"] = "cancelled"
            record = {"refund_id": refund_id, "cancelled": cancelled}
            self.cancellations[key] = record
            return record

    def delete_document(self, key: str, document_id: str) -> dict[str, Any]:
        """Delete a document and its snapshots once per idempotency key."""
        with self.lock:
            existing = self.deletions.get(key)
            if existing is not None:
                return existing
            document = self.documents.pop(document_id)
            removed = [sid for sid in document.snapshot_ids if self.snapshots.pop(sid, None)]
            record = {
                "document_id": document_id,
                "deleted_revision": document.revision,
                "deleted_snapshot_count": len(removed),
            }
            self.deletions[key] = record
            return record

    def set_revision(self, document_id: str, revision: str) -> None:
        """Move a document to a new revision (tests: the target changed after approval)."""
        with self.lock:
            document = self.documents[document_id]
            snapshot = replace(document.snapshot, revision=revision)
            self.documents[document_id] = replace(document, snapshot=snapshot)


_WORLD = World()


def world() -> World:
    """This process's fake backends."""
    return _WORLD


def reset_world() -> World:
    """Restore the initial state (for tests and demos); returns the fresh world."""
    global _WORLD
    _WORLD = World()
    return _WORLD
