"""Builders for ledger tests: a ledger over a storage, proposals, contexts, results."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg

from ledger import Ledger, StorageConfig, build_ledger
from ledger.audit.seal import SealKey
from policy import ContractRegistry, InMemoryTargetResolver
from policy.catalog import SAMPLE_RULES, sample_targets
from schemas import PreviewReport, Provenance, ResultEnvelope, RuntimeContext, ToolProposal

ALICE = RuntimeContext(
    principal="alice",
    tenant="acme",
    capabilities=frozenset(
        {"documents:search", "documents:read", "email:send", "orders:read", "tickets:write",
         "refunds:request"}
    ),
)


NEXT_STEP = " (name another with --home or --database, or start one with `opledger up`)"
"""What the refusal of a missing ledger says to do (`NO_LEDGER`)."""

SEAL_KEY = SealKey.generate()
"""The seal key of every test ledger: it seals as the ledger service does (`refresh`)."""


def make_ledger(storage: StorageConfig, **kwargs: Any) -> Ledger:
    """A ledger over `storage` with the sample catalog and fake world, sealing with `SEAL_KEY`."""
    kwargs.setdefault("seal_key", SEAL_KEY)
    kwargs.setdefault("resolver", InMemoryTargetResolver(sample_targets()))
    kwargs.setdefault("rules", SAMPLE_RULES)
    return build_ledger(storage, **kwargs)


def proposal(tool: str, arguments: Any, *, operation_id: str | None = None, **extra: Any
             ) -> ToolProposal:
    """A proposal of `tool` with `arguments`."""
    return ToolProposal(
        proposal_id=extra.pop("proposal_id", f"p-{operation_id or tool}"),
        conversation_id="c-1",
        requested_by_user_id="alice",
        tool_name=tool,
        arguments=arguments,
        operation_id=operation_id,
        **extra,
    )


def search(operation_id: str | None = None, query: str = "refund policy") -> ToolProposal:
    """An auto-approved read."""
    return proposal("search_documents", {"query": query}, operation_id=operation_id)


def email(operation_id: str | None = None, recipients: tuple[str, ...] = ("cus-0001",)
          ) -> ToolProposal:
    """A high-risk write that always needs approval."""
    return proposal(
        "send_customer_email",
        {"recipient_ids": list(recipients), "template": "support_received",
         "variables": {"ticket_id": "TCK-42"}, "body": "Thanks for writing to us."},
        operation_id=operation_id,
    )


EMAIL_PREVIEW = PreviewReport(
    effect={
        "summary": "send 1 e-mail(s): We received your request TCK-42",
        "recipients": [{"customer_id": "cus-0001", "address": "customer-0001@acme.example.test"}],
        "reversible": False,
    }
)
"""What the e-mail executor's preview reports, roughly (the ledger stores any JSON object)."""


def previewed(ledger: Ledger, operation_id: str, report: PreviewReport = EMAIL_PREVIEW) -> str:
    """The preview of a call awaiting approval, recorded as its executor would send it after
    a `preview` lease answer; returns the digest an approval of it names."""
    ledger.leasing.record_preview(operation_id, tool=None, executor="exec-p", report=report)
    digest = ledger.get(operation_id).preview_hash
    assert digest is not None
    return digest


NO_HITS: dict[str, Any] = {"items": [], "truncated": False, "next_cursor": None}
"""A search result that matches search_documents' output schema: nothing found."""


def result(operation_id: str, token: int | None, attempt: int = 1, *, ok: bool = True,
           data: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
           executor: str = "exec-1", tool: str = "search_documents") -> ResultEnvelope:
    """An executor's result envelope (`token` from a lease reply, which must have one)."""
    assert token is not None, "a result needs the fencing token of an executed lease"
    return ResultEnvelope.model_validate({
        "operation_id": operation_id,
        "fencing_token": token,
        "ok": ok,
        "data": data if ok else None,
        "error": error,
        "provenance": Provenance(
            tool=tool, tool_version="2.1.0", executor=executor, attempt=attempt,
            latency_ms=3.0, completed_at=datetime.now(UTC),
        ),
    })


def event_types(ledger: Ledger, operation_id: str) -> list[str]:
    """The class names of an operation's events, in order."""
    return [type(event).__name__ for event in ledger.history(operation_id)]


def registry_with_limit(
    max_per_hour: int | None, *, tool: str = "search_documents"
) -> ContractRegistry:
    """The sample catalog, with `tool` limited only per hour (None: unlimited)."""
    from policy.catalog import CATALOG_DIR

    registry = ContractRegistry()
    for contract in ContractRegistry.from_directory(CATALOG_DIR).pin_latest().values():
        if contract.name == tool:
            contract = contract.model_copy(
                update={"limits": contract.limits.model_copy(
                    update={"max_per_hour": max_per_hour, "max_per_minute": None}
                )}
            )
        registry.register(contract)
    return registry


def use_storage(monkeypatch: Any, home: Any, storage: StorageConfig) -> None:
    """Point the `opledger` CLI at `storage` (and at `home`), nothing else leaking in."""
    for name in ("OPLEDGER_DATABASE", "OPLEDGER_POSTGRES_SCHEMA", "OPLEDGER_CONTRACTS_DIR",
                 "OPLEDGER_NATS_URL", "OPLEDGER_CREDS_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPLEDGER_HOME", str(home))
    if storage.sqlite_path is not None:
        monkeypatch.setenv("OPLEDGER_DATABASE", str(storage.sqlite_path))
    else:
        monkeypatch.setenv("OPLEDGER_DATABASE", storage.postgres_dsn or "")
        monkeypatch.setenv("OPLEDGER_POSTGRES_SCHEMA", storage.postgres_schema)


def cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """Run `opledger ARGV...`: (exit code, stdout, stderr)."""
    from ledger.entrypoints.cli import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_json(capsys: Any, *argv: str, expect: int = 0) -> Any:
    """Run `opledger ARGV... --json` and decode what it printed."""
    import json

    code, out, err = cli(capsys, *argv, "--json")
    assert code == expect, (code, out, err)
    return json.loads(out)


CREATION_LOCK_WAITS = (
    "SELECT locktype FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    # This schema's creation lock only (`creation_lock_keys`): pg_locks is the whole
    # server's, and another test may be waiting for its own lock at the same time.
    # Two int4 keys are kept as classid and objid, both unsigned (oid).
    " AND classid = (%s::bigint & 4294967295)::oid"
    " AND objid = (%s::bigint & 4294967295)::oid AND objsubid = 2"
)
"""Waits for one schema's creation lock; its parameters are `creation_lock_keys(schema)`."""


def seen_waiting(
    watcher: psycopg.Connection[tuple[object, ...]],
    query: str,
    params: tuple[object, ...] = (),
    *,
    unless: Callable[[], bool] = lambda: False,
) -> list[tuple[object, ...]]:
    """The rows of `query` (over `pg_locks`) once it finds any, polled for up to 10 s;
    [] at once when `unless()` turns true (what should wait has finished instead)."""
    for _ in range(200):
        waiting = watcher.execute(query, params).fetchall()
        if waiting or unless():
            return waiting
        time.sleep(0.05)
    return []
