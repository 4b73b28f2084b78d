"""Canonical JSON and the proposal hash."""

from __future__ import annotations

import pytest

from schemas import CanonicalizationError, canonical_json, proposal_hash


def test_canonical_json_sorts_keys_and_normalizes_numbers() -> None:
    assert canonical_json({"b": 1, "a": [1.0, "é"]}) == '{"a":[1,"é"],"b":1}'.encode()


def test_canonical_json_refuses_integers_beyond_2_53() -> None:
    with pytest.raises(CanonicalizationError):
        canonical_json({"n": 2**60})


def _hash(**overrides: object) -> str:
    fields: dict[str, object] = {
        "tool": "send_customer_email",
        "tool_version": "1.0.0",
        "arguments": {"recipient_ids": ["c-1"], "template": "support_received"},
        "actor": "alice",
        "tenant": "acme",
    }
    fields.update(overrides)
    return proposal_hash(**fields)  # type: ignore[arg-type]


def test_proposal_hash_ignores_key_order() -> None:
    reordered = {"template": "support_received", "recipient_ids": ["c-1"]}
    assert _hash() == _hash(arguments=reordered)


@pytest.mark.parametrize(
    "change",
    [
        {"tool": "send_email"},
        {"tool_version": "1.0.1"},
        {"arguments": {"recipient_ids": ["c-2"], "template": "support_received"}},
        {"actor": "bob"},
        {"tenant": "globex"},
    ],
)
def test_proposal_hash_changes_with_every_bound_field(change: dict[str, object]) -> None:
    assert _hash() != _hash(**change)
    assert len(_hash()) == 64
