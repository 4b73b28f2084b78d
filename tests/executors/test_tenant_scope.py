"""The sample tools scope their work by the tenant the ledger's lease names, never by
anything in the arguments: another tenant's documents are neither found nor read.

Before: executors never received the principal or tenant, and `search_documents`
searched every tenant's documents.
"""

from __future__ import annotations

from typing import Any

from executors import ItemAction, ItemDisposition, ItemProcessor, ProcessorOptions
from executors.samples import sample_tool
from schemas import LeaseDecision, RuntimeContext
from tests.executors.helpers import FakeLedger, contract, process, reply, work_item

GLOBEX = RuntimeContext(principal="gina", tenant="globex",
                        capabilities=frozenset({"documents:search", "documents:read"}))
SEARCH = {"query": "refund policy", "source_types": ["policy"], "top_k": 10}


def _run(tool: str, arguments: dict[str, Any], context: RuntimeContext | None) -> ItemDisposition:
    implementation = sample_tool(tool)
    processor = ItemProcessor(implementation, contract(tool), ProcessorOptions("exec-test"))
    lease = reply(LeaseDecision.EXECUTE, "op-1", tool, arguments=arguments)
    lease = lease.model_copy(update={"context": context})
    return process(processor, work_item("op-1", tool), FakeLedger(lease))


def _sources(disposition: ItemDisposition) -> set[str]:
    assert disposition.action is ItemAction.PUBLISH and disposition.envelope is not None
    assert disposition.envelope.ok, disposition.envelope.error
    assert disposition.envelope.data is not None
    return {item["source_id"] for item in disposition.envelope.data["items"]}


def test_a_search_sees_only_the_tenant_the_lease_names() -> None:
    acme = reply(LeaseDecision.EXECUTE, "op-1", "search_documents").context
    assert acme is not None and acme.tenant == "acme"
    assert "globex-refunds" not in _sources(_run("search_documents", SEARCH, acme))
    assert _sources(_run("search_documents", SEARCH, acme))  # it does find acme's
    assert _sources(_run("search_documents", SEARCH, GLOBEX)) == {"globex-refunds"}


def test_without_a_trusted_tenant_nothing_is_searched() -> None:
    disposition = _run("search_documents", SEARCH, None)
    assert disposition.envelope is not None and disposition.envelope.error is not None
    assert disposition.envelope.error.code == "NO_TRUSTED_TENANT"


def test_another_tenants_document_cannot_be_read_by_id() -> None:
    arguments = {"document_id": "globex-refunds", "start_char": 0, "end_char": 10}
    acme = reply(LeaseDecision.EXECUTE, "op-1", "read_document_span").context
    refused = _run("read_document_span", arguments, acme)
    assert refused.envelope is not None and refused.envelope.error is not None
    assert refused.envelope.error.code == "DOCUMENT_NOT_FOUND"
    allowed = _run("read_document_span", arguments, GLOBEX)
    assert allowed.envelope is not None and allowed.envelope.ok
