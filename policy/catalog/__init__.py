"""The sample tool catalog: operator-edited contracts, their cross-field rules, a fake world.

`CATALOG_DIR` holds one `<tool>.yaml` contract per tool. JSON Schema checks
the shape of each call; the rules in `SAMPLE_RULES` check what a schema
cannot (relations between arguments, the clock, attributes of resolved
targets). `sample_targets()` reads a small world of two tenants for tests and demos
from a data file (`SAMPLE_TARGETS_FILE`, not code), matching the cases of the
seed texts (snapshots `snap-a-7`, `snap-a-8` and `snap-b-8` of seed 004,
orders of `alice` and `bob`); the sample executors' fake backends
(`executors/samples/_world.py`) hold the same world.

    registry = ContractRegistry.from_directory(CATALOG_DIR)
    checker = ProposalChecker(
        registry.pin_latest(),
        resolver=InMemoryTargetResolver(sample_targets()),
        rules=SAMPLE_RULES,
    )
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import date
from pathlib import Path
from typing import Any

from policy import InMemoryTargetResolver, SemanticInput, SemanticRule, Target, TargetResolver
from policy._fakes import load_targets
from schemas import CheckStage, ErrorCategory, ValidationIssue

__all__ = [
    "CATALOG_DIR",
    "FILES_CATALOG_DIR",
    "MAX_SPAN_CHARS",
    "SAMPLE_RULES",
    "SAMPLE_TARGETS_FILE",
    "date_from_not_in_future",
    "incident_top_k_limit",
    "order_date_range",
    "refund_within_order",
    "sample_plugins",
    "sample_targets",
    "snapshots_distinct_and_ordered",
    "span_within_document",
    "template_variables_present",
    "urgent_ticket_has_description",
]

CATALOG_DIR: Path = Path(__file__).resolve().parent
"""The directory of the sample contract files, one `<tool>.yaml` per tool."""

FILES_CATALOG_DIR: Path = CATALOG_DIR / "files"
"""The file-sharing sample tools of the plan examples (seed 001): `create_folder`,
`write_file`, `grant_access`, `notify_user` and their compensations. A catalog of its
own, so that the sample catalog above stays what it was."""

SAMPLE_TARGETS_FILE: Path = CATALOG_DIR / "world" / "targets.json"
"""The sample world's targets as data: a JSON array of `Target` fields, one target a line.

In a subdirectory, so that loading `CATALOG_DIR` as contracts does not read it.
"""

MAX_SPAN_CHARS = 20_000
"""The most characters `read_document_span` returns in one call."""

_INCIDENT_TOP_K = 5
_REFUNDABLE_STATUSES = frozenset({"paid", "shipped", "delivered"})
_TEMPLATE_VARIABLES: dict[str, tuple[str, ...]] = {
    "support_received": ("ticket_id",),
    "refund_review_requested": ("order_id",),
    "order_shipped": ("order_id",),
}


def _issue(
    code: str,
    path: str,
    message: str,
    *,
    repairable: bool = True,
    category: ErrorCategory = ErrorCategory.INVALID_INPUT,
    expected: Any = None,
    actual: Any = None,
) -> ValidationIssue:
    return ValidationIssue(
        stage=CheckStage.SEMANTICS,
        code=code,
        message=message,
        path=path,
        repairable=repairable,
        category=category,
        expected=expected,
        actual=actual,
    )


def _int(value: Any) -> int | None:
    """`value` when it is a JSON integer (booleans are not), else None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _date(value: Any) -> date | None:
    """`value` as a date when it is an ISO date string, else None."""
    if not isinstance(value, str):
        return None
    try:
        return date.fromisoformat(value)
    except ValueError:
        return None


# search_documents ----------------------------------------------------------


def date_from_not_in_future(data: SemanticInput) -> list[ValidationIssue]:
    """search_documents: `date_from` may not be after today (DATE_FROM_IN_FUTURE, seed 000)."""
    date_from = _date(data.arguments.get("date_from"))
    today = data.now.date()
    if date_from is None or date_from <= today:
        return []
    return [
        _issue(
            "DATE_FROM_IN_FUTURE",
            "/date_from",
            "date_from cannot be after today",
            expected=f"<= {today.isoformat()}",
            actual=date_from.isoformat(),
        )
    ]


