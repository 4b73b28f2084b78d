"""Small builders for test data, so each test states only what it is about."""

from __future__ import annotations

import copy
from typing import Any

from policy import ContractRegistry, ToolContract

SEARCH_INPUT: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "query": {"type": "string", "minLength": 2, "maxLength": 500},
        "source_types": {
            "type": "array",
            "items": {"enum": ["policy", "manual", "incident", "faq"]},
            "uniqueItems": True,
            "maxItems": 4,
            "default": ["policy", "manual"],
        },
        "date_from": {"type": ["string", "null"], "format": "date"},
        "top_k": {"type": "integer", "minimum": 1, "maximum": 20, "default": 8},
        "filters": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"language": {"enum": ["en", "ko"], "default": "en"}},
        },
    },
    "required": ["query", "source_types", "top_k"],
}

SEARCH_OUTPUT: dict[str, Any] = {
    "type": "object",
    "properties": {"items": {"type": "array"}, "truncated": {"type": "boolean"}},
    "required": ["items", "truncated"],
}


def contract_document(**overrides: Any) -> dict[str, Any]:
    """A valid contract document (as read from YAML) with `overrides` merged in."""
    document: dict[str, Any] = {
        "name": "search_documents",
        "version": "2.1.0",
        "description": {
            "summary": "Find evidence candidates in internal documents the user may read.",
            "use_when": "You need sources for an answer and do not know their IDs.",
            "avoid_when": "You already know the source ID; use read_document_span.",
        },
        "input_schema": copy.deepcopy(SEARCH_INPUT),
        "output_schema": copy.deepcopy(SEARCH_OUTPUT),
        "effect": "pure_read",
        "required_capabilities": ["documents:search"],
        "timeout_ms": 2000,
        "risk": {
            "base": "low",
            "rules": [
                {"when": {"argument": "/top_k", "gt": 10}, "level": "moderate", "reason": "wide"},
            ],
        },
    }
    document.update(overrides)
    return document


def make_contract(**overrides: Any) -> ToolContract:
    """A `ToolContract` built from `contract_document(**overrides)`."""
    return ToolContract.model_validate(contract_document(**overrides))


def blob_registry() -> ContractRegistry:
    """A registry of one tool, `store_blob`, whose argument is a string of any length
    (for tests about sizes: the sample tools bound their strings)."""
    registry = ContractRegistry()
    registry.register(make_contract(
        name="store_blob", version="1.0.0",
        input_schema={"type": "object", "additionalProperties": False,
                      "properties": {"blob": {"type": "string"}}, "required": ["blob"]},
        output_schema={"type": "object"}, required_capabilities=[], risk={"base": "low"},
    ))
    return registry
