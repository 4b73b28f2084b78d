"""Every error the ledger's APIs raise, in one place: each is a `schemas.OpledgerError`
with a `code` and a `category`.

Defined where they are raised (the domain's in `ledger.domain.errors`, the
broker's in `ledger.nats.errors`, …) and re-exported here, so a caller catches
them without knowing the module layout. The errors of the `opledger` commands
and of the service's internals are the commands' own (`ledger.entrypoints`,
`ledger.server`).
"""

from ledger.audit.seal import SealKeyError, SealRefused
from ledger.bootstrap import NoLedger
from ledger.client import LedgerUnavailable, OutcomeTimeout, RequestRefused
from ledger.config import ConfigError
from ledger.domain.errors import (
    ApprovalRefused,
    IllegalTransition,
    InvalidArgument,
    InvalidProposal,
    LedgerError,
    OperationConflict,
    OperationNotFound,
    PlanNotFound,
    ResultIntegrityError,
    TamperDetected,
)
from ledger.embedded import StackNotRunning, StackStartError
from ledger.mcp import McpConfigError, RequestStateRefused, UpstreamUnavailable
from ledger.nats.errors import (
    CredentialsError,
    FeedAccessDenied,
    FeedReadError,
    FeedReadTimeout,
    NatsServerNotFound,
    NatsServerStartError,
    NatsSetupError,
    TopologyError,
    UnknownIdentity,
)
from ledger.service import OneAppendAbandoned
from ledger.web import NotAuthenticated
from schemas import OpledgerError

__all__ = [
    "ApprovalRefused",
    "ConfigError",
    "CredentialsError",
    "FeedAccessDenied",
    "FeedReadError",
    "FeedReadTimeout",
    "IllegalTransition",
    "InvalidArgument",
    "InvalidProposal",
    "LedgerError",
    "LedgerUnavailable",
    "McpConfigError",
    "NatsServerNotFound",
    "NatsServerStartError",
    "NatsSetupError",
    "NoLedger",
    "NotAuthenticated",
    "OneAppendAbandoned",
    "OperationConflict",
    "OperationNotFound",
    "OpledgerError",
    "OutcomeTimeout",
    "PlanNotFound",
    "RequestRefused",
    "RequestStateRefused",
    "ResultIntegrityError",
    "SealKeyError",
    "SealRefused",
    "StackNotRunning",
    "StackStartError",
    "TamperDetected",
    "TopologyError",
    "UnknownIdentity",
    "UpstreamUnavailable",
]
