"""Canonical JSON and the proposal hash."""

from __future__ import annotations

from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import CanonicalizationError, OpledgerError, canonical_json, proposal_hash
from schemas._canonical import _orjson_is_canonical


def test_canonical_json_sorts_keys_and_normalizes_numbers() -> None:
    assert canonical_json({"b": 1, "a": [1.0, "é"]}) == '{"a":[1,"é"],"b":1}'.encode()


def test_canonical_json_refuses_integers_beyond_2_53() -> None:
    with pytest.raises(CanonicalizationError):
        canonical_json({"n": 2**60})


def test_canonicalization_error_is_an_opledger_error_and_still_a_value_error() -> None:
    with pytest.raises(CanonicalizationError) as caught:
        canonical_json({"n": float("nan")})
    assert isinstance(caught.value, OpledgerError)
    assert isinstance(caught.value, ValueError)
    assert caught.value.code == "NOT_CANONICAL_JSON"


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


# The orjson fast path must agree with the reference implementation byte for byte.

_any_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
    | _any_text,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(_any_text, children, max_size=4),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(value=_json)
def test_fast_path_is_byte_identical_to_rfc8785(value: Any) -> None:
    assert canonical_json(value) == rfc8785.dumps(value)


@pytest.mark.parametrize(
    "value",
    [
        {"\ue000": 1, "\U0001f600": 2},  # UTF-16 order differs from code-point order
        {"x": 1.5},
        {"x": 1.0},
        {"n": 2**53},
    ],
)
def test_values_outside_the_fast_path_take_the_reference(value: Any) -> None:
    assert not _orjson_is_canonical(value)
    try:
        expected = rfc8785.dumps(value)
    except rfc8785.CanonicalizationError:
        with pytest.raises(CanonicalizationError):
            canonical_json(value)
        return
    assert canonical_json(value) == expected


def test_supplementary_keys_sort_by_utf16_code_units() -> None:
    # U+E000 sorts after U+1F600 in UTF-16 (0xD83D < 0xE000) but before it by code point.
    assert canonical_json({"\ue000": 1, "\U0001f600": 2}).index("😀".encode()) < canonical_json(
        {"\ue000": 1, "\U0001f600": 2}
    ).index("\ue000".encode())