def incident_top_k_limit(data: SemanticInput) -> list[ValidationIssue]:
    """search_documents: incident searches return at most 5 results (INCIDENT_TOP_K_LIMIT)."""
    source_types = data.arguments.get("source_types")
    top_k = _int(data.arguments.get("top_k"))
    if not isinstance(source_types, list) or "incident" not in source_types:
        return []
    if top_k is None or top_k <= _INCIDENT_TOP_K:
        return []
    return [
        _issue(
            "INCIDENT_TOP_K_LIMIT",
            "/top_k",
            f"top_k is at most {_INCIDENT_TOP_K} when searching incident reports",
            expected=_INCIDENT_TOP_K,
            actual=top_k,
        )
    ]


# read_document_span --------------------------------------------------------


def span_within_document(data: SemanticInput) -> list[ValidationIssue]:
    """read_document_span: `end_char` after `start_char`, a bounded span, inside the text.

    The length comes from the resolved snapshot when one is named, else from
    the document (attribute `length`).
    """
    start = _int(data.arguments.get("start_char"))
    end = _int(data.arguments.get("end_char"))
    if start is None or end is None:
        return []
    if end <= start:
        return [
            _issue(
                "SPAN_END_NOT_AFTER_START",
                "/end_char",
                "end_char must be greater than start_char",
                expected=f"> {start}",
                actual=end,
            )
        ]
    if end - start > MAX_SPAN_CHARS:
        return [
            _issue(
                "SPAN_TOO_LONG",
                "/end_char",
                f"at most {MAX_SPAN_CHARS} characters can be read at once",
                expected=f"<= {start + MAX_SPAN_CHARS}",
                actual=end,
            )
        ]
    target = data.targets.get("/snapshot_id") or data.targets.get("/document_id")
    if target is None:
        return []
    length = _int(target.attributes.get("length"))
    if length is not None and end > length:
        return [
            _issue(
                "SPAN_OUT_OF_RANGE",
                "/end_char",
                f"the {target.kind} has only {length} characters",
                expected=f"<= {length}",
                actual=end,
            )
        ]
    return []


# compare_document_snapshots ------------------------------------------------


def snapshots_distinct_and_ordered(data: SemanticInput) -> list[ValidationIssue]:
    """compare_document_snapshots: two different snapshots, the older one first.

    Runs only after both snapshots resolved to the same source, so their
    `sequence` attributes are comparable.
    """
    before_id = data.arguments.get("before_snapshot_id")
    after_id = data.arguments.get("after_snapshot_id")
    if not isinstance(before_id, str) or not isinstance(after_id, str):
        return []
    if before_id == after_id:
        return [
            _issue(
                "SAME_SNAPSHOT",
                "/after_snapshot_id",
                "before and after name the same snapshot; nothing would be compared",
                expected=f"a snapshot other than '{before_id}'",
                actual=after_id,
            )
        ]
    before = data.targets.get("/before_snapshot_id")
    after = data.targets.get("/after_snapshot_id")
    if before is None or after is None:
        return []
    before_seq = _int(before.attributes.get("sequence"))
    after_seq = _int(after.attributes.get("sequence"))
    if before_seq is not None and after_seq is not None and before_seq >= after_seq:
        return [
            _issue(
                "SNAPSHOTS_OUT_OF_ORDER",
                "/before_snapshot_id",
                "before_snapshot_id must be older than after_snapshot_id; swap them",
                expected=f"older than '{after_id}'",
                actual=before_id,
            )
        ]
    return []


# send_customer_email -------------------------------------------------------


def template_variables_present(data: SemanticInput) -> list[ValidationIssue]:
    """send_customer_email: the chosen template's placeholders all have values."""
    template = data.arguments.get("template")
    variables = data.arguments.get("variables")
    present: Mapping[str, Any] = variables if isinstance(variables, Mapping) else {}
    needed = _TEMPLATE_VARIABLES.get(template, ()) if isinstance(template, str) else ()
    return [
        _issue(
            "TEMPLATE_VARIABLE_MISSING",
            f"/variables/{name}",
            f"template '{template}' needs variables.{name}",
            expected="present",
        )
        for name in needed
        if name not in present
    ]


# create_ticket -------------------------------------------------------------


def urgent_ticket_has_description(data: SemanticInput) -> list[ValidationIssue]:
    """create_ticket: an urgent ticket pages someone, so it needs a non-blank description."""
    if data.arguments.get("priority") != "urgent":
        return []
    description = data.arguments.get("description")
    if isinstance(description, str) and description.strip():
        return []
    return [
        _issue(
            "DESCRIPTION_REQUIRED",
            "/description",
            "urgent tickets need a description for the on-call engineer",
            expected="non-blank text",
        )
    ]


# request_refund ------------------------------------------------------------


