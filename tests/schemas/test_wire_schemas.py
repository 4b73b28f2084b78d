"""The published JSON Schema files match the pydantic models they are generated from."""

from __future__ import annotations

import orjson
import pytest
from jsonschema import Draft202012Validator
from pydantic import ValidationError

from schemas import (
    SCHEMA_DIR,
    WIRE_MODELS,
    ResultEnvelope,
    ToolProposal,
    TrustLabel,
    render_schema,
)


@pytest.mark.parametrize("name", sorted(WIRE_MODELS))
def test_published_schema_matches_model(name: str) -> None:
    path = SCHEMA_DIR / f"{name}.schema.json"
    assert path.exists(), f"{path} is missing: run `python -m schemas`"
    assert path.read_bytes() == render_schema(name), (
        f"{path.name} drifted from its model: run `python -m schemas` and commit the result"
    )


@pytest.mark.parametrize("name", sorted(WIRE_MODELS))
def test_published_schema_is_valid_draft_2020_12(name: str) -> None:
    Draft202012Validator.check_schema(
        orjson.loads((SCHEMA_DIR / f"{name}.schema.json").read_bytes())
    )


def test_a_model_instance_validates_against_its_published_schema() -> None:
    schema = orjson.loads((SCHEMA_DIR / "proposal.schema.json").read_bytes())
    proposal = ToolProposal(
        proposal_id="p-1",
        conversation_id="c-1",
        requested_by_user_id="alice",
        tool_name="search_documents",
        arguments='{"query": "refund"}',
    )
    Draft202012Validator(schema).validate(orjson.loads(proposal.model_dump_json()))
    bad = {"proposal_id": "p-1", "tool_name": "x", "arguments": {}, "surprise": 1}
    assert not Draft202012Validator(schema).is_valid(bad)


@pytest.mark.parametrize("label", ["trusted", "verified", "", "UNTRUSTED"])
def test_a_result_cannot_claim_any_trust_but_untrusted(label: str) -> None:
    """Before: `trust` was a free string, and a result saying "trusted" was recorded so."""
    provenance = {"tool": "t", "tool_version": "1.0.0", "executor": "e", "attempt": 1,
                  "latency_ms": 1.0, "completed_at": "2026-11-29T10:00:00Z"}
    envelope = {"operation_id": "h1/op", "fencing_token": 1, "ok": True, "data": {},
                "provenance": provenance}
    assert ResultEnvelope.model_validate(envelope).provenance.trust is TrustLabel.UNTRUSTED
    with pytest.raises(ValidationError):
        ResultEnvelope.model_validate(envelope | {"provenance": provenance | {"trust": label}})
    schema = orjson.loads((SCHEMA_DIR / "result-envelope.schema.json").read_bytes())
    errors = list(Draft202012Validator(schema).iter_errors(
        envelope | {"provenance": provenance | {"trust": label}}
    ))
    assert errors, "the published schema must refuse it too, for hosts in other languages"


@pytest.mark.parametrize("operation_id", ["op-\x00", "h1/op\n", "h1/../op", "", "a/b/c", "x" * 300])
def test_a_result_names_an_operation_id_as_the_ledger_writes_them(operation_id: str) -> None:
    """Before: any string. A NUL in it reached PostgreSQL (which refuses NUL in text) and,
    taken for an outage, failed the whole turn of other hosts' requests. Work items and
    lease requests already held IDs to this pattern, so no executor can hold another."""
    provenance = {"tool": "t", "tool_version": "1.0.0", "executor": "e", "attempt": 1,
                  "latency_ms": 1.0, "completed_at": "2026-11-29T10:00:00Z"}
    envelope = {"operation_id": "h1/op-1_a", "fencing_token": 1, "ok": True, "data": {},
                "provenance": provenance}
    assert ResultEnvelope.model_validate(envelope).operation_id == "h1/op-1_a"
    with pytest.raises(ValidationError):
        ResultEnvelope.model_validate(envelope | {"operation_id": operation_id})
    if operation_id.endswith("\n"):
        return  # Python's `re` lets `$` match before a final newline; ECMA-262's does not
    schema = orjson.loads((SCHEMA_DIR / "result-envelope.schema.json").read_bytes())
    assert not Draft202012Validator(schema).is_valid(envelope | {"operation_id": operation_id})
