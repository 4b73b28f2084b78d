"""The operation ledger: an event-sourced record of every proposed tool call.

Public surface:

- `Ledger`: submit, approve, lease, record results, cancel, verify, export.
- `build_ledger` and `StorageConfig`: the composition root and the backend choice.
- `Operation`, `OperationState`, `ResultDisposition`: the domain model.
- The ledger's errors, all `schemas.OpledgerError`s.
"""

from ledger.adapters.storage import StorageConfig
from ledger.audit.verify import Finding, FindingKind, VerificationReport
from ledger.bootstrap import build_ledger
from ledger.domain.errors import (
    ApprovalRefused,
    IllegalTransition,
    LedgerError,
    OperationConflict,
    OperationNotFound,
    TamperDetected,
)
from ledger.domain.operation import Operation
from ledger.domain.states import OperationState, ResultDisposition
from ledger.projections.operations_view import OperationRow
from ledger.service import Ledger, Submission

__all__ = [
    "ApprovalRefused",
    "Finding",
    "FindingKind",
    "IllegalTransition",
    "Ledger",
    "LedgerError",
    "Operation",
    "OperationConflict",
    "OperationNotFound",
    "OperationRow",
    "OperationState",
    "ResultDisposition",
    "StorageConfig",
    "Submission",
    "TamperDetected",
    "VerificationReport",
    "build_ledger",
]