def refund_within_order(data: SemanticInput) -> list[ValidationIssue]:
    """request_refund: a refundable order, its currency, at most what is left to refund.

    Reads the resolved order's attributes `status`, `currency`,
    `amount_cents` and `refunded_cents`. Runs only after the order resolved
    and was found to belong to the actor, so echoing its amount is safe.
    """
    order = data.targets.get("/order_id")
    if order is None:
        return []
    attributes = order.attributes
    status = attributes.get("status")
    if status not in _REFUNDABLE_STATUSES:
        return [
            _issue(
                "ORDER_NOT_REFUNDABLE",
                "/order_id",
                f"an order in status '{status}' cannot be refunded",
                repairable=False,
                category=ErrorCategory.POLICY_DENIED,
                expected=sorted(_REFUNDABLE_STATUSES),
                actual=status,
            )
        ]
    issues: list[ValidationIssue] = []
    currency = attributes.get("currency")
    if currency is not None and data.arguments.get("currency") != currency:
        issues.append(
            _issue(
                "CURRENCY_MISMATCH",
                "/currency",
                "the refund must be in the order's currency",
                expected=currency,
                actual=data.arguments.get("currency"),
            )
        )
    total = _int(attributes.get("amount_cents"))
    amount = _int(data.arguments.get("amount_cents"))
    if total is not None and amount is not None:
        remaining = total - (_int(attributes.get("refunded_cents")) or 0)
        if amount > remaining:
            issues.append(
                _issue(
                    "REFUND_EXCEEDS_ORDER_AMOUNT",
                    "/amount_cents",
                    "the refund is larger than what is left to refund on the order",
                    expected=f"<= {remaining}",
                    actual=amount,
                )
            )
    if data.arguments.get("reason_code") == "other" and not data.arguments.get("reason"):
        issues.append(
            _issue(
                "REASON_REQUIRED",
                "/reason",
                "reason_code 'other' needs a free-text reason",
                expected="present",
            )
        )
    return issues


# query_orders --------------------------------------------------------------


def order_date_range(data: SemanticInput) -> list[ValidationIssue]:
    """query_orders: when both are given, `placed_before` is after `placed_after`."""
    after = _date(data.arguments.get("placed_after"))
    before = _date(data.arguments.get("placed_before"))
    if after is None or before is None or before > after:
        return []
    return [
        _issue(
            "DATE_RANGE_INVERTED",
            "/placed_before",
            "placed_before must be after placed_after",
            expected=f"> {after.isoformat()}",
            actual=before.isoformat(),
        )
    ]


SAMPLE_RULES: dict[str, tuple[SemanticRule, ...]] = {
    "search_documents": (date_from_not_in_future, incident_top_k_limit),
    "read_document_span": (span_within_document,),
    "compare_document_snapshots": (snapshots_distinct_and_ordered,),
    "send_customer_email": (template_variables_present,),
    "create_ticket": (urgent_ticket_has_description,),
    "request_refund": (refund_within_order,),
    "query_orders": (order_date_range,),
}
"""Cross-field rules of the sample tools, by tool name, for `ProposalChecker(rules=...)`."""


def sample_targets() -> list[Target]:
    """The targets of the sample world, read from `SAMPLE_TARGETS_FILE`, for tests and demos.

    Tenant `acme`: documents `document-a` (revision 8) and `document-b`
    (revision 8); snapshots `snap-a-7`, `snap-a-8` of document-a and `snap-b-8`
    of document-b (seed 004); orders `order-1001`, `order-1003` (already
    refunded) and `order-1004` (a large one) of `alice`, `order-1002` of `bob`;
    customers `cus-0001` to `cus-0600` (enough for seed 001's 500-recipient
    mailing), and `cus-0700`, kept twice (two "Jordan Lee" records: a reference
    to it needs the user to say which). Tenant `globex`: `document-g`, `snap-g-1`, `order-2001` of
    `carol` and customer `cus-9001`, invisible to acme callers.

    A document's and a snapshot's `version` is its revision and attribute
    `length` its size in characters; a snapshot's `source_id` is its
    document; an order's `owner` is the user who placed it.
    """
    return load_targets(SAMPLE_TARGETS_FILE)


def sample_plugins() -> tuple[TargetResolver, dict[str, tuple[SemanticRule, ...]]]:
    """The resolver and semantic rules of the sample world, as a service plugin.

    A deployment names its own factory (`module:function`) returning its
    resolver over its real systems and its rules; the embedded stack uses this.
    The checker sees the sample world only through the resolver (the
    `TargetResolver` port), never by importing it.
    """
    return InMemoryTargetResolver(sample_targets()), SAMPLE_RULES
