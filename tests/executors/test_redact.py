"""Redaction of tool output: each rule, the pointers it reports, limits, determinism."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executors import DEFAULT_POLICY, REDACTED, RedactionPolicy, redact, redact_text

JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9"
    ".eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ"
    ".SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
)


@pytest.mark.parametrize(
    ("text", "must_vanish", "must_stay"),
    [
        ("Authorization: Bearer abcdefghijklmnop0123456789", "abcdefghijklmnop0123456789", "Auth"),
        ("sent Bearer abcdefghijklmnop0123456789 along", "abcdefghijklmnop0123456789", "Bearer"),
        (
            "call it with bearer ZXhhbXBsZS10b2tlbi12YWx1ZQ== please",
            "ZXhhbXBsZS10b2tlbi12",
            "please",
        ),
        (f"the session is {JWT} ok", JWT, "the session is"),
        ("key AKIAIOSFODNN7EXAMPLE in config", "AKIAIOSFODNN7EXAMPLE", "in config"),
        ("Cookie: sid=31d4d96e407aad42; theme=dark", "31d4d96e407aad42", "Cookie:"),
        ("Set-Cookie: session=abc123def456; HttpOnly", "abc123def456", "Set-Cookie:"),
        ("connect with password=hunter2hunter2 now", "hunter2hunter2", "password="),
        ('{"api_key": "k-123456789"}', "k-123456789", "api_key"),
        ("db at postgres://admin:s3cr3t@db.internal/app", "s3cr3t", "db.internal/app"),
        ("token ghp_" + "a" * 36 + " leaked", "ghp_" + "a" * 36, "leaked"),
        ("slack xoxb-1234567890-abcdefghij end", "xoxb-1234567890-abcdefghij", "end"),
        ("stripe sk_live_" + "4" * 24 + " end", "sk_live_" + "4" * 24, "end"),
        (
            "-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----\nafter",
            "MIIEow",
            "after",
        ),
    ],
)
def test_secret_looking_text_is_removed(text: str, must_vanish: str, must_stay: str) -> None:
    result, changed = redact_text(text)
    assert changed
    assert must_vanish not in result
    assert must_stay in result
    assert REDACTED in result


@pytest.mark.parametrize(
    "text",
    [
        "The bearer of this letter is a friend.",
        "Refunds are accepted within 30 days of delivery.",
        "A token of appreciation",
        "x < y and y > z",
        "Line one\nLine two\twith a tab",
        "환불 정책 발효일: 2026-03-01",
        "at the office (room 12)",
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert redact_text(text) == (text, False)


def test_python_stack_trace_replaces_the_whole_string() -> None:
    text = (
        "lookup failed\nTraceback (most recent call last):\n"
        '  File "/srv/app/provider.py", line 42, in send\n'
        "    raise RuntimeError('db password is hunter2')\nRuntimeError: boom"
    )
    result, changed = redact_text(text)
    assert changed
    assert "hunter2" not in result
    assert "provider.py" not in result
    assert result == "[REDACTED:stack_trace]"


@pytest.mark.parametrize(
    "text",
    [
        "Error\n    at com.acme.Mailer.send(Mailer.java:88)\n    at com.acme.Api.run(Api.java:12)",
        "TypeError: x\n    at send (/app/mail.js:10:5)\n    at main (/app/index.js:3:1)",
        "goroutine 1 [running]:\nmain.main()\n\t/app/main.go:12 +0x1d",
    ],
)
def test_other_languages_stack_traces(text: str) -> None:
    assert redact_text(text)[0] == "[REDACTED:stack_trace]"


def test_a_single_frame_like_line_is_prose() -> None:
    text = 'See File "notes.txt", line 3 for details.'
    assert redact_text(text) == (text, False)


def test_control_characters_are_removed_except_newline_and_tab() -> None:
    text = "a\x00b\x07c\x1bd\re\nf\tg\x7fh\u202ei\u200bj\ufeffk"
    result, changed = redact_text(text)
    assert changed
    assert result == "abcde\nf\tghijk"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("before<script>alert(1)</script>after", "beforeafter"),
        ("a<SCRIPT type='x'>\nsteal()\n</SCRIPT >b", "ab"),
        ("a<iframe src='https://evil'></iframe>b", "ab"),
        ("a<style>body{}</style>b", "ab"),
        ("text <script src=x> never closed", "text "),
        ('<img src=x onerror="alert(1)">caption', "caption"),
        ("<a href='javascript:alert(1)'>x</a>", "x</a>"),
        ("[click](javascript:alert(1))", "[click](blocked:alert(1))"),
        ("keep <b>bold</b> text", "keep <b>bold</b> text"),
    ],
)
def test_active_html_is_removed(text: str, expected: str) -> None:
    assert redact_text(text)[0] == expected


def test_secret_split_by_a_script_tag_is_still_caught() -> None:
    # Removing the tag joins the two halves: the second round must catch it.
    text = "pass<script>x</script>word=hunter2hunter2"
    result, _ = redact_text(text)
    assert "hunter2" not in result


def test_long_strings_are_cut_to_the_limit_with_a_marker() -> None:
    policy = RedactionPolicy(max_string_chars=50)
    result, changed = redact_text("x" * 120, policy)
    assert changed
    assert len(result) == 50
    assert result.endswith(policy.truncation_marker)
    assert redact_text("y" * 50, policy) == ("y" * 50, False)


def test_values_under_sensitive_keys_are_removed_whatever_their_type() -> None:
    value = {
        "user": "alice",
        "access_token": "abc",
        "X-Api-Key": "k",
        "clientSecret": {"nested": "value"},
        "Set-Cookie": ["a=1", "b=2"],
        "password": 1234,
        "refresh_token": None,
        "session_id": "",
        "next_cursor": "c-1",
    }
    result = redact(value)
    assert result.value == {
        "user": "alice",
        "access_token": REDACTED,
        "X-Api-Key": REDACTED,
        "clientSecret": REDACTED,
        "Set-Cookie": REDACTED,
        "password": REDACTED,
        "refresh_token": None,
        "session_id": "",
        "next_cursor": "c-1",
    }
    assert result.pointers == (
        "/access_token",
        "/X-Api-Key",
        "/clientSecret",
        "/Set-Cookie",
        "/password",
    )


def test_pointers_name_exactly_the_changed_values() -> None:
    value = {
        "items": [
            {"text": "fine", "score": 0.5},
            {"text": "Authorization: Bearer abcdefghijklmnopqrstuvwxyz", "score": 0.4},
        ],
        "a/b": {"~x": "<script>1</script>"},
        "count": 3,
    }
    result = redact(value)
    assert result.pointers == ("/items/1/text", "/a~1b/~0x")
    assert result.value["items"][0] == {"text": "fine", "score": 0.5}
    assert result.value["count"] == 3
    assert result.changed


def test_long_lists_are_cut_and_reported_at_the_list() -> None:
    result = redact({"rows": list(range(10))}, RedactionPolicy(max_list_items=4))
    assert result.value == {"rows": [0, 1, 2, 3]}
    assert result.pointers == ("/rows",)


def test_too_deep_nesting_is_replaced() -> None:
    deep: Any = "leaf"
    for _ in range(5):
        deep = {"d": deep}
    result = redact(deep, RedactionPolicy(max_depth=3))
    assert result.value == {"d": {"d": {"d": "[REDACTED:too_deep]"}}}
    assert result.pointers == ("/d/d/d",)


def test_bytes_become_a_placeholder_and_other_types_are_refused() -> None:
    assert redact({"blob": b"\x00\x01"}).value == {"blob": "[REDACTED:binary]"}
    with pytest.raises(TypeError):
        redact({"when": object()})
    with pytest.raises(TypeError):
        redact({1: "x"})


def test_executor_secret_values_are_scrubbed_wherever_they_appear() -> None:
    policy = DEFAULT_POLICY.with_secrets(["sqlite:///var/lib/mail/provider.db", "short"])
    result = redact({"note": "stored at sqlite:///var/lib/mail/provider.db today, short"}, policy)
    assert result.value == {"note": f"stored at {REDACTED} today, short"}
    # Short values are not scrubbed: they would match ordinary words.
    assert "short" not in policy.secret_values


def test_input_is_not_modified() -> None:
    value = {"a": ["Bearer abcdefghijklmnopqrstuvwxyz", {"token": "t"}], "b": "x" * 30}
    before = copy.deepcopy(value)
    redact(value, RedactionPolicy(max_string_chars=20))
    assert value == before


def test_policy_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="marker"):
        RedactionPolicy(max_string_chars=5)
    with pytest.raises(ValueError, match="max_depth"):
        RedactionPolicy(max_depth=0)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.lists(
        st.sampled_from(
            [
                *"abc XYZ:=/<>\n\t\x00\x1b\r\u202e",
                *("Bearer ", "password=", "<script>", "</script>", "AKIA", "eyJ", "Traceback "),
                *("0123456789ABCDEF", '  File "x.py", line 1', "  at f (a.js:1:2)", "…"),
            ]
        ),
        max_size=14,
    ).map("".join),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(
            st.sampled_from(["text", "token", "a", "cookie", "n"]), children, max_size=4
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_redaction_is_deterministic_and_idempotent(value: Any) -> None:
    policy = RedactionPolicy(max_string_chars=30, max_list_items=3, max_depth=4)
    first = redact(value, policy)
    assert redact(value, policy) == first
    second = redact(first.value, policy)
    assert second.value == first.value
    assert second.pointers == ()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_no_control_characters_survive(text: str) -> None:
    result, _ = redact_text(text)
    assert all(ch in "\n\t" or ord(ch) >= 0x20 for ch in result)
    assert not any(0x7F <= ord(ch) <= 0x9F for ch in result)
