"""Stage 1, parse: the model's arguments, often a JSON string, into an object."""

from __future__ import annotations

from typing import Any

import orjson

from policy._check._structure import json_type
from schemas import CheckStage, ValidationIssue

__all__ = ["parse_arguments"]


def _issue(code: str, message: str, **extra: Any) -> ValidationIssue:
    return ValidationIssue(
        stage=CheckStage.PARSE, code=code, message=message, repairable=True, **extra
    )


def parse_arguments(raw: Any) -> tuple[dict[str, Any] | None, list[ValidationIssue]]:
    """The arguments as a dict, or the findings that explain why they are not one."""
    value = raw
    if isinstance(raw, str | bytes):
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            # orjson's message names line, column and character: enough for a model to fix.
            return None, [_issue("json_syntax", f"arguments are not valid JSON: {exc}")]
    if not isinstance(value, dict):
        return None, [
            _issue(
                "not_an_object",
                "arguments must be a JSON object",
                expected="object",
                actual=json_type(value),
            )
        ]
    return value, []
