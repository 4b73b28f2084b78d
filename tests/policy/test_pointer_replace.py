"""`replace_at_pointers`: the one walk by which the feed hashes sensitive arguments and
an executor masks them on a span."""

from __future__ import annotations

from typing import Any

from ledger.audit.export import redact_arguments
from policy import replace_at_pointers

DOC: dict[str, Any] = {
    "a/b": {"c~d": "x"},
    "items": [{"secret": "s0"}, {"secret": "s1"}],
    "plain": "p",
}


def test_each_pointer_that_resolves_is_replaced_in_a_copy() -> None:
    pointers = ["/a~1b/c~0d", "/items/1/secret", "/items/9/secret", "/nowhere", ""]
    replaced = replace_at_pointers(DOC, pointers, lambda value: f"<{value}>")
    assert replaced == {
        "a/b": {"c~d": "<x>"},
        "items": [{"secret": "s0"}, {"secret": "<s1>"}],
        "plain": "p",
    }
    assert DOC["items"][1]["secret"] == "s1"  # the document itself is untouched
    assert replace_at_pointers(DOC, [], str) is DOC


def test_the_feed_hashes_a_sensitive_value_inside_an_array_too() -> None:
    hashed = redact_arguments(DOC, ("/items/0/secret",))
    assert set(hashed["items"][0]["secret"]) == {"sha256"}
    assert hashed["items"][1]["secret"] == "s1"
