"""Status: where an operation stands, as its host (or an operator) may see it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from ledger.adapters.results import ResultStore
from ledger.audit.model import served_result
from ledger.domain.errors import OperationNotFound
from ledger.domain.operation import Operation
from ledger.domain.states import TERMINAL_STATES, OperationState
from ledger.service._runner import CommandRunner
from schemas import OperationStatus, ledger_operation_id

__all__ = ["StatusReader"]


class StatusReader:
    """Answers status requests, with the kept result envelope once there is one."""

    def __init__(self, runner: CommandRunner, store: ResultStore) -> None:
        self._runner = runner
        self._store = store
        # Kept texts read ahead for the statuses about to be asked (`prefetch`):
        # each is taken once, so nothing here outlives the batch it was read for.
        self._read_ahead: dict[str, str | None] = {}
        self._operations_ahead: dict[str, Operation] = {}

    def prefetch(self, operation_ids: Iterable[str]) -> None:
        """Read the kept result texts of these operations (the ledger's IDs) in one query,
        for the status requests about to follow (the relay's outcome notices of one
        batch): one round trip for the batch instead of one per operation.

        The operations this process holds no copy of are read first, in one query
        too (`CommandRunner.load`); the texts still come from the store, so a kept
        text changed by hand is caught as before.
        """
        operation_ids = list(operation_ids)
        # Those another instance wrote last, read together; kept for these statuses
        # only (settled, mostly: they would crowd out the copies commands use).
        self._operations_ahead = self._runner.load(operation_ids, remember=False)
        references: list[str] = []
        for operation_id in operation_ids:
            operation = self._operations_ahead.get(operation_id) or self._runner.cached(
                operation_id
            )
            outcome = operation.outcome if operation is not None else None
            reference = outcome.as_dict().get("result_ref") if outcome is not None else None
            if reference:
                references.append(str(reference))
        texts = self._store.get_texts(references)
        self._read_ahead = {reference: texts.get(reference) for reference in references}

    def result_data(self, operation_id: str) -> Any:
        """The data of the operation's kept result (None: no result, or no data), read
        as `status` reads it: only the envelope its event bound."""
        result = self.status(operation_id).result
        return result.data if result is not None else None

    def status(
        self, operation_id: str, *, known_version: int | None = None, host: str | None = None
    ) -> OperationStatus:
        """Where an operation stands, with its result envelope once it has one.

        `known_version`: the caller saw the operation reach this version (the
        relay, announcing an event it just read). A copy this process wrote
        at that version or later is then as good as a replay, and cheaper.

        `host`: asked on behalf of this agent host, in its own namespace:
        `operation_id` is the host's ID (see `schemas.ledger_operation_id`),
        and so is the one in the answer. Another host's operations are not in
        that namespace at all.
        """
        asked = operation_id
        if host is not None:
            operation_id = ledger_operation_id(host, operation_id)
        ahead = self._operations_ahead.pop(operation_id, None)
        try:
            if ahead is not None and known_version is not None and ahead.version >= known_version:
                operation = ahead  # read by `prefetch` for this very status
            else:
                operation = self._runner.current(operation_id, known_version=known_version)
        except OperationNotFound:
            raise OperationNotFound("no such operation", operation_id=asked) from None
        if host is not None and operation.host != host:
            # Only an operation submitted before IDs were scoped can be here.
            raise OperationNotFound("no such operation", operation_id=asked)
        outcome = operation.outcome.as_dict() if operation.outcome is not None else None
        result = None
        if outcome and outcome.get("result_ref"):
            # Only the exact envelope its event bound (RESULT_INTEGRITY otherwise).
            reference = outcome["result_ref"]
            if reference in self._read_ahead:
                text = self._read_ahead.pop(reference)
            else:
                text = self._store.get_text(reference)
            result = served_result(text, operation.id, reference, outcome)
        return OperationStatus(
            operation_id=operation.id if host is None else asked,
            state=operation.state.value,
            # A retryable failure is never seen here: its retry is scheduled
            # in the same append, so the state is READY again.
            final=operation.state in TERMINAL_STATES,
            tool=operation.tool,
            tool_version=operation.tool_version,
            attempts=operation.attempt,
            outcome=outcome,
            result=result,
            cancel=_cancel_note(operation),
        )


def _cancel_note(operation: Operation) -> Literal["requested", "too_late"] | None:
    if operation.cancel_too_late:
        return "too_late"
    if operation.state is OperationState.CANCEL_REQUESTED:
        return "requested"
    return None
