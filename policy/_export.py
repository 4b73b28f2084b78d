"""Model-facing tool definitions, all three rendered from one `ToolContract`.

The contract is the single source: the OpenAI function tool, the Anthropic tool
and the MCP tool carry the same input schema and the same rendered description,
so a model sees one tool whichever API the host speaks. Nothing here rewrites a
schema to make it fit a provider: a schema that does not fit OpenAI's strict
mode is sent with `strict: false` and the reasons are available from
`openai_strict_report`, because silently tightening an operator's schema would
change which calls are valid.

Sources for the rules checked here (read when this module was written):

- OpenAI, "Structured model outputs" guide, section "Supported schemas"
  (platform.openai.com/docs/guides/structured-outputs#supported-schemas), as
  mirrored verbatim in github.com/robobenjie/battlebuddy
  `.cursor/rules/OpenAIDoc.md` and summarised in the February 2026 profile at
  jsonschemaprofiles.unitvectorylabs.com/schemas/openai. It lists the supported
  types and keywords (string: pattern, format with nine named formats; number:
  multipleOf, maximum, exclusiveMaximum, minimum, exclusiveMinimum; array:
  minItems, maxItems), requires a root object that is not `anyOf`, every
  property in `required` (optional = union with null), `additionalProperties:
  false` on every object, and sets the limits used below (5000 properties, 10
  nesting levels, 120,000 characters of names/enum/const strings, 1000 enum
  values, 15,000 characters for a string enum of more than 250 values). It
  names allOf, not, dependentRequired, dependentSchemas, if, then, else as
  unsupported, and more keywords as unsupported for fine-tuned models.
- OpenAI's own SDK helper, github.com/openai/openai-agents-python
  `src/agents/strict_schema.py` (adapted from openai-python
  `lib/_pydantic.py`): a `$ref` may not carry sibling keywords.
- API errors reported in public issues: "array schema missing items"
  (e.g. sigoden/aichat#1049, digitalocean-labs/mcp-digitalocean#265) and
  "schema must have a 'type' key" (can1357/oh-my-pi#211).
- MCP schema 2025-11-25 (modelcontextprotocol/modelcontextprotocol
  `schema/2025-11-25/schema.ts`, same fields in 2025-06-18): `Tool` has
  `name`, `title`, `description`, `inputSchema` and `outputSchema` (both
  `type: "object"` at the root, 2020-12 by default) and `annotations`
  (`readOnlyHint` default false; `destructiveHint` default true and
  `idempotentHint` default false, both meaningful only when not read-only;
  `openWorldHint` default true).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from policy._check._pointer import MISSING, resolve_pointer
from policy._contract import ApprovalMode, EffectClass, ToolContract
from policy._errors import ContractError, ToolFormatError
from policy._registry import json_pointer

__all__ = [
    "StrictModeProblem",
    "StrictModeReport",
    "ToolFormat",
    "export_tool",
    "offered_contracts",
    "openai_strict_report",
    "to_anthropic_tool",
    "to_mcp_tool",
    "to_openai_tool",
]

ToolFormat = Literal["openai", "anthropic", "mcp"]
"""The tool-definition formats `export_tool` renders."""

# Keys that identify the schema document rather than describe arguments. The
# model APIs get the bare schema; MCP keeps `$schema` because its spec reads it
# to pick the dialect (2020-12 when absent).
_DOCUMENT_KEYS = ("$schema", "$id")

# --- OpenAI strict mode: the documented subset (see the module docstring) ---

_JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})

# An allowlist, not a denylist: a keyword OpenAI does not document as supported
# may be rejected with a 400 for the whole request, while reporting it only
# costs `strict: false`. So anything outside this set is a problem.
_SUPPORTED_KEYWORDS = frozenset(
    {
        # structure
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "enum",
        "const",
        "anyOf",
        "$ref",
        "$defs",
        "definitions",
        # annotations the documented examples use
        "description",
        "title",
        # string
        "pattern",
        "format",
        # number
        "multipleOf",
        "maximum",
        "exclusiveMaximum",
        "minimum",
        "exclusiveMinimum",
        # array
        "minItems",
        "maxItems",
    }
)

# Named as unsupported by the guide, so the reason can say so outright.
_DOCUMENTED_UNSUPPORTED = frozenset(
    {"allOf", "not", "dependentRequired", "dependentSchemas", "if", "then", "else"}
)

_SUPPORTED_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
)

_MAX_PROPERTIES = 5000
_MAX_OBJECT_DEPTH = 10
_MAX_STRING_CHARS = 120_000
_MAX_ENUM_VALUES = 1000
_LARGE_ENUM_VALUES = 250
_LARGE_ENUM_MAX_CHARS = 15_000


@dataclass(frozen=True, slots=True)
class StrictModeProblem:
    """One reason a schema does not fit OpenAI's strict mode.

    `path` is an RFC 6901 JSON pointer into the checked schema: to the keyword
    at fault when it exists, otherwise to the schema node that lacks something
    ("" is the root).
    """

    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class StrictModeReport:
    """Whether a schema fits OpenAI's strict-mode subset, and every problem found."""

    problems: tuple[StrictModeProblem, ...] = ()

    @property
    def fits(self) -> bool:
        """True when no problem was found: the schema may be sent with `strict: true`."""
        return not self.problems


