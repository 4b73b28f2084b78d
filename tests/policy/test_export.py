"""Model-facing tool definitions: OpenAI, Anthropic and MCP from one contract."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from policy import ContractError, ToolContract, ToolFormatError
from policy._export import (
    StrictModeProblem,
    StrictModeReport,
    export_tool,
    openai_strict_report,
    to_anthropic_tool,
    to_mcp_tool,
    to_openai_tool,
)

DIALECT = "https://json-schema.org/draft/2020-12/schema"

# Fits OpenAI strict mode: every object closed, every property required,
# optional values expressed as nullable.
STRICT_INPUT: dict[str, Any] = {
    "$schema": DIALECT,
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "query": {"type": "string", "description": "What to look for."},
        "top_k": {"type": "integer", "minimum": 1, "maximum": 20},
        "date_from": {"type": ["string", "null"], "format": "date"},
        "filters": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"language": {"type": "string", "enum": ["en", "ko"]}},
            "required": ["language"],
        },
    },
    "required": ["query", "top_k", "date_from", "filters"],
}

OUTPUT: dict[str, Any] = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}}},
    "required": ["items"],
}

DESCRIPTION = (
    "Find evidence candidates in internal documents.\n"
    "Use when: You need sources for an answer.\n"
    "Do not use when: You already know the source ID."
)


def _contract(**overrides: Any) -> ToolContract:
    document: dict[str, Any] = {
        "name": "search_documents",
        "version": "1.0.0",
        "description": {
            "summary": "Find evidence candidates in internal documents.",
            "use_when": "You need sources for an answer.",
            "avoid_when": "You already know the source ID.",
        },
        "input_schema": copy.deepcopy(STRICT_INPUT),
        "output_schema": copy.deepcopy(OUTPUT),
        "effect": "pure_read",
        "timeout_ms": 2000,
        "risk": {"base": "low"},
    }
    document.update(overrides)
    return ToolContract.model_validate(document)


def _schema(**properties: Any) -> dict[str, Any]:
    """A strict-compliant root object with `properties`, all required."""
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": list(properties),
    }


def _without_dialect(schema: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in schema.items() if key != "$schema"}


def _paths(report: StrictModeReport) -> list[str]:
    return [problem.path for problem in report.problems]


# --- Shapes ---


def test_openai_tool_shape() -> None:
    tool = to_openai_tool(_contract())
    assert tool == {
        "type": "function",
        "function": {
            "name": "search_documents",
            "description": DESCRIPTION,
            "parameters": _without_dialect(STRICT_INPUT),
            "strict": True,
        },
    }


def test_openai_parameters_drop_schema_and_id() -> None:
    schema = {**STRICT_INPUT, "$id": "https://example.test/search.json"}
    parameters = to_openai_tool(_contract(input_schema=schema))["function"]["parameters"]
    assert "$schema" not in parameters
    assert "$id" not in parameters
    assert parameters["required"] == ["query", "top_k", "date_from", "filters"]


def test_anthropic_tool_shape() -> None:
    tool = to_anthropic_tool(_contract())
    assert tool == {
        "name": "search_documents",
        "description": DESCRIPTION,
        "input_schema": _without_dialect(STRICT_INPUT),
    }


def test_mcp_tool_shape() -> None:
    tool = to_mcp_tool(_contract())
    assert list(tool) == [
        "name",
        "title",
        "description",
        "inputSchema",
        "outputSchema",
        "annotations",
    ]
    assert tool["name"] == "search_documents"
    assert tool["title"] == "Search documents"
    assert tool["description"] == DESCRIPTION
    # MCP reads $schema to pick the dialect, so it is kept.
    assert tool["inputSchema"] == STRICT_INPUT
    assert tool["inputSchema"]["$schema"] == DIALECT
    assert tool["outputSchema"] == OUTPUT
    Draft202012Validator.check_schema(tool["inputSchema"])
    Draft202012Validator.check_schema(tool["outputSchema"])


def test_mcp_input_schema_is_a_valid_2020_12_schema_that_validates_arguments() -> None:
    validator = Draft202012Validator(to_mcp_tool(_contract())["inputSchema"])
    good = {"query": "refund", "top_k": 3, "date_from": None, "filters": {"language": "en"}}
    assert list(validator.iter_errors(good)) == []
    assert [e.validator for e in validator.iter_errors({**good, "top_k": 0})] == ["minimum"]


def test_mcp_omits_an_output_schema_that_is_not_an_object() -> None:
    tool = to_mcp_tool(_contract(output_schema={"type": "array", "items": {"type": "string"}}))
    assert "outputSchema" not in tool
    assert tool["inputSchema"] == STRICT_INPUT


def test_one_source_gives_three_formats_the_same_schema_and_description() -> None:
    contract = _contract()
    openai = to_openai_tool(contract)["function"]
    anthropic = to_anthropic_tool(contract)
    mcp = to_mcp_tool(contract)
    expected = _without_dialect(contract.input_schema)
    assert openai["parameters"] == expected
    assert anthropic["input_schema"] == expected
    assert _without_dialect(mcp["inputSchema"]) == expected
    assert openai["description"] == anthropic["description"] == mcp["description"] == DESCRIPTION
    assert openai["name"] == anthropic["name"] == mcp["name"] == "search_documents"


def test_exports_are_copies_not_views_of_the_contract() -> None:
    contract = _contract()
    to_openai_tool(contract)["function"]["parameters"]["properties"].clear()
    to_anthropic_tool(contract)["input_schema"]["required"].append("x")
    to_mcp_tool(contract)["outputSchema"]["properties"].clear()
    assert contract.input_schema == STRICT_INPUT
    assert contract.output_schema == OUTPUT


def test_export_tool_dispatches_to_each_format() -> None:
    contract = _contract()
    assert export_tool(contract, "openai") == to_openai_tool(contract)
    assert export_tool(contract, "anthropic") == to_anthropic_tool(contract)
    assert export_tool(contract, "mcp") == to_mcp_tool(contract)


def test_export_tool_refuses_an_unknown_format() -> None:
    with pytest.raises(ToolFormatError, match="unknown tool format 'gemini'") as caught:
        export_tool(_contract(), "gemini")  # type: ignore[arg-type]
    assert caught.value.code == "UNKNOWN_TOOL_FORMAT"


@pytest.mark.parametrize("fmt", ["openai", "anthropic", "mcp"])
def test_a_non_object_input_schema_is_refused(fmt: str) -> None:
    contract = _contract(input_schema={"type": "string"})
    with pytest.raises(ContractError) as caught:
        export_tool(contract, fmt)  # type: ignore[arg-type]
    assert caught.value.pointer == "/input_schema/type"


# --- OpenAI strict-mode report ---


def test_compliant_schema_fits() -> None:
    report = openai_strict_report(_without_dialect(STRICT_INPUT))
    assert report.fits is True
    assert report.problems == ()


def test_defs_refs_recursion_and_nested_any_of_fit() -> None:
    schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "steps": {"type": "array", "items": {"$ref": "#/$defs/step"}},
            "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
            "value": {"anyOf": [{"type": "string"}, {"type": "number"}]},
        },
        "required": ["steps", "child", "value"],
        "$defs": {
            "step": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"explanation": {"type": "string"}},
                "required": ["explanation"],
            }
        },
    }
    assert openai_strict_report(schema) == StrictModeReport(problems=())


def test_nested_object_without_additional_properties_false() -> None:
    schema = _schema(filters={"type": "object", "properties": {}, "required": []})
    report = openai_strict_report(schema)
    assert report.fits is False
    assert report.problems == (
        StrictModeProblem("/properties/filters", "an object must set additionalProperties: false"),
    )


def test_nested_object_allowing_additional_properties() -> None:
    schema = _schema(
        filters={"type": "object", "additionalProperties": {"type": "string"}, "required": []}
    )
    assert _paths(openai_strict_report(schema)) == ["/properties/filters/additionalProperties"]


def test_optional_property_not_in_required() -> None:
    schema = copy.deepcopy(_without_dialect(STRICT_INPUT))
    schema["properties"]["filters"]["required"] = []
    report = openai_strict_report(schema)
    assert _paths(report) == ["/properties/filters/properties/language"]
    assert "'language' is not in required" in report.problems[0].reason


def test_root_object_without_required_lists_every_property() -> None:
    schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"a": {"type": "string"}, "b/c": {"type": "string"}},
    }
    # "b/c" is escaped per RFC 6901.
    assert _paths(openai_strict_report(schema)) == ["/properties/a", "/properties/b~1c"]


@pytest.mark.parametrize(
    ("keyword", "value", "documented"),
    [
        ("allOf", [{"type": "string"}], True),
        ("not", {"type": "null"}, True),
        ("if", {"type": "string"}, True),
        ("dependentRequired", {}, True),
        ("oneOf", [{"type": "string"}], False),
        ("minLength", 2, False),
        ("maxLength", 9, False),
        ("uniqueItems", True, False),
        ("default", "x", False),
        ("patternProperties", {}, False),
        ("propertyNames", {"type": "string"}, False),
        ("minProperties", 1, False),
    ],
)
def test_unsupported_keyword_deep_inside(keyword: str, value: Any, documented: bool) -> None:
    leaf = {"type": "string", keyword: value}
    schema = _schema(
        outer=_schema(rows={"type": "array", "items": _schema(cell=leaf)}),
    )
    report = openai_strict_report(schema)
    path = f"/properties/outer/properties/rows/items/properties/cell/{keyword}"
    assert _paths(report) == [path]
    expected = "is not supported" if documented else "is not in the documented strict-mode"
    assert expected in report.problems[0].reason


def test_any_of_at_root() -> None:
    schema = {"anyOf": [_schema(a={"type": "string"}), _schema(b={"type": "string"})]}
    report = openai_strict_report(schema)
    assert report.fits is False
    assert _paths(report) == ["/anyOf", ""]
    assert report.problems[0].reason == "the root must be an object, not anyOf"


def test_nullable_root_is_refused() -> None:
    schema = {**_schema(a={"type": "string"}), "type": ["object", "null"]}
    assert _paths(openai_strict_report(schema)) == ["/type"]


def test_any_of_branches_are_checked_like_any_schema() -> None:
    schema = _schema(item={"anyOf": [{"type": "object", "properties": {}}, {"type": "null"}]})
    assert _paths(openai_strict_report(schema)) == ["/properties/item/anyOf/0"]


@pytest.mark.parametrize(
    ("subschema", "path", "reason_part"),
    [
        ({"type": "array"}, "/properties/x", "must give items"),
        ({"type": "array", "items": [{"type": "string"}]}, "/properties/x/items", "tuple-form"),
        ({"description": "anything"}, "/properties/x", "no 'type'"),
        ({"enum": ["a", "b"]}, "/properties/x", "no 'type'"),
        ({"type": "string", "format": "uri"}, "/properties/x/format", "format 'uri'"),
        ({"type": ["string", "integer"]}, "/properties/x/type", "one type plus 'null'"),
        ({"type": "text"}, "/properties/x/type", "unknown type"),
        ({"$ref": "#/$defs/missing"}, "/properties/x/$ref", "does not resolve"),
        ({"$ref": "https://example.test/s.json"}, "/properties/x/$ref", "only local"),
    ],
)
def test_other_shapes_strict_mode_refuses(
    subschema: dict[str, Any], path: str, reason_part: str
) -> None:
    report = openai_strict_report(_schema(x=subschema))
    assert _paths(report) == [path]
    assert reason_part in report.problems[0].reason


def test_ref_with_sibling_keywords() -> None:
    schema = {
        **_schema(x={"$ref": "#/$defs/s", "description": "a step"}),
        "$defs": {"s": {"type": "string"}},
    }
    # OpenAI's SDK inlines such a $ref because the API refuses it.
    assert openai_strict_report(schema).problems == (
        StrictModeProblem(
            "/properties/x", "a $ref must stand alone; strict mode refuses sibling keywords"
        ),
    )


def test_schema_identity_keys_are_reported_but_stripped_by_the_exporter() -> None:
    assert _paths(openai_strict_report(STRICT_INPUT)) == ["/$schema"]
    assert to_openai_tool(_contract())["function"]["strict"] is True


def test_nesting_deeper_than_ten_object_levels() -> None:
    schema: dict[str, Any] = _schema(leaf={"type": "string"})
    for _ in range(10):
        schema = _schema(n=schema)
    # Eleven objects: the root is level 1, so the innermost is level 11.
    report = openai_strict_report(schema)
    assert _paths(report) == ["/properties/n" * 10]
    assert report.problems[0].reason == "objects nest more than 10 levels deep"
    assert openai_strict_report(schema["properties"]["n"]).fits is True


def test_more_than_5000_properties_in_total() -> None:
    half = {f"p{i}": {"type": "boolean"} for i in range(2500)}
    assert openai_strict_report(_schema(a=_schema(**half), b=_schema(**half))).problems == (
        StrictModeProblem("", "5002 object properties in total; the limit is 5000"),
    )
    # Exactly at the limit is allowed.
    exactly = _schema(**half, **{f"q{i}": {"type": "null"} for i in range(2500)})
    assert openai_strict_report(exactly).fits is True


def test_enum_limits() -> None:
    many = {"type": "integer", "enum": list(range(600))}
    report = openai_strict_report(_schema(a=many, b=many))
    assert report.problems == (
        StrictModeProblem("", "1200 enum values in total; the limit is 1000"),
    )
    long_strings = {"type": "string", "enum": [f"{i:060d}" for i in range(260)]}
    report = openai_strict_report(_schema(a=long_strings))
    assert _paths(report) == ["/properties/a/enum"]
    assert "260 values totals 15600 characters" in report.problems[0].reason


# --- Strict flag on the OpenAI tool ---


def test_openai_tool_is_not_strict_when_the_schema_does_not_fit() -> None:
    schema = copy.deepcopy(STRICT_INPUT)
    schema["properties"]["query"]["minLength"] = 2
    tool = to_openai_tool(_contract(input_schema=schema))
    assert tool["function"]["strict"] is False
    # The schema goes out unchanged: nothing is silently dropped.
    assert tool["function"]["parameters"]["properties"]["query"]["minLength"] == 2


def test_openai_tool_strict_can_be_turned_off() -> None:
    assert to_openai_tool(_contract(), strict=False)["function"]["strict"] is False
    assert to_openai_tool(_contract(), strict=True)["function"]["strict"] is True


# --- MCP annotations ---


@pytest.mark.parametrize(
    ("effect", "expected"),
    [
        (
            "pure_read",
            {
                "readOnlyHint": True,
                "destructiveHint": False,
                "idempotentHint": True,
                "openWorldHint": False,
            },
        ),
        (
            "external_read",
            {
                "readOnlyHint": True,
                "destructiveHint": False,
                "idempotentHint": True,
                "openWorldHint": True,
            },
        ),
        (
            "reversible_write",
            {
                "readOnlyHint": False,
                "destructiveHint": False,
                "idempotentHint": False,
                "openWorldHint": True,
            },
        ),
        (
            "irreversible_write",
            {
                "readOnlyHint": False,
                "destructiveHint": True,
                "idempotentHint": False,
                "openWorldHint": True,
            },
        ),
    ],
)
def test_mcp_annotations_follow_the_effect_class(effect: str, expected: dict[str, bool]) -> None:
    assert to_mcp_tool(_contract(effect=effect))["annotations"] == expected


@pytest.mark.parametrize("required", [True, False])
@pytest.mark.parametrize("effect", ["reversible_write", "irreversible_write"])
def test_writes_are_never_idempotent_by_arguments(effect: str, required: bool) -> None:
    # Deduplication is by operation ID, not by arguments: MCP's hint does not apply.
    contract = _contract(effect=effect, idempotency={"required": required})
    assert to_mcp_tool(contract)["annotations"]["idempotentHint"] is False


def test_reads_stay_idempotent_without_deduplication() -> None:
    contract = _contract(effect="external_read", idempotency={"required": False})
    assert to_mcp_tool(contract)["annotations"]["idempotentHint"] is True
