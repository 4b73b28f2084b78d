"""Results: an executor's result envelope settles an attempt, exactly once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from functools import partial

from ledger.adapters.results import ResultStore, envelope_text_hash
from ledger.domain.errors import LedgerError
from ledger.domain.operation import Operation
from ledger.domain.states import ResultDisposition
from ledger.service._contracts import PinnedContracts, reconcile_plan
from ledger.service._runner import CommandRunner
from policy import DEFAULT_LIMITS, ToolContract, json_value_issue
from schemas import ResultEnvelope, ResultOutcome, canonical_json, sha256_hex

__all__ = ["ResultRecording"]

class ResultRecording:
    """Records results (retrying a retryable failure when the policy allows)."""

    def __init__(
        self,
        runner: CommandRunner,
        contracts: PinnedContracts,
        *,
        clock: Callable[[], datetime],
    ) -> None:
        self._runner = runner
        self._contracts = contracts
        self._clock = clock

    def record_result(self, envelope: ResultEnvelope) -> ResultDisposition:
        """Record one executor's result."""
        return self._runner.update(envelope.operation_id, partial(self._apply, envelope=envelope))

    def record_results(
        self, envelopes: Sequence[ResultEnvelope]
    ) -> list[ResultDisposition | LedgerError]:
        """Record many results with one append (for batching services)."""
        return self._runner.batch(
            [
                (envelope.operation_id, partial(self._apply, envelope=envelope))
                for envelope in envelopes
            ]
        )

    def _apply(self, operation: Operation, envelope: ResultEnvelope) -> ResultDisposition:
        """Record one result on a loaded operation (no save); its envelope's exact text is
        kept with the operation's events (`CommandRunner.keep_with_events`) when an
        event binds that text: both are stored in one transaction, or neither.

        A result whose provenance names another tool is REFUSED: the results
        consumer accepts a tool's results only on that tool's subject, which
        only its executors may publish to, so this is an executor of one tool
        trying to settle another tool's operation (fencing tokens are small
        counters, easily guessed). So is one with the current lease's token and
        another attempt's number.
        """
        if envelope.provenance.tool != operation.tool:
            return ResultDisposition.REFUSED
        if (
            envelope.fencing_token == operation.fencing_token
            and envelope.provenance.attempt != operation.attempt
        ):
            # The lease's token with another attempt's number: the text would be kept
            # under that attempt's reference, where an earlier text may already be
            # (and the first one kept wins). A lease names its attempt; a result of it
            # names the same one, or it is not that lease's result.
            return ResultDisposition.REFUSED
        now = self._clock()
        contract = self._contracts.of(operation)  # the pinned one; None if no longer
        attempt = envelope.provenance.attempt
        reference = ResultStore.reference(operation.id, attempt)
        error = envelope.error
        reason = error.message if error else ""
        code = error.code if error else ""
        category = error.category.value if error else ""
        retryable = error.retryable if error else False
        problem = (
            json_value_issue(envelope.data, DEFAULT_LIMITS.max_depth)
            if envelope.data is not None
            else None
        )
        if problem is not None:
            # Data no hash can bind (an integer beyond 2**53, a 300-level nesting):
            # nothing in the envelope can be trusted to say what happened, and
            # it is not kept. Unknown, for reconciliation to settle; before, it
            # failed the append on every redelivery until JetStream gave up.
            outcome, output_hash, text, envelope_hash = ResultOutcome.UNKNOWN, "", "", ""
            reason = f"the result cannot be recorded: {problem.code} at {problem.path or '/'}"
        elif (violation := self._output_violation(contract, envelope)) is not None:
            # The ledger does not take the executor's word for it: a success whose
            # data breaks the output schema failed (a read) or may have had its
            # effect (a write: unknown, for reconciliation). Nothing of it is kept.
            writes = contract is not None and contract.effect.writes
            outcome = ResultOutcome.UNKNOWN if writes else ResultOutcome.FAILED
            output_hash, text, envelope_hash = "", "", ""
            reason = f"the output breaks the contract's output schema: {violation}"
            code, category, retryable = "OUTPUT_CONTRACT_VIOLATION", "INTERNAL", False
        else:
            output_hash = (
                sha256_hex(canonical_json(envelope.data)) if envelope.data is not None else ""
            )
            # Encoded once: the event records the hash of exactly the text that is kept.
            text = ResultStore.encode(envelope)
            envelope_hash = envelope_text_hash(text)
            outcome = envelope.outcome
        pending = len(operation.pending_events)
        disposition = operation.record_result(
            fencing_token=envelope.fencing_token,
            executor=envelope.provenance.executor,
            outcome=outcome,
            now=now,
            output_hash=output_hash,
            result_ref=reference,
            code=code,
            category=category,
            retryable=retryable,
            reason=reason,
            envelope_hash=envelope_hash,
            reconcile=reconcile_plan(contract),
            lookup=envelope.lookup,
        )
        if disposition is ResultDisposition.ACCEPTED:
            # Kept only where a settling event names it (not for an unknown
            # outcome, whose reference a later reconciliation of the same
            # attempt reuses: the first text kept would win over the bound one).
            if text and any(
                getattr(event, "result_ref", "") == reference
                for event in operation.pending_events[pending:]
            ):
                self._runner.keep_with_events(operation.id, reference, text)
            if operation.can_retry:
                delay = contract.retry.backoff_ms(operation.attempt) if contract else 0
                # The tool's own word counts too: a provider's Retry-After, a rate limit.
                if error is not None and error.retry_after_ms is not None:
                    delay = max(delay, error.retry_after_ms)
                operation.schedule_retry(not_before=now + timedelta(milliseconds=delay), now=now)
        return disposition

    def _output_violation(
        self, contract: ToolContract | None, envelope: ResultEnvelope
    ) -> str | None:
        if not envelope.ok or envelope.data is None or contract is None:
            return None
        return self._contracts.output_problem(contract, envelope.data, envelope.redactions)
