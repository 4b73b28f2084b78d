"""Every published schema types every field, and every enum is the code's own list.

A host in another language reads `schemas/json/` and nothing else. A property
without a type leaves it guessing (it once had to read the Python code to learn
what `arguments` may be); an enum that differs from the values the code sends
makes a conforming host refuse a real message, or accept one the ledger never
sends.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from typing import Any, Literal, get_args

import orjson
import pytest

from ledger.domain.event_kinds import event_types
from ledger.domain.states import OperationState
from ledger.domain.values import OutcomeStatus
from policy import ToolFormat
from schemas import (
    SCHEMA_DIR,
    WIRE_MODELS,
    ApproverRequest,
    CheckStage,
    DecisionOutcome,
    ErrorCategory,
    LeaseDecision,
    OperationStatus,
    OperatorRequest,
    PlanRequest,
    RiskLevel,
    ToolsRequest,
    TrustLabel,
    WorkPurpose,
)

_NAMES = sorted(WIRE_MODELS)


def _published(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = orjson.loads((SCHEMA_DIR / f"{name}.schema.json").read_bytes())
    return loaded


def _properties(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every property schema in `node`, with its path (`$defs/Model/field`, `a/b`)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "properties" and isinstance(value, dict):
                for field_name, field_schema in value.items():
                    yield f"{path}/{field_name}", field_schema
                    yield from _properties(field_schema, f"{path}/{field_name}")
            elif key == "$defs" and isinstance(value, dict):
                for title, definition in value.items():
                    yield from _properties(definition, f"$defs/{title}")
            else:
                yield from _properties(value, path)
    elif isinstance(node, list):
        for item in node:
            yield from _properties(item, path)


def _typed(schema: dict[str, Any]) -> bool:
    """Whether a value's JSON type is fixed: `type`, `const`, a `$ref`, or a choice of them."""
    if "type" in schema or "$ref" in schema or "const" in schema:
        return True
    choices: list[dict[str, Any]] = schema.get("anyOf") or schema.get("oneOf") or []
    return bool(choices) and all(_typed(choice) for choice in choices)


@pytest.mark.parametrize("name", _NAMES)
def test_every_property_has_a_type(name: str) -> None:
    untyped = [path for path, schema in _properties(_published(name)) if not _typed(schema)]
    assert not untyped, f"{name}.schema.json: no type for {untyped}"


@pytest.mark.parametrize("name", _NAMES)
def test_every_object_says_whether_it_is_open(name: str) -> None:
    """A wire model refuses unknown fields; a free-form object (a tool's output, a
    stored event) says `additionalProperties: true`; the published outcome lists its
    keys. Nothing is left to a reader's default."""
    for path, schema in _properties(_published(name)):
        for branch in [schema, *(schema.get("anyOf") or []), *(schema.get("oneOf") or [])]:
            if branch.get("type") == "object" and "properties" not in branch:
                described = "description" in schema or "description" in branch
                open_ = "additionalProperties" in branch or described
                assert open_, f"{name}.schema.json{path}: an object of unknown shape"


def test_arguments_are_an_object_or_its_json_text() -> None:
    """What the issue asked: `proposal.arguments` had no type at all."""
    arguments = _published("proposal")["properties"]["arguments"]
    assert [branch["type"] for branch in arguments["oneOf"]] == ["object", "string"]
    text = arguments["oneOf"][1]
    assert (text["contentMediaType"], text["contentSchema"]) == (
        "application/json",
        {"type": "object"},
    )


def _literal_values(annotation: Any) -> list[str]:
    """The values of the `Literal` in `annotation` (`Literal[...] | None` included)."""
    for arg in (annotation, *get_args(annotation)):
        if getattr(arg, "__origin__", None) is Literal:
            return list(get_args(arg))
    raise AssertionError(f"no Literal in {annotation}")


ENUM_SOURCES: dict[str, list[str]] = {
    # Enum classes of `schemas`, published as `$defs/<ClassName>`.
    **{
        f"$defs/{enum.__name__}": [member.value for member in enum]
        for enum in (
            CheckStage,
            DecisionOutcome,
            ErrorCategory,
            LeaseDecision,
            RiskLevel,
            TrustLabel,
            WorkPurpose,
        )
    },
    # Fields whose values come from the ledger's own enums.
    "/state": [state.value for state in OperationState],
    "/outcome/status": [status.value for status in OutcomeStatus],
    "/outcome/category": [category.value for category in ErrorCategory],
    # Literals of the models themselves.
    "/cancel": _literal_values(OperationStatus.model_fields["cancel"].annotation),
}
"""Where each enum of the published schemas comes from: its path → the code's values
(with `/type`, the feed's event types, and `/command`, from `_sources`)."""


