"""docs/asyncapi.yaml is generated from the code, and describes the wire `schemas` defines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from ledger.server.asyncapi import CHANNELS, asyncapi_yaml
from schemas import SCHEMA_DIR, WIRE_MODELS

_DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "asyncapi.yaml"


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(_DOCUMENT.read_text())
    return loaded


def _inlined(node: Any, resolve: Any) -> Any:
    """`node` with every `$ref` replaced by what it points to (recursively)."""
    if isinstance(node, dict):
        if "$ref" in node:  # with its siblings (a description, a default) kept beside it
            siblings = {key: value for key, value in node.items() if key != "$ref"}
            return _inlined({**resolve(node["$ref"]), **siblings}, resolve)
        return {key: _inlined(value, resolve) for key, value in node.items() if key != "$defs"}
    if isinstance(node, list):
        return [_inlined(item, resolve) for item in node]
    return node


def _pointer(root: dict[str, Any]) -> Any:
    def resolve(reference: str) -> Any:
        assert reference.startswith("#/"), reference
        node: Any = root
        for part in reference[2:].split("/"):
            node = node[part]
        return node

    return resolve


def test_the_published_document_is_current() -> None:
    assert _DOCUMENT.read_text() == asyncapi_yaml(), (
        "docs/asyncapi.yaml drifted from the code:"
        " run `python -m ledger.server.asyncapi > docs/asyncapi.yaml` and commit the result"
    )


def test_it_is_asyncapi_3_with_every_channel(document: dict[str, Any]) -> None:
    assert document["asyncapi"] == "3.0.0"
    assert set(document["channels"]) == {channel.title for channel in CHANNELS}
    for channel in CHANNELS:
        assert document["channels"][channel.title]["address"] == channel.address
        action = document["operations"][channel.title]["action"]
        assert action == ("receive" if channel.received else "send"), channel.title


@pytest.mark.parametrize("channel", CHANNELS, ids=lambda channel: channel.title)
def test_each_payload_is_its_models_published_json_schema(
    document: dict[str, Any], channel: Any
) -> None:
    resolve = _pointer(document)
    [message] = document["channels"][channel.title]["messages"].values()
    payload = _inlined(resolve(message["$ref"])["payload"], resolve)
    [name] = [name for name, model in WIRE_MODELS.items() if model is channel.model]
    published = orjson.loads((SCHEMA_DIR / f"{name}.schema.json").read_bytes())
    expected = _inlined(published, _pointer(published))
    del expected["$schema"], expected["$id"]
    assert payload == expected


def test_every_wire_message_has_a_channel() -> None:
    sent = {channel.model for channel in CHANNELS}
    # The proposal, runtime context, decision, validation issue and plan travel inside others.
    parts = {"proposal", "runtime-context", "decision", "validation-issue", "plan-proposal"}
    assert {model for name, model in WIRE_MODELS.items() if name not in parts} == sent
