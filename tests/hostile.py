"""Hypothesis strategies for what a careless or hostile host sends.

Values a model (or a bug in a host) can produce that plain JSON generators
never do: integers far beyond 64 bits, nesting deeper than any parser's
comfort, lone surrogates, NaN, Python objects that are not JSON at all, text
just under a size limit, names that are not subject tokens.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

__all__ = ["hostile_arguments", "hostile_json_text", "hostile_names", "python_values"]

_BIG_INTS = st.one_of(
    st.integers(),
    st.integers(min_value=2**53 - 2, max_value=2**53 + 2),
    st.integers(min_value=2**63 - 2, max_value=2**64 + 2),
    st.integers(min_value=2**64, max_value=2**200),
    st.integers(min_value=-(2**200), max_value=-(2**63)),
)
_TEXT = st.one_of(
    st.text(max_size=20),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=20),
    st.sampled_from(
        ["\ud800", "a\udfffb", "\x00", "a\x00b", "\n", "\u2028", "../etc/passwd", "a.b", "*", ">"]
    ),
)
_LEAVES = st.one_of(
    st.none(), st.booleans(), _BIG_INTS, st.floats(allow_nan=True, allow_infinity=True), _TEXT
)


def _nested(leaf: Any, depth: int, kind: str) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


_DEEP = st.builds(
    _nested, _LEAVES, st.integers(min_value=25, max_value=1_100), st.sampled_from(["list", "dict"])
)
_JSON_LIKE = st.recursive(
    _LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=5), st.dictionaries(_TEXT, children, max_size=5)
    ),
    max_leaves=25,
)


def python_values() -> st.SearchStrategy[Any]:
    """Anything the Python API could be handed as an argument value."""
    return st.one_of(
        _JSON_LIKE,
        _DEEP,
        st.binary(max_size=8),
        st.frozensets(st.integers(), max_size=3),
        st.tuples(st.integers()),
        st.builds(object),
    )


def hostile_arguments() -> st.SearchStrategy[Any]:
    """A proposal's `arguments` for the Python API: an object of anything, or anything."""
    return st.one_of(
        st.dictionaries(_TEXT, python_values(), max_size=4),
        st.builds(lambda d: {"query": "refunds", **d}, st.dictionaries(_TEXT, python_values(),
                                                                       max_size=3)),
        python_values(),
        hostile_json_text(),
    )


def _dumps(value: Any) -> str | None:
    """JSON text of `value` by the standard library (which writes huge integers and
    lone surrogates); None for what it cannot write at all."""
    try:
        return json.dumps(value, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        return None


def hostile_json_text() -> st.SearchStrategy[str]:
    """Arguments as JSON text: valid, deep, huge, or broken."""
    return st.one_of(
        st.builds(_dumps, st.dictionaries(_TEXT, _JSON_LIKE, max_size=4)).filter(bool),
        st.builds(
            lambda depth: '{"query": "ab", "x": ' + "[" * depth + "]" * depth + "}",
            st.integers(min_value=25, max_value=2_000),
        ),
        st.builds(
            lambda size: '{"query": "' + "q" * size + '"}',
            st.sampled_from([255 * 1024, 256 * 1024 - 13, 256 * 1024 + 1, 600 * 1024]),
        ),
        st.text(max_size=30),
    )


def hostile_names() -> st.SearchStrategy[str]:
    """Tool names and operation IDs as a host might send them."""
    return st.one_of(
        st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True),
        _TEXT,
        st.sampled_from(["", "x" * 129, "a.b", "a b", "../x", "ops.exec.x", "$JS.API.>"]),
    )