@dataclass(slots=True)
class _Scan:
    """Problems and schema-wide tallies gathered in one walk."""

    root: Mapping[str, Any]
    problems: list[StrictModeProblem] = field(default_factory=list)
    properties: int = 0
    enum_values: int = 0
    string_chars: int = 0

    def add(self, path: tuple[object, ...], reason: str) -> None:
        self.problems.append(StrictModeProblem(json_pointer(path), reason))


def openai_strict_report(schema: Mapping[str, Any]) -> StrictModeReport:
    """Check `schema`, exactly as it would be sent, against OpenAI's strict-mode subset.

    Conservative: a keyword or shape the OpenAI guide does not document as
    supported is reported, so `fits` is True only for schemas within the
    documented subset. `$ref`s are checked but not followed, so nesting depth
    is measured along the schema's own structure (the root object is level 1).
    """
    scan = _Scan(root=schema)
    if not isinstance(schema, Mapping):
        scan.add((), "the root must be an object schema")
        return StrictModeReport(tuple(scan.problems))
    if "anyOf" in schema:
        scan.add(("anyOf",), "the root must be an object, not anyOf")
    if "type" not in schema:
        scan.add((), "the root must declare type 'object'")
    elif schema["type"] != "object":
        scan.add(("type",), "the root must be type 'object' (not nullable, not a union)")
    _check_node(scan, schema, (), object_depth=0)
    if scan.properties > _MAX_PROPERTIES:
        scan.add(
            (), f"{scan.properties} object properties in total; the limit is {_MAX_PROPERTIES}"
        )
    if scan.enum_values > _MAX_ENUM_VALUES:
        scan.add((), f"{scan.enum_values} enum values in total; the limit is {_MAX_ENUM_VALUES}")
    if scan.string_chars > _MAX_STRING_CHARS:
        scan.add(
            (),
            f"property names, definition names, enum and const values total "
            f"{scan.string_chars} characters; the limit is {_MAX_STRING_CHARS}",
        )
    return StrictModeReport(tuple(scan.problems))


def _check_node(scan: _Scan, node: Any, path: tuple[object, ...], *, object_depth: int) -> None:
    """Check one schema node and recurse into the subschemas strict mode allows."""
    if not isinstance(node, Mapping):
        scan.add(path, "a boolean or non-object schema has no type; strict mode needs one")
        return
    is_root = not path
    for keyword in node:
        if keyword not in _SUPPORTED_KEYWORDS:
            if keyword in _DOCUMENTED_UNSUPPORTED:
                scan.add((*path, keyword), f"'{keyword}' is not supported in strict mode")
            else:
                scan.add(
                    (*path, keyword), f"'{keyword}' is not in the documented strict-mode subset"
                )

    if "$ref" in node:
        _check_ref(scan, node, path)
        return

    for keyword in ("$defs", "definitions"):
        if keyword in node:
            _check_definitions(scan, node[keyword], (*path, keyword), is_root=is_root)

    types = _check_type(scan, node, path, is_root=is_root)
    _check_values(scan, node, path)

    any_of = node.get("anyOf")
    if any_of is not None:
        if not isinstance(any_of, list) or not any_of:
            scan.add((*path, "anyOf"), "anyOf must be a non-empty list of schemas")
        else:
            for index, branch in enumerate(any_of):
                _check_node(scan, branch, (*path, "anyOf", index), object_depth=object_depth)

    if "object" in types or "properties" in node:
        _check_object(scan, node, path, object_depth=object_depth + 1)
    if "array" in types or "items" in node:
        _check_array(scan, node, path, object_depth=object_depth)


def _check_ref(scan: _Scan, node: Mapping[str, Any], path: tuple[object, ...]) -> None:
    # OpenAI's SDK inlines a $ref that has siblings because the API refuses it.
    ref = node["$ref"]
    if len(node) > 1:
        scan.add(path, "a $ref must stand alone; strict mode refuses sibling keywords")
    if not isinstance(ref, str) or not ref.startswith("#"):
        scan.add((*path, "$ref"), "only local references ('#' or '#/...') are supported")
    elif resolve_pointer(scan.root, ref[1:]) is MISSING:
        scan.add((*path, "$ref"), f"reference {ref!r} does not resolve within the schema")


