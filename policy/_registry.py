"""Loading contract files into a registry, and pinning the versions a runtime uses."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import ValidationError

from policy._contract import ToolContract
from policy._errors import ContractError

__all__ = ["ContractRegistry", "ToolCatalog", "json_pointer"]

_CONTRACT_SUFFIXES = (".yaml", ".yml", ".json")

# Fields that carry identity or authority. They come from the trusted runtime
# context; a schema that lets the model choose them is refused at load.
_SECURITY_NAMES = frozenset(
    {
        "tenant",
        "tenant_id",
        "user_id",
        "userid",
        "actor_id",
        "principal",
        "principal_id",
        "is_admin",
        "admin",
        "role",
        "roles",
        "capabilities",
        "scopes",
        "permissions",
        "token",
        "password",
        "secret",
        "api_key",
        "apikey",
        "authorization",
        "credentials",
        "cookie",
        "session_id",
    }
)
_SECURITY_SUFFIXES = ("_token", "_secret", "_password", "_api_key", "_credentials")


def json_pointer(parts: Iterable[object]) -> str:
    """RFC 6901 pointer for a path of keys and indexes."""
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in parts)


def _is_security_field(name: str) -> bool:
    lowered = name.lower()
    return lowered in _SECURITY_NAMES or lowered.endswith(_SECURITY_SUFFIXES)


def _security_fields(schema: Any, path: tuple[object, ...] = ()) -> Iterator[str]:
    """Pointers (into the schema) of every property named like a security field."""
    if isinstance(schema, dict):
        for keyword in ("properties", "patternProperties"):
            props = schema.get(keyword)
            if isinstance(props, dict):
                for name in props:
                    if _is_security_field(name):
                        yield json_pointer((*path, keyword, name))
        for key, value in schema.items():
            yield from _security_fields(value, (*path, key))
    elif isinstance(schema, list):
        for index, item in enumerate(schema):
            yield from _security_fields(item, (*path, index))


def _read_document(path: Path) -> Any:
    text = path.read_bytes()
    try:
        if path.suffix == ".json":
            return orjson.loads(text)
        return yaml.safe_load(text)
    except (orjson.JSONDecodeError, yaml.YAMLError) as exc:
        raise ContractError(f"cannot parse: {exc}", source=str(path)) from None


def _check_schema(schema: Any, field: str, source: str) -> None:
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        pointer = json_pointer((field, *exc.absolute_path))
        raise ContractError(
            f"not a valid Draft 2020-12 schema: {exc.message}", source=source, pointer=pointer
        ) from None
    if schema.get("type") != "object":
        raise ContractError(
            "a tool's schema must describe an object", source=source, pointer=f"/{field}/type"
        )


def parse_contract(document: Any, source: str = "") -> ToolContract:
    """Validate one contract document (already parsed from YAML or JSON)."""
    if not isinstance(document, dict):
        raise ContractError("a contract must be a mapping", source=source)
    if "draft" in document:
        # A draft (e.g. imported from a tool server's self-description) lacks what only
        # an operator can decide: refused by name, not by whichever field fails first.
        raise ContractError(
            "a draft contract: complete every field it marks FILL IN, then delete its"
            " `draft:` block",
            source=source,
            pointer="/draft",
        )
    for field in ("input_schema", "output_schema"):
        if field in document:
            _check_schema(document[field], field, source)
    try:
        contract = ToolContract.model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ContractError(
            first["msg"], source=source, pointer=json_pointer(first["loc"])
        ) from None
    for pointer in _security_fields(contract.input_schema):
        raise ContractError(
            "security fields come from the runtime context, never from model arguments",
            source=source,
            pointer="/input_schema" + pointer,
        )
    return contract


class ToolCatalog(Mapping[str, ToolContract]):
    """The contracts one runtime uses: exactly one pinned version per tool name."""

    def __init__(self, contracts: Iterable[ToolContract]) -> None:
        self._by_name = {contract.name: contract for contract in contracts}

    def __getitem__(self, name: str) -> ToolContract:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def pins(self) -> dict[str, str]:
        """Tool name → pinned version."""
        return {name: contract.version for name, contract in self._by_name.items()}


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


class ContractRegistry:
    """Every known version of every tool contract, loaded from operator files."""

    def __init__(self) -> None:
        self._contracts: dict[tuple[str, str], ToolContract] = {}
        self._sources: dict[tuple[str, str], str] = {}

    def register(self, contract: ToolContract, *, source: str = "") -> None:
        """Add a contract; a second (name, version) is refused even if identical."""
        if contract.key in self._contracts:
            first = self._sources[contract.key] or "an earlier registration"
            raise ContractError(
                f"duplicate contract {contract.name}@{contract.version} (first in {first})",
                source=source,
            )
        self._contracts[contract.key] = contract
        self._sources[contract.key] = source

    def load_file(self, path: Path) -> ToolContract:
        """Load, validate and register one contract file."""
        contract = parse_contract(_read_document(path), source=str(path))
        self.register(contract, source=str(path))
        return contract

    def load_directory(self, directory: Path) -> list[ToolContract]:
        """Load every `*.yaml`, `*.yml` and `*.json` contract file in `directory`."""
        files = sorted(p for p in directory.iterdir() if p.suffix in _CONTRACT_SUFFIXES)
        return [self.load_file(path) for path in files]

    @classmethod
    def from_directory(cls, directory: Path) -> ContractRegistry:
        """A registry holding the contracts of one directory."""
        registry = cls()
        registry.load_directory(directory)
        return registry

    def get(self, name: str, version: str) -> ToolContract | None:
        """The contract for (name, version), if registered."""
        return self._contracts.get((name, version))

    def versions(self, name: str) -> list[str]:
        """Registered versions of `name`, oldest first."""
        return sorted((v for n, v in self._contracts if n == name), key=_version_key)

    def names(self) -> list[str]:
        """Every registered tool name."""
        return sorted({name for name, _ in self._contracts})

    def pin(self, pins: Mapping[str, str]) -> ToolCatalog:
        """A catalog of exactly these (name → version) pins; an unknown pin is an error."""
        missing = [f"{n}@{v}" for n, v in pins.items() if (n, v) not in self._contracts]
        if missing:
            raise ContractError(f"pinned versions not registered: {', '.join(sorted(missing))}")
        return ToolCatalog(self._contracts[(n, v)] for n, v in pins.items())

    def pin_latest(self) -> ToolCatalog:
        """A catalog pinning the newest version of every tool."""
        return self.pin({name: self.versions(name)[-1] for name in self.names()})
