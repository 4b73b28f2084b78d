"""Wire formats of opledger: pydantic models, their published JSON Schemas, canonical JSON.

Every message that crosses a process boundary is one of these models. The
same shapes are published as Draft 2020-12 JSON Schema files in
`schemas/json/`, so a host written in any language can take part.
"""

from schemas._canonical import CanonicalizationError, canonical_json, proposal_hash, sha256_hex
from schemas._decision import (
    ApprovalRequirement,
    CheckStage,
    Decision,
    DecisionOutcome,
    RepairStatus,
    RiskLevel,
    ValidationIssue,
)
from schemas._errors import ErrorCategory, ErrorEnvelope, ErrorInfo
from schemas._exceptions import OpledgerError
from schemas._proposal import RuntimeContext, ToolProposal
from schemas._publish import SCHEMA_DIR, WIRE_MODELS, render_schema, write_schemas
from schemas._result import Provenance, ResultEnvelope

__all__ = [
    "SCHEMA_DIR",
    "WIRE_MODELS",
    "ApprovalRequirement",
    "CanonicalizationError",
    "CheckStage",
    "Decision",
    "DecisionOutcome",
    "ErrorCategory",
    "ErrorEnvelope",
    "ErrorInfo",
    "OpledgerError",
    "Provenance",
    "RepairStatus",
    "ResultEnvelope",
    "RiskLevel",
    "RuntimeContext",
    "ToolProposal",
    "ValidationIssue",
    "canonical_json",
    "proposal_hash",
    "render_schema",
    "sha256_hex",
    "write_schemas",
]