def _operation_event_names() -> list[str]:
    """The event classes nested in `Operation`, in the order the class declares them."""
    from ledger.domain.operation import Operation

    declared = [value for value in vars(Operation).values() if isinstance(value, type)]
    names = [event.__name__ for event in declared if event in event_types()]
    assert set(names) == {event.__name__ for event in event_types()}
    return names


def _plan_event_names() -> list[str]:
    """The event classes nested in `Plan`, in the order the class declares them."""
    from ledger.domain.events import LedgerEvent
    from ledger.domain.plan import Plan

    return [
        value.__name__
        for name, value in vars(Plan).items()
        if isinstance(value, type) and issubclass(value, LedgerEvent) and name != "Event"
    ]


def _sources(name: str) -> dict[str, list[str]]:
    sources = dict(ENUM_SOURCES)
    sources["/type"] = _operation_event_names() + _plan_event_names()
    if name == "operator-request":
        sources["/command"] = _literal_values(OperatorRequest.model_fields["command"].annotation)
    if name == "plan-request":
        sources["/command"] = _literal_values(PlanRequest.model_fields["command"].annotation)
    if name == "approver-request":
        sources["/command"] = _literal_values(ApproverRequest.model_fields["command"].annotation)
    if name in ("tools-request", "tools-reply"):
        # The formats policy.export_tool writes, no more and no fewer.
        formats = _literal_values(ToolsRequest.model_fields["format"].annotation)
        assert formats == list(get_args(ToolFormat))
        sources["/format"] = formats
    return sources


def _enums(node: Any, path: str = "") -> Iterator[tuple[str, list[Any]]]:
    """Every `enum` in `node`, with the path of the property (or `$defs` entry) it types."""
    if isinstance(node, dict):
        if "enum" in node:
            yield path, node["enum"]
        for key, value in node.items():
            if key == "properties":
                for field_name, field_schema in value.items():
                    yield from _enums(field_schema, f"{path}/{field_name}")
            elif key == "$defs":
                for title, definition in value.items():
                    yield from _enums(definition, f"$defs/{title}")
            elif key != "enum":
                yield from _enums(value, path)
    elif isinstance(node, list):
        for item in node:
            yield from _enums(item, path)


def _key(path: str) -> str:
    """The `ENUM_SOURCES` key of an enum at `path` (`$defs/X`, or its last property or two)."""
    if path.startswith("$defs/") and path.count("/") == 1:
        return path
    parts = path.split("/")
    return "/" + "/".join(parts[-2:]) if parts[-2] == "outcome" else "/" + parts[-1]


@pytest.mark.parametrize("name", _NAMES)
def test_every_enum_is_the_codes_own(name: str) -> None:
    sources = _sources(name)
    found = list(_enums(_published(name)))
    for path, values in found:
        key = _key(path)
        assert key in sources, f"{name}.schema.json {path}: an enum with no known source"
        assert values == sources[key], f"{name}.schema.json {path}"


def test_every_enum_class_of_the_wire_is_published() -> None:
    """A new StrEnum on the wire must land in `ENUM_SOURCES`, or this names it."""
    published = {
        key
        for name in _NAMES
        for key in (_key(path) for path, _ in _enums(_published(name)))
        if key.startswith("$defs/")
    }
    import schemas

    wire_enums = {
        f"$defs/{value.__name__}"
        for value in vars(schemas).values()
        if isinstance(value, type) and issubclass(value, StrEnum)
    }
    assert published <= wire_enums
    assert {key for key in ENUM_SOURCES if key.startswith("$defs/")} == published


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("proposal", ("created_at",)),
        ("result-envelope", ("$defs", "Provenance", "completed_at")),
        ("lease-reply", ("lease_expires_at",)),
        ("lease-reply", ("not_before",)),
        ("feed-event", ("timestamp",)),
    ],
)
def test_timestamps_are_date_times(name: str, path: tuple[str, ...]) -> None:
    node: Any = _published(name)
    if path[0] == "$defs":
        node = node["$defs"][path[1]]
        path = path[2:]
    schema = node["properties"][path[0]]
    branches = schema.get("anyOf", [schema])
    assert any(b.get("format") == "date-time" for b in branches), (name, path)
