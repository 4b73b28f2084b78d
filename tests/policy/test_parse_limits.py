"""The parse stage's limits at their exact boundaries: the last value accepted and the
first refused, each with its finding and pointer (`policy/_check/_parse.py`)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from policy._check._parse import DEFAULT_LIMITS, parse_arguments

MAX_SAFE = 2**53 - 1


def _codes(raw: Any) -> list[tuple[str, str]]:
    value, issues = parse_arguments(raw)
    assert (value is None) == bool(issues)
    return [(issue.code, issue.path) for issue in issues]


@pytest.mark.parametrize("sign", [1, -1], ids=["positive", "negative"])
def test_integers_up_to_two_to_the_53_minus_one_and_not_one_more(sign: int) -> None:
    assert _codes({"n": sign * MAX_SAFE}) == []
    assert _codes({"n": sign * (MAX_SAFE + 1)}) == [("number_out_of_range", "/n")]
    assert _codes(f'{{"n": {sign * MAX_SAFE}}}') == []  # as the model's JSON text
    assert _codes(f'{{"n": {sign * (MAX_SAFE + 1)}}}') == [("number_out_of_range", "/n")]


def _nested(depth: int) -> dict[str, Any]:
    """An object `depth` objects deep, the arguments object itself counted."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def test_thirty_two_levels_and_not_thirty_three() -> None:
    assert DEFAULT_LIMITS.max_depth == 32
    assert _codes(_nested(32)) == []
    assert _codes(_nested(33)) == [("too_deep", "/a" * 32)]
    # Arrays count as objects do.
    inner: Any = []
    for _ in range(31):
        inner = [inner]
    assert _codes({"list": inner}) == [("too_deep", "/list" + "/0" * 31)]
    assert _codes({"list": inner[0]}) == []


def _text_of(size: int) -> str:
    """JSON text of exactly `size` bytes: one string property, padded."""
    shell = len('{"q":""}')
    return '{"q":"' + "x" * (size - shell) + '"}'


def test_256_kib_of_arguments_and_not_one_byte_more() -> None:
    limit = DEFAULT_LIMITS.max_bytes
    assert limit == 256 * 1024
    assert len(_text_of(limit).encode()) == limit
    assert _codes(_text_of(limit)) == []
    assert _codes(_text_of(limit + 1)) == [("too_large", "")]
    # An object is measured once encoded, the same way.
    as_object = orjson.loads(_text_of(limit))
    assert _codes(as_object) == []
    assert _codes(orjson.loads(_text_of(limit + 1))) == [("too_large", "")]
