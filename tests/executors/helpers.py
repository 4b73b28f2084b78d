"""Shared helpers of the executor tests: the catalog, a fake ledger, tool contexts."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from executors import ItemDisposition, ItemProcessor, ToolContext
from policy import ContractRegistry, ToolCatalog, ToolContract
from policy.catalog import CATALOG_DIR
from schemas import LeaseDecision, LeaseReply, LeaseRequest, RuntimeContext, WorkItem

TRUSTED = RuntimeContext(
    principal="alice", tenant="acme",
    capabilities=frozenset({"documents:search", "documents:read", "email:send"}),
)
"""Who the fake ledger's leases run for (the sample world's tenant)."""


@functools.cache
def catalog() -> ToolCatalog:
    """The sample catalog, newest version of every tool."""
    return ContractRegistry.from_directory(CATALOG_DIR).pin_latest()


def contract(name: str) -> ToolContract:
    """One sample contract."""
    return catalog()[name]


def work_item(
    operation_id: str, tool: str, *, version: str | None = None, attempt: int = 1
) -> bytes:
    """A work item as the ledger queues it."""
    return (
        WorkItem(
            operation_id=operation_id,
            tool=tool,
            tool_version=version or contract(tool).version,
            attempt=attempt,
        )
        .model_dump_json()
        .encode()
    )


def reply(
    decision: LeaseDecision,
    operation_id: str,
    tool: str,
    *,
    arguments: Mapping[str, Any] | None = None,
    fencing_token: int | None = 1,
    attempt: int | None = 1,
    timeout_ms: int | None = None,
    lease_expires_at: datetime | None = None,
    version: str | None = None,
    not_before: datetime | None = None,
    context: RuntimeContext | None = None,
) -> LeaseReply:
    """A lease reply of the ledger (for `execute`, `reconcile` and `preview`, for `TRUSTED`
    unless `context` says otherwise)."""
    return LeaseReply(
        decision=decision,
        operation_id=operation_id,
        tool=tool,
        tool_version=version or contract(tool).version,
        arguments=dict(arguments) if arguments is not None else None,
        fencing_token=fencing_token,
        attempt=attempt,
        timeout_ms=timeout_ms,
        lease_expires_at=lease_expires_at,
        not_before=not_before,
        context=context or (
            TRUSTED
            if decision in (LeaseDecision.EXECUTE, LeaseDecision.RECONCILE, LeaseDecision.PREVIEW)
            else None
        ),
    )


class FakeLedger:
    """Answers lease requests with prepared replies and records every request."""

    def __init__(self, answer: LeaseReply | Callable[[LeaseRequest], LeaseReply]) -> None:
        self._answer = answer
        self.requests: list[LeaseRequest] = []

    async def __call__(self, request: LeaseRequest) -> LeaseReply:
        self.requests.append(request)
        if isinstance(self._answer, LeaseReply):
            return self._answer
        return self._answer(request)


class Heartbeats:
    """Counts in-progress acks."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self) -> None:
        self.count += 1


def process(
    processor: ItemProcessor,
    payload: bytes,
    ledger: FakeLedger,
    *,
    delivery: int = 1,
    heartbeat: Heartbeats | None = None,
) -> ItemDisposition:
    """Run the processor's core on one item, synchronously."""
    return asyncio.run(
        processor.process(
            payload, lease=ledger, heartbeat=heartbeat or Heartbeats(), delivery=delivery
        )
    )


def context(
    operation_id: str = "op-1",
    *,
    secrets: Mapping[str, str] | None = None,
    attempt: int = 1,
    seconds: float = 5.0,
) -> ToolContext:
    """A tool context as the processor builds it (its deadline `seconds` from now)."""
    return ToolContext(
        operation_id=operation_id,
        attempt=attempt,
        deadline=datetime.now(UTC) + timedelta(seconds=seconds),
        fencing_token=attempt,
        secrets=dict(secrets or {}),
        principal=TRUSTED.principal,
        tenant=TRUSTED.tenant,
        capabilities=TRUSTED.capabilities,
    )
