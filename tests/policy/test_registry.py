"""Loading contract files: meta-validation, security fields, duplicates, pins, version hashes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from policy import ContractError, ContractRegistry
from tests.factories import contract_document, make_contract


def _write(directory: Path, name: str, document: dict[str, Any]) -> Path:
    path = directory / name
    if name.endswith(".json"):
        path.write_bytes(orjson.dumps(document))
    else:
        path.write_text(yaml.safe_dump(document))
    return path


def test_loads_yaml_and_json_files(tmp_path: Path) -> None:
    _write(tmp_path, "a.yaml", contract_document())
    _write(tmp_path, "b.json", contract_document(version="2.2.0"))
    (tmp_path / "README.txt").write_text("not a contract")
    registry = ContractRegistry.from_directory(tmp_path)
    assert registry.versions("search_documents") == ["2.1.0", "2.2.0"]


def test_bad_schema_fails_with_file_and_json_pointer(tmp_path: Path) -> None:
    document = contract_document()
    document["input_schema"]["properties"]["top_k"]["minimum"] = "one"
    path = _write(tmp_path, "bad.yaml", document)
    with pytest.raises(ContractError) as caught:
        ContractRegistry().load_file(path)
    assert caught.value.source == str(path)
    assert caught.value.pointer == "/input_schema/properties/top_k/minimum"
    assert str(path) in str(caught.value)


def test_bad_output_schema_is_named_too(tmp_path: Path) -> None:
    document = contract_document()
    document["output_schema"]["required"] = "items"
    path = _write(tmp_path, "bad.yaml", document)
    with pytest.raises(ContractError) as caught:
        ContractRegistry().load_file(path)
    assert caught.value.pointer == "/output_schema/required"


def test_missing_contract_field_names_the_field(tmp_path: Path) -> None:
    document = contract_document()
    del document["timeout_ms"]
    path = _write(tmp_path, "bad.yaml", document)
    with pytest.raises(ContractError) as caught:
        ContractRegistry().load_file(path)
    assert caught.value.pointer == "/timeout_ms"


@pytest.mark.parametrize(("effect", "attempts", "refused"), [
    ("irreversible_write", 2, True),
    ("irreversible_write", 1, False),
    ("reversible_write", 3, False),
    ("pure_read", 2, False),
])
def test_a_contract_that_would_auto_retry_an_irreversible_write_is_refused(
    tmp_path: Path, effect: str, attempts: int, refused: bool
) -> None:
    """A failed irreversible write may have had its effect: no policy retries it blindly."""
    document = contract_document()
    document["effect"] = effect
    document["retry"] = {"max_attempts": attempts, "retry_on": ["TRANSIENT"]}
    path = _write(tmp_path, "retry.yaml", document)
    if not refused:
        assert ContractRegistry().load_file(path)
        return
    with pytest.raises(ContractError) as caught:
        ContractRegistry().load_file(path)
    assert "irreversible write is never retried automatically" in str(caught.value)


def test_unparseable_file_is_a_contract_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ContractError) as caught:
        ContractRegistry().load_file(path)
    assert caught.value.source == str(path)


@pytest.mark.parametrize(
    "field", ["tenant_id", "user_id", "is_admin", "access_token", "api_key", "password"]
)
def test_security_fields_in_input_schema_are_refused(tmp_path: Path, field: str) -> None:
    document = contract_document()
    document["input_schema"]["properties"]["filters"]["properties"][field] = {"type": "string"}
    path = _write(tmp_path, "c.yaml", document)
    with pytest.raises(ContractError) as caught:
        ContractRegistry().load_file(path)
    assert caught.value.pointer == f"/input_schema/properties/filters/properties/{field}"


def test_max_tokens_is_not_mistaken_for_a_token() -> None:
    document = contract_document()
    document["input_schema"]["properties"]["max_tokens"] = {"type": "integer"}
    ContractRegistry().register(make_contract(input_schema=document["input_schema"]))


def test_duplicate_name_and_version_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, "a.yaml", contract_document())
    _write(tmp_path, "b.yaml", contract_document())
    with pytest.raises(ContractError, match=r"duplicate contract search_documents@2\.1\.0"):
        ContractRegistry.from_directory(tmp_path)


def test_pinning_selects_exact_versions() -> None:
    registry = ContractRegistry()
    registry.register(make_contract())
    registry.register(make_contract(version="2.10.0"))
    registry.register(make_contract(version="2.9.0"))
    assert registry.pin({"search_documents": "2.1.0"})["search_documents"].version == "2.1.0"
    assert registry.pin_latest().pins == {"search_documents": "2.10.0"}
    with pytest.raises(ContractError, match=r"search_documents@9\.9\.9"):
        registry.pin({"search_documents": "9.9.9"})


def test_version_record_hashes_change_with_the_schema() -> None:
    first = make_contract()
    schema = copy.deepcopy(first.input_schema)
    schema["properties"]["top_k"]["maximum"] = 50
    second = make_contract(input_schema=schema)
    assert first.version_record.input_schema_hash != second.version_record.input_schema_hash
    assert first.version_record.output_schema_hash == second.version_record.output_schema_hash
    assert len(first.version_record.input_schema_hash) == 64


@pytest.mark.parametrize(
    ("approval", "message"),
    [
        ({"mode": "never", "two_person_from": "high"}, "only with mode always or risk_at_least"),
        ({"mode": "two_person", "two_person_from": "high"}, "only with mode always or"),
        ({"mode": "forbidden", "two_person_from": "high"}, "only with mode always or"),
        (
            {"mode": "risk_at_least", "risk_threshold": "high", "two_person_from": "moderate"},
            "must not be below risk_threshold",
        ),
    ],
)
def test_two_person_from_must_mean_something(approval: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_contract(approval=approval)


def test_risk_threshold_must_match_approval_mode() -> None:
    with pytest.raises(ValueError, match="risk_threshold"):
        make_contract(approval={"mode": "risk_at_least"})
    with pytest.raises(ValueError, match="risk_threshold"):
        make_contract(approval={"mode": "always", "risk_threshold": "high"})
