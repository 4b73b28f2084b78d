"""The ledger's service layer: use cases over the `Operation` aggregate.

Each use case (submission, approvals, leasing, result recording, status,
sweeps, settling, audit) lives in its own module and runs its commands through
one `CommandRunner`: load, run one command, save the new events in one atomic
append. Optimistic concurrency does the rest: when two writers race on one
operation, the loser's append fails, it reloads, and re-runs its command
against the fresh state, which either succeeds or refuses cleanly. `Ledger`
wires them together for callers that need several.
"""

from ledger.service._approvals import Approvals
from ledger.service._audit import Audit
from ledger.service._contracts import PinnedContracts
from ledger.service._leasing import LeaseRequest, Leasing
from ledger.service._ledger import Ledger
from ledger.service._read_models import ReadModels
from ledger.service._results import ResultRecording
from ledger.service._runner import Command, CommandRunner, OneAppendAbandoned
from ledger.service._settling import Settling
from ledger.service._status import StatusReader
from ledger.service._submission import (
    Submission,
    Submissions,
    SubmitItem,
    effect_preview,
    fingerprint,
)
from ledger.service._sweeps import Sweeps

__all__ = [
    "Approvals",
    "Audit",
    "Command",
    "CommandRunner",
    "LeaseRequest",
    "Leasing",
    "Ledger",
    "OneAppendAbandoned",
    "PinnedContracts",
    "ReadModels",
    "ResultRecording",
    "Settling",
    "StatusReader",
    "Submission",
    "Submissions",
    "SubmitItem",
    "Sweeps",
    "effect_preview",
    "fingerprint",
]
