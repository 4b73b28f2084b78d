"""Example executors for the eight sample tools of `policy/catalog`, over fake backends.

Each is a `Tool` pinned to its catalog contract version; run one with

    python -m executors run executors.samples.email:send_customer_email ...

`executors.samples.email` holds the fake e-mail provider (SQLite, shared
between processes) used to prove that redeliveries converge on one send.
The other tools use the in-process fakes of `executors.samples._world`.
"""

from __future__ import annotations

from executors._api import Tool
from executors._main import load_tool

__all__ = ["SAMPLE_TOOLS", "sample_tool"]

SAMPLE_TOOLS: dict[str, str] = {
    "search_documents": "executors.samples.documents:search_documents",
    "read_document_span": "executors.samples.documents:read_document_span",
    "compare_document_snapshots": "executors.samples.documents:compare_document_snapshots",
    "delete_document": "executors.samples.documents:delete_document",
    "send_customer_email": "executors.samples.email:send_customer_email",
    "create_ticket": "executors.samples.tickets:create_ticket",
    "request_refund": "executors.samples.orders:request_refund",
    "cancel_refund": "executors.samples.orders:cancel_refund",
    "query_orders": "executors.samples.orders:query_orders",
}
"""Tool name → the `MODULE:TOOL` spec of its sample executor."""


def sample_tool(name: str) -> Tool:
    """The sample implementation of tool `name`."""
    return load_tool(SAMPLE_TOOLS[name])