def _check_definitions(
    scan: _Scan, definitions: Any, path: tuple[object, ...], *, is_root: bool
) -> None:
    if not is_root:
        scan.add(path, "definitions are documented only at the root of the schema")
        return
    if not isinstance(definitions, Mapping):
        scan.add(path, "definitions must map names to schemas")
        return
    for name, subschema in definitions.items():
        scan.string_chars += len(name)
        # A definition sits inside the root object, one level down.
        _check_node(scan, subschema, (*path, name), object_depth=1)


def _check_type(
    scan: _Scan, node: Mapping[str, Any], path: tuple[object, ...], *, is_root: bool
) -> frozenset[str]:
    """The node's declared types; reports a missing or unsupported `type`."""
    declared = node.get("type")
    if declared is None:
        # anyOf carries the types in its branches; the root's lack is reported already.
        if "anyOf" not in node and not is_root:
            scan.add(path, "no 'type'; strict mode needs a type on every schema, even with enum")
        return frozenset()
    if isinstance(declared, str):
        if declared not in _JSON_TYPES:
            scan.add((*path, "type"), f"unknown type {declared!r}")
        return frozenset({declared})
    names = declared if isinstance(declared, list) else [declared]
    unknown = [name for name in names if not (isinstance(name, str) and name in _JSON_TYPES)]
    if unknown:
        scan.add((*path, "type"), f"unknown type(s) {unknown!r}")
    # The guide documents one union only: a type with null, for optional values.
    elif len(names) != 2 or "null" not in names or names[0] == names[1]:
        scan.add(
            (*path, "type"),
            "a type list must be one type plus 'null'; use anyOf for other unions",
        )
    return frozenset(name for name in names if isinstance(name, str))


def _check_values(scan: _Scan, node: Mapping[str, Any], path: tuple[object, ...]) -> None:
    """Enum and const sizes feed the schema-wide limits; format must be a named one."""
    enum = node.get("enum")
    if isinstance(enum, list):
        scan.enum_values += len(enum)
        strings = [value for value in enum if isinstance(value, str)]
        chars = sum(len(value) for value in strings)
        scan.string_chars += chars
        if len(strings) > _LARGE_ENUM_VALUES and chars > _LARGE_ENUM_MAX_CHARS:
            scan.add(
                (*path, "enum"),
                f"a string enum of {len(strings)} values totals {chars} characters; above "
                f"{_LARGE_ENUM_VALUES} values the limit is {_LARGE_ENUM_MAX_CHARS}",
            )
    elif enum is not None:
        scan.add((*path, "enum"), "enum must be a list")
    const = node.get("const")
    if isinstance(const, str):
        scan.string_chars += len(const)
    fmt = node.get("format")
    if fmt is not None and not (isinstance(fmt, str) and fmt in _SUPPORTED_FORMATS):
        scan.add(
            (*path, "format"),
            f"format {fmt!r} is not supported; use one of {', '.join(sorted(_SUPPORTED_FORMATS))}",
        )


def _check_object(
    scan: _Scan, node: Mapping[str, Any], path: tuple[object, ...], *, object_depth: int
) -> None:
    if object_depth == _MAX_OBJECT_DEPTH + 1:
        # Reported once, where the limit is first crossed; deeper objects follow from it.
        scan.add(path, f"objects nest more than {_MAX_OBJECT_DEPTH} levels deep")
    if "additionalProperties" not in node:
        scan.add(path, "an object must set additionalProperties: false")
    elif node["additionalProperties"] is not False:
        scan.add((*path, "additionalProperties"), "additionalProperties must be false")

    required = node.get("required", [])
    if not isinstance(required, list):
        scan.add((*path, "required"), "required must be a list of property names")
        required = []
    properties = node.get("properties", {})
    if not isinstance(properties, Mapping):
        scan.add((*path, "properties"), "properties must map names to schemas")
        return
    for name, subschema in properties.items():
        scan.properties += 1
        scan.string_chars += len(name)
        if name not in required:
            scan.add(
                (*path, "properties", name),
                f"property {name!r} is not in required; strict mode requires every "
                "property (keep it optional by allowing null: type [..., 'null'])",
            )
        _check_node(scan, subschema, (*path, "properties", name), object_depth=object_depth)


def _check_array(
    scan: _Scan, node: Mapping[str, Any], path: tuple[object, ...], *, object_depth: int
) -> None:
    items = node.get("items")
    if items is None:
        scan.add(path, "an array schema must give items")
        return
    if isinstance(items, list):
        scan.add((*path, "items"), "tuple-form items is not supported; give one items schema")
        return
    _check_node(scan, items, (*path, "items"), object_depth=object_depth)


