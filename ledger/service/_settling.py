"""Settling by hand or by hook: cancellation, reconciliation, and the relay's notes."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from ledger.domain.errors import InvalidArgument
from ledger.domain.operation import Operation
from ledger.service._runner import CommandRunner

__all__ = ["Settling"]


class Settling:
    """Commands that settle an operation other than through its executor's result."""

    def __init__(self, runner: CommandRunner, *, clock: Callable[[], datetime]) -> None:
        self._runner = runner
        self._clock = clock

    def cancel(self, operation_id: str, *, by: str, reason: str = "") -> Operation:
        """Cancel now if nothing runs, ask the executor if it runs, note it if too late."""

        def command(operation: Operation) -> Operation:
            operation.request_cancel(by=by, reason=reason, now=self._clock())
            return operation

        return self._runner.update(operation_id, command)

    def start_reconciliation(self, operation_id: str, *, by: str) -> Operation:
        """Begin settling an unknown outcome."""

        def command(operation: Operation) -> Operation:
            operation.start_reconciliation(by=by, now=self._clock())
            return operation

        return self._runner.update(operation_id, command)

    def reconcile(
        self, operation_id: str, *, by: str, succeeded: bool, **details: Any
    ) -> Operation:
        """Settle an unknown outcome with what the provider reports."""

        def command(operation: Operation) -> Operation:
            operation.reconcile(
                outcome="succeeded" if succeeded else "failed", by=by, now=self._clock(), **details
            )
            return operation

        return self._runner.update(operation_id, command)

    def note_publication_set_aside(
        self, operation_id: str, *, position: int, version: int, reason: str
    ) -> None:
        """Record that the relay could not publish the event at `version` (position
        `position`) and went on without it (`Operation.PublicationSetAside`)."""

        def command(operation: Operation) -> None:
            operation.note_publication_set_aside(
                position=position, version=version, reason=reason, now=self._clock()
            )

        self._runner.update(operation_id, command)

    def resolve(self, operation_id: str, *, by: str, applied: bool, reason: str) -> Operation:
        """A person settles an unknown outcome: what happened, who says so, and why.

        Applied: it succeeded (nothing is kept: no executor reported a result).
        Not applied: it failed with `NOT_APPLIED`, final; the ledger does not retry
        what a person settled. Only an operation whose outcome is unknown (or being
        reconciled) can be resolved; anything else is `ILLEGAL_TRANSITION`.
        """
        if not reason.strip():
            raise InvalidArgument("a resolution needs a reason")

        def command(operation: Operation) -> Operation:
            if applied:
                operation.reconcile(outcome="succeeded", by=by, reason=reason, now=self._clock())
            else:
                operation.reconcile(
                    outcome="failed",
                    by=by,
                    reason=reason,
                    code="NOT_APPLIED",
                    category="TRANSIENT",
                    retryable=False,
                    now=self._clock(),
                )
            return operation

        return self._runner.update(operation_id, command)
