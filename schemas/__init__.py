"""Wire formats of opledger: pydantic models, their published JSON Schemas, canonical JSON.

Beside the formats, the wire layout every process shares: subjects, stream
and consumer names, inbox prefixes, and `PullConsumer`, the one way any of
them reads a JetStream work queue.

Every message that crosses a process boundary is one of these models. The
same shapes are published as Draft 2020-12 JSON Schema files in
`schemas/json/`, so a host written in any language can take part.
"""

from schemas._canonical import DIGEST_PATTERN, canonical_json, proposal_hash, sha256_hex
from schemas._decision import (
    REPAIR_EXHAUSTED,
    REPAIR_TARGET_INVALID,
    ApprovalRequirement,
    CheckStage,
    Decision,
    DecisionOutcome,
    RepairStatus,
    RiskLevel,
    ValidationIssue,
)
from schemas._errors import ErrorCategory, ErrorEnvelope, ErrorInfo
from schemas._exceptions import CanonicalizationError, OpledgerError
from schemas._messages import (
    ApproverRequest,
    CancelRequest,
    FeedEvent,
    LeaseDecision,
    LeaseReply,
    LeaseRequest,
    OperationStatus,
    OperatorRequest,
    ProposalEnvelope,
    ProposeReply,
    StatusRequest,
    WorkItem,
    WorkPurpose,
)
from schemas._proposal import RuntimeContext, ToolProposal
from schemas._publish import SCHEMA_DIR, WIRE_MODELS, render_schema, write_schemas
from schemas._pull import PullConsumer
from schemas._result import (
    CANCELLED_BEFORE_EFFECT,
    RECONCILE_UNSUPPORTED,
    Provenance,
    ResultEnvelope,
    ResultOutcome,
    TrustLabel,
)
from schemas._subjects import (
    FEED_AUDITOR_CONSUMER,
    FEED_STREAM,
    OPERATION_ID_PATTERN,
    RESULTS_CONSUMER,
    RESULTS_STREAM,
    TOKEN_PATTERN,
    WORK_STREAM,
    Subjects,
    check_token,
    feed_message_id,
    host_operation_id,
    inbox_prefix,
    ledger_operation_id,
    new_operation_id,
    result_message_id,
    work_consumer,
    work_message_id,
)

__all__ = [
    "CANCELLED_BEFORE_EFFECT",
    "DIGEST_PATTERN",
    "FEED_AUDITOR_CONSUMER",
    "FEED_STREAM",
    "OPERATION_ID_PATTERN",
    "RECONCILE_UNSUPPORTED",
    "REPAIR_EXHAUSTED",
    "REPAIR_TARGET_INVALID",
    "RESULTS_CONSUMER",
    "RESULTS_STREAM",
    "SCHEMA_DIR",
    "TOKEN_PATTERN",
    "WIRE_MODELS",
    "WORK_STREAM",
    "ApprovalRequirement",
    "ApproverRequest",
    "CancelRequest",
    "CanonicalizationError",
    "CheckStage",
    "Decision",
    "DecisionOutcome",
    "ErrorCategory",
    "ErrorEnvelope",
    "ErrorInfo",
    "FeedEvent",
    "LeaseDecision",
    "LeaseReply",
    "LeaseRequest",
    "OperationStatus",
    "OperatorRequest",
    "OpledgerError",
    "ProposalEnvelope",
    "ProposeReply",
    "Provenance",
    "PullConsumer",
    "RepairStatus",
    "ResultEnvelope",
    "ResultOutcome",
    "RiskLevel",
    "RuntimeContext",
    "StatusRequest",
    "Subjects",
    "ToolProposal",
    "TrustLabel",
    "ValidationIssue",
    "WorkItem",
    "WorkPurpose",
    "canonical_json",
    "check_token",
    "feed_message_id",
    "host_operation_id",
    "inbox_prefix",
    "ledger_operation_id",
    "new_operation_id",
    "proposal_hash",
    "render_schema",
    "result_message_id",
    "sha256_hex",
    "work_consumer",
    "work_message_id",
    "write_schemas",
]
