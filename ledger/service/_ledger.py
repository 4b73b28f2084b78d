"""`Ledger`: the service layer's facade, wiring one command runner to every use case.

Callers that need one use case take it (`ledger.leasing`, `ledger.recording`, …);
the facade's methods are those use cases' methods, bound, so that a caller
needing several holds one object.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from ledger.adapters.event_tables import EventTableReader, EventTables
from ledger.adapters.eventstore import EventStoreApp
from ledger.adapters.results import ResultStore
from ledger.adapters.sql import SqlDatabase
from ledger.audit.seal import Sealer
from ledger.audit.verify import DEFAULT_SEAL_GRACE
from ledger.budget import LedgerBudgetCounter
from ledger.domain.errors import LedgerError
from ledger.domain.operation import Operation
from ledger.projections.operations_view import OperationsProjector
from ledger.retention import KEPT_REJECTED_BYTES
from ledger.service._approvals import Approvals
from ledger.service._audit import Audit
from ledger.service._compensation import Compensations
from ledger.service._contracts import PinnedContracts
from ledger.service._leasing import Leasing
from ledger.service._plans import Planning
from ledger.service._read_models import ReadModels
from ledger.service._results import ResultRecording
from ledger.service._runner import CommandRunner
from ledger.service._settling import Settling
from ledger.service._status import StatusReader
from ledger.service._submission import Submission, Submissions
from ledger.service._sweeps import Sweeps
from policy import ProposalChecker, ToolContract
from schemas import LeaseReply, RuntimeContext, ToolProposal, new_operation_id

__all__ = ["Ledger"]

def _utcnow() -> datetime:
    return datetime.now(UTC)

class Ledger:
    """Submit, approve, lease, record, settle and audit operations."""

    def __init__(
        self,
        *,
        events: EventStoreApp,
        db: SqlDatabase,
        checker: ProposalChecker,
        projector: OperationsProjector | None = None,
        budget: LedgerBudgetCounter | None = None,
        clock: Callable[[], datetime] = _utcnow,
        new_id: Callable[[], str] = new_operation_id,
        lease_grace: timedelta = timedelta(seconds=60),
        conflict_retries: int = 5,
        cache_size: int = 2_000,
        cache_bytes: int = 16 * 1024 * 1024,
        kept_rejected_bytes: int = KEPT_REJECTED_BYTES,
        results: ResultStore | None = None,
        sealer: Sealer | None = None,
        seal_grace: timedelta = DEFAULT_SEAL_GRACE,
    ) -> None:
        self.clock = clock
        """What this ledger takes for now (its commands and sweeps ask it)."""
        self.events = events
        self.db = db
        self.checker = checker
        self.projector = projector or OperationsProjector(db, events.recorder)
        self.results = results or ResultStore(db)
        self.sealer = sealer
        self.tables = EventTables(events.storage)
        self.event_reader = EventTableReader(db, self.tables)
        self.runner = CommandRunner(
            events,
            self.event_reader,
            conflict_retries=conflict_retries,
            cache_size=cache_size,
            cache_bytes=cache_bytes,
        )
        self.budget = budget
        """The check's budget counter, if budgets are counted from this ledger."""
        if budget is not None:
            # The budget counts what this ledger stored before the view holds it.
            self.runner.on_stored(budget.stored)
        self.contracts = PinnedContracts(checker.catalog)
        self.read_models = ReadModels(self.projector, sealer)
        self.submissions = Submissions(
            self.runner,
            checker,
            clock=clock,
            new_id=new_id,
            budget=budget,
            kept_rejected_bytes=kept_rejected_bytes,
        )
        self.approvals = Approvals(self.runner, clock=clock)
        self.status_reader = StatusReader(self.runner, self.results)
        self.plans = Planning(
            self.runner, checker, self.submissions, self.status_reader, clock=clock, budget=budget
        )
        self.leasing = Leasing(self.runner, self.contracts, clock=clock, lease_grace=lease_grace)
        self.recording = ResultRecording(self.runner, self.contracts, clock=clock)
        self.compensations = Compensations(
            self.runner, checker, self.submissions, self.status_reader, clock=clock
        )
        self.settling = Settling(self.runner, clock=clock)
        self.sweeps = Sweeps(
            self.runner, self.projector, clock=clock, refresh=self.read_models.refresh
        )
        self.audit = Audit(
            self.event_reader,
            checker.catalog,
            clock=clock,
            own_key=sealer.key.public_key if sealer is not None else None,
            seal_grace=seal_grace,
        )

        # The use cases' methods, bound (their docstrings are theirs).
        self.get = self.runner.get
        self.history = self.runner.history
        self.refresh = self.read_models.refresh
        self.seal_now = self.read_models.seal_now
        self.submit_many = self.submissions.submit_many
        self.retry = self.submissions.retry
        self.compensate = self.compensations.compensate
        self.propose_plan = self.plans.propose
        self.plan_status = self.plans.status
        self.approve_plan = self.plans.approve
        self.deny_plan = self.plans.deny
        self.cancel_plan = self.plans.cancel
        self.retry_plan = self.plans.retry
        self.advance_plan = self.plans.advance
        self.compensate_plan = self.plans.compensate
        self.approve = self.approvals.approve
        self.deny = self.approvals.deny
        self.lease_many = self.leasing.lease_many
        self.status = self.status_reader.status
        self.record_result = self.recording.record_result
        self.record_results = self.recording.record_results
        self.expire_approvals = self.sweeps.expire_approvals
        self.expire_leases = self.sweeps.expire_leases
        self.cancel = self.settling.cancel
        self.start_reconciliation = self.settling.start_reconciliation
        self.reconcile = self.settling.reconcile
        self.resolve = self.settling.resolve
        self.note_publication_set_aside = self.settling.note_publication_set_aside
        self.verify = self.audit.verify
        self.export = self.audit.export
        self.stored_rows = self.audit.stored_rows
        self.stored_rows_after = self.event_reader.rows_after

    @property
    def events_table(self) -> str:
        """The name of the table that holds the events (for auditors' direct reads)."""
        return self.tables.events_table

    @property
    def seal_grace(self) -> timedelta:
        """How long an event may stay unsealed before verify reports it."""
        return self.audit.seal_grace

    def contract_of(self, operation: Operation) -> ToolContract | None:
        """The pinned contract the operation was checked against, if still pinned."""
        return self.contracts.of(operation)

    def submit(self, proposal: ToolProposal, context: RuntimeContext, host: str = "") -> Submission:
        """Record and check one proposal. Same ID and call again: the existing operation.

        `host` names the agent host that sent it (from its authenticated
        subject), so outcomes go back to that host only, and the proposal's
        operation ID is that host's own (`schemas.ledger_operation_id`).
        Raises the `LedgerError` that refused it, if one did.
        """
        answer = self.submissions.submit_many([(proposal, context, host)])[0]
        if isinstance(answer, LedgerError):
            raise answer
        return answer

    def lease(self, operation_id: str, *, executor: str, tool: str | None = None) -> LeaseReply:
        """Answer an executor's lease request for one work item (see `Leasing.lease_many`)."""
        answer = self.leasing.lease_many([(operation_id, executor, tool)])[0]
        if isinstance(answer, LedgerError):
            raise answer
        return answer

    def close(self) -> None:
        """Release database connections."""
        self.db.close()
        self.events.close()

