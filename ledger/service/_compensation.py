"""Compensation: undoing a call that succeeded, as a call of its own (seeds 001 and 003).

Not every effect can be undone, and none is undone automatically: a contract
may name its compensating tool and how to build its arguments from the
original call and its result (`ToolContract.compensation`), and a person or a
host proposes it. The compensation is an ordinary operation under the
original's host (`<id>-c`): checked, approved and run like any call, with its
own idempotency; the original records `CompensationProposed` and keeps its
outcome (it happened). Both are stored in one append.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from eventsourcing.persistence import IntegrityError

from ledger.domain.errors import InvalidProposal, OperationConflict
from ledger.domain.states import OperationState
from ledger.service._runner import CommandRunner
from ledger.service._status import StatusReader
from ledger.service._submission import Submission, Submissions
from policy import MISSING, ProposalChecker, resolve_pointer
from schemas import ToolProposal, host_operation_id, ledger_operation_id

__all__ = ["Compensations", "compensation_arguments", "compensation_id"]

_SUFFIX = "-c"


def compensation_id(operation_id: str, host: str) -> str:
    """The ledger's ID of the operation that undoes `operation_id` (`<id>-c`)."""
    try:
        return ledger_operation_id(host, f"{host_operation_id(operation_id)}{_SUFFIX}")
    except ValueError:
        raise InvalidProposal(
            "the compensation's ID would be too long: this operation's ID has 127 or more"
            " characters"
        ) from None


def compensation_arguments(
    sources: Mapping[str, str], call: Mapping[str, Any], result: Any
) -> dict[str, Any]:
    """The compensating call's arguments: each from the original call (`call:/pointer`)
    or its result (`result:/pointer`); a value that is not there refuses it."""
    arguments: dict[str, Any] = {}
    for name, source in sources.items():
        origin, _, pointer = source.partition(":")
        value = resolve_pointer(call if origin == "call" else result, pointer)
        if value is MISSING:
            raise InvalidProposal(
                f"the compensation takes {name!r} from {source}, which the original"
                f" {'call' if origin == 'call' else 'result'} does not have"
            )
        arguments[name] = value
    return arguments


class Compensations:
    """Proposes the compensation of a succeeded call."""

    def __init__(
        self,
        runner: CommandRunner,
        checker: ProposalChecker,
        submissions: Submissions,
        status_reader: StatusReader,
        *,
        clock: Callable[[], datetime],
    ) -> None:
        self._runner = runner
        self._checker = checker
        self._submissions = submissions
        self._status = status_reader
        self._clock = clock

    def compensate(self, operation_id: str, *, by: str, reason: str) -> Submission:
        """Propose undoing the succeeded operation `operation_id` (the ledger's ID);
        `by`: who asks (`operator:<name>`, `host:<name>`), `reason`: why (recorded,
        required). Proposing it again answers the same compensation (`created` false)."""
        if not reason.strip():
            raise InvalidProposal("a compensation needs a reason (why undo what happened)")
        original = self._runner.get(operation_id)
        compensating = compensation_id(original.id, original.host)
        if original.compensated_by == compensating:
            return Submission(compensating, self._runner.get(compensating).state, None, False)
        if original.state is not OperationState.SUCCEEDED:
            # The domain refuses it too; said here before anything is built.
            original.note_compensation(compensation_id=compensating, by=by, reason=reason,
                                       now=self._clock())
        contract = self._checker.catalog.get(original.tool)
        if contract is None or contract.compensation is None:
            raise InvalidProposal(
                f"{original.tool}'s contract names no compensation: its effect is not undone"
                " by a tool (a person must act)"
            )
        result = self._status.result_data(original.id)
        arguments = compensation_arguments(
            contract.compensation.arguments, original.arguments or {}, result
        )
        local = host_operation_id(compensating)
        proposal = ToolProposal(
            proposal_id=local,
            conversation_id=str(original.proposal.get("conversation_id", "compensation")),
            requested_by_user_id=str(original.proposal.get("requested_by_user_id", original.actor)),
            tool_name=contract.compensation.tool,
            arguments=arguments,
            operation_id=local,
        )
        context = original.caller_context
        operation, decision = self._submissions.compensation(
            compensating, proposal, context, original.host, compensates=original.id, by=by
        )
        original.note_compensation(
            compensation_id=compensating, by=by, reason=reason, now=self._clock()
        )
        try:
            self._runner.save(operation, original)
        except IntegrityError:
            self._runner.forget(original.id, compensating)
            again = self._runner.get(original.id)
            if again.compensated_by == compensating:
                return Submission(compensating, self._runner.get(compensating).state, None, False)
            raise OperationConflict(
                "the operation changed, or the compensation's ID was taken, meanwhile: look"
                " again",
                operation_id=original.id,
            ) from None
        return Submission(operation.id, operation.state, decision, True)