# --- Exporters ---


def _input_schema(contract: ToolContract) -> dict[str, Any]:
    """A copy of the contract's input schema; every format requires a root object."""
    # The registry refuses other schemas at load; a contract built directly may not have been.
    if contract.input_schema.get("type") != "object":
        raise ContractError(
            "a tool's input schema must describe an object", pointer="/input_schema/type"
        )
    return copy.deepcopy(contract.input_schema)


def _model_schema(contract: ToolContract) -> dict[str, Any]:
    """The input schema as the model APIs take it: without document identity keys."""
    schema = _input_schema(contract)
    for key in _DOCUMENT_KEYS:
        schema.pop(key, None)
    return schema


def to_openai_tool(contract: ToolContract, *, strict: bool = True) -> dict[str, Any]:
    """An OpenAI function tool (Chat Completions shape) for `contract`.

    With `strict=True` the tool asks for strict mode only when the parameters
    fit OpenAI's strict-mode subset (`openai_strict_report`); otherwise it is
    sent with `strict: false`, because a strict tool with an unsupported schema
    makes the whole request fail. The schema itself is never rewritten.
    """
    parameters = _model_schema(contract)
    use_strict = strict and openai_strict_report(parameters).fits
    return {
        "type": "function",
        "function": {
            "name": contract.name,
            "description": contract.description.render(),
            "parameters": parameters,
            "strict": use_strict,
        },
    }


def to_anthropic_tool(contract: ToolContract) -> dict[str, Any]:
    """An Anthropic Messages API tool (`name`, `description`, `input_schema`) for `contract`."""
    return {
        "name": contract.name,
        "description": contract.description.render(),
        "input_schema": _model_schema(contract),
    }


def _mcp_annotations(contract: ToolContract) -> dict[str, bool]:
    """MCP behaviour hints from the effect class, every hint stated explicitly.

    Explicit values matter because MCP's defaults assume the worst
    (destructive, not idempotent, open world) for a tool that says nothing.
    """
    effect = contract.effect
    read_only = not effect.writes
    return {
        "readOnlyHint": read_only,
        # Only a write that cannot be undone destroys anything; MCP reads this
        # hint only when readOnlyHint is false.
        "destructiveHint": effect is EffectClass.IRREVERSIBLE_WRITE,
        # MCP means "same arguments, no additional effect". opledger deduplicates
        # writes by operation ID, which is not among the model's arguments: two
        # identical proposals are two operations. Only reads qualify.
        "idempotentHint": read_only,
        # A pure read looks only at state the host owns; everything else
        # reaches systems outside it.
        "openWorldHint": effect is not EffectClass.PURE_READ,
    }


def _title(name: str) -> str:
    """A display title from a verb_object name: 'search_documents' → 'Search documents'."""
    return name.replace("_", " ").capitalize()


def to_mcp_tool(contract: ToolContract) -> dict[str, Any]:
    """An MCP `Tool` definition (spec 2025-06-18 / 2025-11-25) for `contract`.

    `outputSchema` is included only when the contract's output schema is an
    object schema, the only kind MCP allows; the field is optional, so a tool
    without it stays valid and its results are returned as plain content.
    """
    tool: dict[str, Any] = {
        "name": contract.name,
        "title": _title(contract.name),
        "description": contract.description.render(),
        "inputSchema": _input_schema(contract),
    }
    if contract.output_schema.get("type") == "object":
        tool["outputSchema"] = copy.deepcopy(contract.output_schema)
    tool["annotations"] = _mcp_annotations(contract)
    return tool


def offered_contracts(
    contracts: Iterable[ToolContract], capabilities: frozenset[str] | None
) -> list[ToolContract]:
    """The contracts a caller with `capabilities` (None: any) may call, by name: never
    a tool forbidden to agents, never one the capabilities do not suffice for."""
    offered = [
        c
        for c in contracts
        if c.approval.mode is not ApprovalMode.FORBIDDEN
        and (capabilities is None or c.required_capabilities <= capabilities)
    ]
    return sorted(offered, key=lambda c: c.name)


def export_tool(contract: ToolContract, fmt: ToolFormat) -> dict[str, Any]:
    """The tool definition for `contract` in format `fmt` (strict OpenAI when it fits)."""
    if fmt == "openai":
        return to_openai_tool(contract)
    if fmt == "anthropic":
        return to_anthropic_tool(contract)
    if fmt == "mcp":
        return to_mcp_tool(contract)
    raise ToolFormatError(
        f"unknown tool format {fmt!r}; use 'openai', 'anthropic' or 'mcp'", format=str(fmt)
    )
