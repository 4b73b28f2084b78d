"""Stage 3, structure: Draft 2020-12 validation with repair-oriented findings.

Valid arguments (the common case) are confirmed by `jsonschema-rs` in well
under a microsecond; only invalid ones pay for `jsonschema`'s detailed error
walk, which is the one that explains each fault with path, keyword, expected
and actual. Neither coerces types: "10" is not 10.
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

from policy._registry import json_pointer
from schemas import CheckStage, ValidationIssue

__all__ = ["CompiledSchema", "apply_defaults", "json_type"]

_MAX_ACTUAL_CHARS = 120

# keyword → (issue code, message template)
_CODES: dict[str, str] = {
    "required": "missing",
    "additionalProperties": "extra",
    "unevaluatedProperties": "extra",
    "type": "wrong_type",
    "enum": "enum",
    "const": "enum",
    "minimum": "range",
    "maximum": "range",
    "exclusiveMinimum": "range",
    "exclusiveMaximum": "range",
    "multipleOf": "range",
    "minLength": "length",
    "maxLength": "length",
    "minItems": "length",
    "maxItems": "length",
    "minProperties": "length",
    "maxProperties": "length",
    "pattern": "format",
    "format": "format",
    "uniqueItems": "duplicate_items",
}


def json_type(value: Any) -> str:
    """The JSON type name of a Python value decoded from JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _safe_actual(value: Any) -> Any:
    """A short, safe echo of what the model sent: scalars clipped, containers summarized."""
    if isinstance(value, str):
        return value if len(value) <= _MAX_ACTUAL_CHARS else value[:_MAX_ACTUAL_CHARS] + "…"
    if isinstance(value, bool | int | float) or value is None:
        return value
    if isinstance(value, list):
        return f"array of {len(value)} items"
    if isinstance(value, dict):
        return f"object with {len(value)} properties"
    return json_type(value)


def apply_defaults(schema: dict[str, Any], instance: Any) -> tuple[Any, list[str]]:
    """Fill in `default` values for absent properties, recursively, and say where.

    Returns the normalized instance and the JSON pointers of every default
    applied, so the ledger records exactly what was assumed. The input is never
    modified: objects on the way to an inserted default are copied, everything
    else is shared (arguments are treated as immutable from here on).
    """
    applied: list[str] = []
    return _fill(schema, instance, (), applied), applied


def _fill(schema: Any, instance: Any, path: tuple[object, ...], applied: list[str]) -> Any:
    if not isinstance(schema, dict) or not isinstance(instance, dict):
        return instance
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return instance
    result: dict[str, Any] | None = None
    for name, sub in properties.items():
        if not isinstance(sub, dict):
            continue
        if name not in instance:
            if "default" in sub:
                result = result if result is not None else dict(instance)
                result[name] = copy.deepcopy(sub["default"])
                applied.append(json_pointer((*path, name)))
            continue
        filled = _fill(sub, instance[name], (*path, name), applied)
        if filled is not instance[name]:
            result = result if result is not None else dict(instance)
            result[name] = filled
    return result if result is not None else instance


class CompiledSchema:
    """A tool's input (or output) schema, compiled once for both validators."""

    def __init__(
        self,
        schema: dict[str, Any],
        *,
        stage: CheckStage = CheckStage.STRUCTURE,
        max_issues: int = 50,
    ):
        self.schema = schema
        self._stage = stage
        # One more than is reported, so that the checker can say more were cut.
        self._max_errors = max_issues + 1
        self._fast = jsonschema_rs.validator_for(schema, validate_formats=True)
        self._detailed = Draft202012Validator(
            schema, format_checker=Draft202012Validator.FORMAT_CHECKER
        )

    def is_valid(self, instance: Any) -> bool:
        """Fast validity check."""
        return bool(self._fast.is_valid(instance))

    def issues(self, instance: Any) -> list[ValidationIssue]:
        """Every structural fault in `instance`, or an empty list when it is valid."""
        if self._fast.is_valid(instance):
            return []
        # Bounded: explaining every error of a 100,000-item array would cost
        # seconds and the findings would be cut to a few dozen anyway.
        errors = sorted(
            itertools.islice(self._detailed.iter_errors(instance), self._max_errors),
            key=lambda e: list(e.absolute_path),
        )
        issues = [issue for error in errors for issue in self._explain(error)]
        if not issues:
            # The two validators disagree (python-jsonschema's `re` is laxer than
            # ECMA-262: `$` matches before a trailing newline, `\d` takes non-ASCII
            # digits). The stricter verdict stands; explain it from jsonschema-rs.
            issues = [
                self._explain_fast(error)
                for error in itertools.islice(self._fast.iter_errors(instance), self._max_errors)
            ]
        return issues

    def _explain_fast(self, error: Any) -> ValidationIssue:
        keyword = str(error.schema_path[-1]) if error.schema_path else "invalid"
        return self._issue(
            _CODES.get(keyword, "invalid"),
            list(error.instance_path),
            keyword,
            None,
            _safe_actual(error.instance),
            error.message if len(error.message) <= 200 else error.message[:200] + "…",
        )

    def _explain(self, error: ValidationError) -> Iterator[ValidationIssue]:
        keyword = str(error.validator)
        if keyword in ("anyOf", "oneOf") and error.context:
            # Report the alternative that came closest rather than a bare "no match".
            best = best_match(error.context)
            if best is not None:
                yield from self._explain(best)
                return
            return
        path: list[object] = list(error.absolute_path)
        code = _CODES.get(keyword, "invalid")
        expected: Any = error.validator_value
        actual: Any = _safe_actual(error.instance)
        message = error.message if len(error.message) <= 200 else error.message[:200] + "…"
        if keyword == "required":
            present = error.instance if isinstance(error.instance, dict) else {}
            for name in expected:
                if name not in present:
                    yield self._issue(
                        "missing",
                        [*path, name],
                        keyword,
                        "present",
                        None,
                        f"'{name}' is required",
                    )
            return
        if keyword in ("additionalProperties", "unevaluatedProperties"):
            schema = error.schema if isinstance(error.schema, dict) else {}
            allowed = set(schema.get("properties", {}))
            patterns = [re.compile(p) for p in schema.get("patternProperties", {})]
            present = error.instance if isinstance(error.instance, dict) else {}
            for name in present:
                if name not in allowed and not any(p.search(name) for p in patterns):
                    yield self._issue(
                        "extra",
                        [*path, name],
                        keyword,
                        "absent",
                        _safe_actual(present[name]),
                        f"'{name}' is not a known property",
                    )
            return
        if keyword == "type":
            actual = json_type(error.instance)
            message = f"expected {expected}, got {actual}"
        elif code == "length":
            actual = len(error.instance) if hasattr(error.instance, "__len__") else actual
        yield self._issue(code, path, keyword, expected, actual, message)

    def _issue(
        self,
        code: str,
        path: list[object],
        keyword: str,
        expected: Any,
        actual: Any,
        message: str,
    ) -> ValidationIssue:
        return ValidationIssue(
            stage=self._stage,
            code=code,
            message=message,
            path=json_pointer(path),
            keyword=keyword,
            expected=expected,
            actual=actual,
            repairable=True,
        )
