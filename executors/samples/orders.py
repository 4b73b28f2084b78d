"""Sample executors of the order tools: `query_orders` (a read) and `request_refund` (a payout).

`request_refund` shows the full write discipline: re-check the order right
before paying (it may have been refunded by someone else since approval),
pass the operation ID as idempotency key, and answer reconciliation from
the payment backend's own record.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import date
from typing import Any

from executors._api import Precondition, Reconciliation, ToolContext, ToolError, tool
from executors.samples._world import Order, customer_address, world
from schemas import ErrorCategory

__all__ = ["cancel_refund", "query_orders", "request_refund"]

_MAX_PAGE = 1_000
_REFUNDABLE = frozenset({"paid", "shipped", "delivered"})
_SORTS = {
    "placed_at_desc": (lambda order: order.placed_at, True),
    "placed_at_asc": (lambda order: order.placed_at, False),
    "amount_desc": (lambda order: order.amount_cents, True),
}


@tool("query_orders", version="1.3.0")
def query_orders(arguments: Mapping[str, Any], _context: ToolContext) -> dict[str, Any]:
    """Orders matching the filters, sorted, at most `limit` (and one page) of them."""
    customer_id = arguments.get("customer_id")
    if customer_id is not None and customer_address(str(customer_id)) is None:
        raise ToolError(
            ErrorCategory.NOT_FOUND, "CUSTOMER_NOT_FOUND", "no such customer is visible"
        )
    status = arguments.get("status")
    after = arguments.get("placed_after")
    before = arguments.get("placed_before")
    after_day = date.fromisoformat(after) if isinstance(after, str) else None
    before_day = date.fromisoformat(before) if isinstance(before, str) else None

    def wanted(order: Order) -> bool:
        placed = order.placed_at.date()
        return (
            (status is None or order.status == status)
            and (customer_id is None or order.customer_id == customer_id)
            and (after_day is None or placed >= after_day)
            and (before_day is None or placed < before_day)
        )

    with world().lock:
        matching = [order for order in world().orders.values() if wanted(order)]
        key, descending = _SORTS[str(arguments.get("sort", "placed_at_desc"))]
        matching.sort(key=lambda order: order.id)
        matching.sort(key=key, reverse=descending)
        # One page at most, whatever the limit: a bulk export pages through cursors.
        page = min(int(arguments.get("limit", 50)), _MAX_PAGE)
        orders = [order.as_output() for order in matching[:page]]
    truncated = len(matching) > page
    return {
        "orders": orders,
        "truncated": truncated,
        "next_cursor": f"offset-{page}" if truncated else None,
    }


@tool("request_refund", version="1.0.0")
def request_refund(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
    """Book the refund at the fake payment backend, once per idempotency key."""
    return dict(
        world().request_refund(
            context.idempotency_key,
            str(arguments["order_id"]),
            int(arguments["amount_cents"]),
            str(arguments["currency"]),
        )
    )


@tool("cancel_refund", version="1.0.0")
def cancel_refund(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
    """Take a requested refund back at the fake payment backend (request_refund's
    compensation), once per idempotency key."""
    record = world().cancel_refund(
        context.idempotency_key, str(arguments["refund_id"]), str(arguments["order_id"])
    )
    if record is None:
        raise ToolError(ErrorCategory.NOT_FOUND, "REFUND_NOT_FOUND",
                        "this payment backend holds no such refund of this order")
    return dict(record)


@request_refund.precondition
def _refund_still_possible(arguments: Mapping[str, Any], context: ToolContext) -> Precondition:
    with world().lock:
        done = world().refunds.get(context.idempotency_key)
        if done is not None:
            return Precondition.already_applied(done, "this operation's refund already exists")
        order = world().orders.get(str(arguments["order_id"]))
        if order is None:
            raise ToolError(ErrorCategory.NOT_FOUND, "ORDER_NOT_FOUND", "no such order is visible")
        if order.status not in _REFUNDABLE:
            raise ToolError(
                ErrorCategory.POLICY_DENIED,
                "ORDER_NOT_REFUNDABLE",
                f"an order in status '{order.status}' cannot be refunded",
            )
        if order.currency != arguments["currency"]:
            raise ToolError(
                ErrorCategory.INVALID_INPUT,
                "CURRENCY_MISMATCH",
                "the refund must be in the order's currency",
            )
        remaining = order.amount_cents - order.refunded_cents
    if int(arguments["amount_cents"]) > remaining:
        # It fitted when checked and approved: another refund happened since.
        return Precondition.stale(
            "the order's refundable amount changed after approval", code="ORDER_CHANGED"
        )
    return Precondition.ok()


def _money(cents: int, currency: str) -> str:
    return f"{cents // 100}.{cents % 100:02d} {currency}"


@request_refund.previewer
def _what_would_be_refunded(arguments: Mapping[str, Any], _context: ToolContext) -> dict[str, Any]:
    """The payout as the backend would book it, against the order as it stands: no booking."""
    amount, currency = int(arguments["amount_cents"]), str(arguments["currency"])
    with world().lock:
        order = world().orders.get(str(arguments["order_id"]))
        if order is None:
            raise ToolError(ErrorCategory.NOT_FOUND, "ORDER_NOT_FOUND", "no such order is visible")
        remaining = order.amount_cents - order.refunded_cents
        status, customer, total = order.status, order.customer_id, order.amount_cents
    return {
        "summary": f"refund {_money(amount, currency)} of {order.id} to customer {customer}",
        "amount": _money(amount, currency),
        "order_total": _money(total, order.currency),
        "refundable_before": _money(remaining, order.currency),
        "refundable_after": _money(max(remaining - amount, 0), order.currency),
        "order_status": status,
        "reversible": False,
    }


@request_refund.reconciler
def _refund_lookup(operation_id: str, _context: ToolContext) -> Reconciliation:
    with world().lock:
        done = world().refunds.get(operation_id)
    return Reconciliation.applied(done) if done is not None else Reconciliation.not_applied()
