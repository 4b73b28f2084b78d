"""docs/wire-format.md is a wire a stranger can implement: its examples are real messages.

Convention: every ```json block of the document is preceded by the line
`<!-- schema: NAME -->`, NAME a file stem of `schemas/json/`. Each example must
then

- validate against that published schema (formats asserted: a `date-time` is
  RFC 3339 with its offset);
- be what the code sends, field for field: parsed by the model and written
  again it is the same JSON, timestamps included. Messages opledger sends
  (replies, statuses, results, work items) must show every field; requests may
  leave out fields that have defaults, as a host may;
- carry arguments and output a sample tool really takes and returns (checked
  against the sample contract's input and output schemas).

The document must also say what a host needs that no schema says: how to
authenticate, its inbox prefix, what it may publish and subscribe to, why to
subscribe before proposing, how to retry, and every code and category an
answer can carry.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import orjson
import pytest
from jsonschema import Draft202012Validator

from ledger.adapters.results import ResultStore, envelope_text_hash
from ledger.domain import errors as domain_errors
from ledger.domain.states import TERMINAL_STATES, OperationState
from ledger.nats.security import Role, permissions_for
from policy import ContractRegistry, ToolCatalog
from policy.catalog import CATALOG_DIR
from schemas import (
    SCHEMA_DIR,
    WIRE_MODELS,
    CheckStage,
    ErrorCategory,
    LeaseDecision,
    ResultEnvelope,
    canonical_json,
    inbox_prefix,
    sha256_hex,
)
from tests.schemas.test_wire_messages import FORMATS

DOC = Path(__file__).resolve().parents[2] / "docs" / "wire-format.md"

SENT = {
    "propose-reply",
    "operation-status",
    "lease-reply",
    "error-envelope",
    "result-envelope",
    "work-item",
}
"""Messages opledger writes whole: an example of one shows every field the code writes."""

SERVICE_CODES = {
    "INVALID_MESSAGE": "INVALID_INPUT",
    "TENANT_NOT_ALLOWED": "UNAUTHORIZED",
    "LEDGER_BUSY": "TRANSIENT",
    "REPLY_TOO_LARGE": "INTERNAL",
    "LEDGER_UNAVAILABLE": "INTERNAL",
}
"""Codes the ledger service answers with besides the domain's errors (`ledger.server`)."""


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def _blocks() -> list[tuple[int, str | None, str]]:
    """Every ```json block: (line, the schema its comment names or None, the JSON)."""
    lines = _text().splitlines()
    found = []
    for number, line in enumerate(lines):
        if line.strip() != "```json":
            continue
        end = lines.index("```", number + 1)
        named = re.fullmatch(r"<!-- schema: ([a-z-]+) -->", lines[number - 1].strip())
        found.append(
            (number + 1, named.group(1) if named else None, "\n".join(lines[number + 1 : end]))
        )
    return found


EXAMPLES = [(line, name, body) for line, name, body in _blocks() if name is not None]


def test_every_json_example_names_its_schema() -> None:
    unnamed = [line for line, name, _ in _blocks() if name is None]
    assert not unnamed, f"```json blocks without `<!-- schema: NAME -->` at lines {unnamed}"
    assert {name for _, name, _ in EXAMPLES} <= set(WIRE_MODELS)


@pytest.mark.parametrize(("line", "name", "body"), EXAMPLES, ids=lambda v: str(v)[:24])
def test_each_example_is_valid_against_its_published_schema(
    line: int, name: str, body: str
) -> None:
    schema = orjson.loads((SCHEMA_DIR / f"{name}.schema.json").read_bytes())
    errors = [
        f"{'/'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in Draft202012Validator(schema, format_checker=FORMATS).iter_errors(
            orjson.loads(body)
        )
    ]
    assert not errors, (line, name, errors)


def _normal(node: Any, key: str = "") -> Any:
    """`node` with the order of a set left out (`capabilities` is a set)."""
    if isinstance(node, dict):
        return {k: _normal(v, k) for k, v in node.items()}
    if isinstance(node, list):
        items = [_normal(v) for v in node]
        return sorted(items) if key == "capabilities" else items
    return node


def _numbers(*values: Any) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def _within(example: Any, written: Any, path: str = "") -> list[str]:
    """Where `example` says something other than `written` (it may leave keys out)."""
    if isinstance(example, dict) and isinstance(written, dict):
        return [
            problem
            for key, value in example.items()
            for problem in (
                _within(value, written[key], f"{path}/{key}")
                if key in written
                else [f"{path}/{key}: not written"]
            )
        ]
    if isinstance(example, list) and isinstance(written, list) and len(example) == len(written):
        return [
            p
            for n, (a, b) in enumerate(zip(example, written, strict=True))
            for p in _within(a, b, f"{path}/{n}")
        ]
    if example != written or (
        type(example) is not type(written) and not _numbers(example, written)
    ):
        return [f"{path}: {example!r} is written {written!r}"]
    return []


