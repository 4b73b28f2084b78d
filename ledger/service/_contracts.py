"""The contract an operation was checked against, while the catalog still pins it."""

from __future__ import annotations

from collections.abc import Mapping

from ledger.domain.operation import Operation
from policy import ToolContract

__all__ = ["PinnedContracts"]


class PinnedContracts:
    """Looks up an operation's contract by tool name and pinned version."""

    def __init__(self, catalog: Mapping[str, ToolContract]) -> None:
        self._catalog = catalog

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
