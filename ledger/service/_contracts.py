"""The contract an operation was checked against, while the catalog still pins it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from ledger.domain.operation import Operation
from ledger.domain.values import ReconcilePlan
from policy import CompiledSchema, ToolContract
from schemas import CheckStage

__all__ = ["PinnedContracts", "reconcile_plan"]


class PinnedContracts:
    """Looks up an operation's contract by tool name and pinned version."""

    def __init__(self, catalog: Mapping[str, ToolContract]) -> None:
        self._catalog = catalog
        self._outputs: dict[tuple[str, str], CompiledSchema] = {}

    def of(self, operation: Operation) -> ToolContract | None:
        """The pinned contract the operation was checked against, if still pinned."""
        contract = self._catalog.get(operation.tool)
        if contract is None or contract.version != operation.tool_version:
            return None
        return contract

    def tools(self) -> list[str]:
        """Every tool the catalog has a contract for, sorted."""
        return sorted(self._catalog)

    def get(self, tool: str) -> ToolContract | None:
        """The catalog's current contract of `tool`, if any."""
        return self._catalog.get(tool)

    def output_problem(
        self, contract: ToolContract, data: Any, redacted: Sequence[str] = ()
    ) -> str | None:
        """Where `data` breaks the contract's output schema (None: it does not).

        Faults at or under a pointer the executor redacted are not counted: a
        redacted value is the executor's placeholder, not the tool's output.
        """
        key = (contract.name, contract.version)
        schema = self._outputs.get(key)
        if schema is None:
            schema = self._outputs[key] = CompiledSchema(
                contract.output_schema, stage=CheckStage.STRUCTURE
            )
        if schema.is_valid(data):
            return None
        for issue in schema.issues(data):
            path = issue.path or ""
            if not any(path == r or path.startswith(f"{r}/") for r in redacted):
                return f"{issue.keyword} at {path or '/'}"
        return None


def reconcile_plan(contract: ToolContract | None) -> ReconcilePlan:
    """The contract's `reconcile` policy as the aggregate takes it (the default without one)."""
    if contract is None:
        return ReconcilePlan()
    policy = contract.reconcile
    return ReconcilePlan(
        max_rounds=policy.max_rounds,
        initial_delay=timedelta(milliseconds=policy.initial_delay_ms),
        multiplier=policy.backoff_multiplier,
        max_delay=timedelta(milliseconds=policy.max_delay_ms),
    )