@pytest.mark.parametrize(("line", "name", "body"), EXAMPLES, ids=lambda v: str(v)[:24])
def test_each_example_is_what_the_code_writes(line: int, name: str, body: str) -> None:
    example = _normal(orjson.loads(body))
    model = WIRE_MODELS[name]
    written = _normal(orjson.loads(model.model_validate(example).model_dump_json()))
    assert not _within(example, written), (line, name, _within(example, written))
    if name in SENT:
        missing = _within(written, example)
        assert not missing, (line, name, "leaves out what the code writes", missing)


@cache
def _catalog() -> ToolCatalog:
    return ContractRegistry.from_directory(CATALOG_DIR).pin_latest()


def _tool_values(node: Any) -> list[tuple[str, str, Any]]:
    """(tool, "input" or "output", value) for every tool's arguments or output in `node`."""
    found: list[tuple[str, str, Any]] = []
    if isinstance(node, dict):
        tool = node.get("tool") or node.get("provenance", {}).get("tool")
        if isinstance(node.get("normalized_arguments"), dict):
            found.append((tool, "input", node["normalized_arguments"]))
        if isinstance(node.get("arguments"), dict) and "decision" in node:
            found.append((tool, "input", node["arguments"]))
        if node.get("ok") is True and isinstance(node.get("data"), dict):
            found.append((tool, "output", node["data"]))
        for value in node.values():
            found += _tool_values(value)
    return found


@pytest.mark.parametrize(("line", "name", "body"), EXAMPLES, ids=lambda v: str(v)[:24])
def test_tool_values_in_examples_are_what_the_sample_tools_take_and_give(
    line: int, name: str, body: str
) -> None:
    """The result example once said `"revision": 3`; the sample tool sends `"8"`."""
    for tool, kind, value in _tool_values(orjson.loads(body)):
        contract = _catalog()[tool]
        schema = contract.input_schema if kind == "input" else contract.output_schema
        errors = [e.message for e in Draft202012Validator(schema).iter_errors(value)]
        assert not errors, (line, tool, kind, errors)


def _section(title: str) -> str:
    """The section whose heading starts with `title`, up to the next one."""
    text = _text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_it_says_how_a_host_authenticates_and_what_it_may_do() -> None:
    text = _section("Connecting")
    host = permissions_for(Role.HOST, "HOST")
    for subject in (*host.publish, *host.subscribe):
        spelt = f"`{subject.replace('HOST', '<host>')}`"
        assert spelt in text, spelt
    assert f"`{inbox_prefix('host', 'HOST').replace('HOST', '<host>')}`" in text
    for phrase in ("NKey", "`host-<host>.nk`", "`_INBOX.>`", "`traceparent`"):
        assert phrase in text, phrase


def test_it_says_to_subscribe_before_proposing_and_how_to_retry() -> None:
    text = _section("Retries")
    for phrase in (
        "`ops.outcome.<host>.>`",
        "before",
        "RFC 8785",
        "`OPERATION_CONFLICT`",
        "`LEDGER_BUSY`",
        "`retry_after_ms`",
    ):
        assert phrase in text, phrase


def test_it_names_every_state_stage_decision_category_and_code() -> None:
    text = _text()
    for value in (
        *(s.value for s in OperationState),
        *(s.value for s in CheckStage),
        *(d.value for d in LeaseDecision),
        *(c.value for c in ErrorCategory),
    ):
        assert f"`{value}`" in text, value
    final = re.search(r"`final` is true in (.*?): the outcome", text, re.S)
    assert final is not None
    assert set(re.findall(r"`([a-z_]+)`", final.group(1))) == {s.value for s in TERMINAL_STATES}
    errors = _section("Errors")
    codes = {
        error.code: error.category.value
        for error in vars(domain_errors).values()
        if isinstance(error, type)
        and issubclass(error, domain_errors.LedgerError)
        and error is not domain_errors.LedgerError
    } | SERVICE_CODES
    for code, category in codes.items():
        row = re.search(rf"^\| `{code}` \| `{category}`", errors, re.M)
        assert row is not None, f"the error table has no row for {code} ({category})"


def test_the_status_examples_hashes_are_its_results() -> None:
    """`output_hash` and `envelope_hash` in an example are those of the result it shows."""
    checked = 0
    for _, name, body in EXAMPLES:
        status = orjson.loads(body)
        if name != "operation-status" or status["result"] is None:
            continue
        result = ResultEnvelope.model_validate(status["result"])
        outcome = status["outcome"]
        assert outcome["output_hash"] == sha256_hex(canonical_json(result.data))
        assert outcome["envelope_hash"] == envelope_text_hash(ResultStore.encode(result))
        assert outcome["result_ref"] == f"result:{result.operation_id}:{result.provenance.attempt}"
        checked += 1
    assert checked
