"""Publishing the wire models as JSON Schema files, for hosts in any language."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel

from schemas._decision import Decision, ValidationIssue
from schemas._errors import ErrorEnvelope
from schemas._messages import (
    ApproverRequest,
    CancelRequest,
    FeedEvent,
    LeaseReply,
    LeaseRequest,
    OperationStatus,
    OperatorRequest,
    ProposalEnvelope,
    ProposeReply,
    StatusRequest,
    ToolsReply,
    ToolsRequest,
    WorkItem,
)
from schemas._plans import PlanProposal, PlanRequest, PlanStatus
from schemas._proposal import RuntimeContext, ToolProposal
from schemas._result import ResultEnvelope

__all__ = ["SCHEMA_DIR", "WIRE_MODELS", "render_schema", "write_schemas"]

SCHEMA_DIR = Path(__file__).parent / "json"
"""Where the published `*.schema.json` files live."""

WIRE_MODELS: dict[str, type[BaseModel]] = {
    "proposal": ToolProposal,
    "runtime-context": RuntimeContext,
    "decision": Decision,
    "validation-issue": ValidationIssue,
    "error-envelope": ErrorEnvelope,
    "result-envelope": ResultEnvelope,
    "proposal-envelope": ProposalEnvelope,
    "propose-reply": ProposeReply,
    "work-item": WorkItem,
    "lease-request": LeaseRequest,
    "lease-reply": LeaseReply,
    "status-request": StatusRequest,
    "cancel-request": CancelRequest,
    "tools-request": ToolsRequest,
    "tools-reply": ToolsReply,
    "operator-request": OperatorRequest,
    "approver-request": ApproverRequest,
    "operation-status": OperationStatus,
    "feed-event": FeedEvent,
    "plan-proposal": PlanProposal,
    "plan-request": PlanRequest,
    "plan-status": PlanStatus,
}
"""File stem → model, for every wire format opledger publishes."""


def render_schema(name: str) -> bytes:
    """The JSON Schema document for wire model *name*, as published."""
    model = WIRE_MODELS[name]
    schema: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://opledger.dev/schemas/{name}.schema.json",
        **model.model_json_schema(mode="validation"),
    }
    return orjson.dumps(schema, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


def write_schemas(directory: Path = SCHEMA_DIR) -> list[Path]:
    """Regenerate every published schema file; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in WIRE_MODELS:
        path = directory / f"{name}.schema.json"
        path.write_bytes(render_schema(name))
        written.append(path)
    return written
