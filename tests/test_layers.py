"""The import layers of opledger, checked from the source alone.

Every module under `ledger executors policy schemas bench deploy` is parsed
with `ast`; nothing is imported, so a module with import-time side effects (or
one that fails to import) is checked all the same. The rules:

1. `ledger.domain.*` imports only the stdlib, `schemas`, `eventsourcing` and
   `ledger.domain.*`, and the two libraries its events are made of: `pydantic`
   (each event is a frozen pydantic model, as every wire format in `schemas`
   is) and `orjson` (the bytes an event is hashed by are its orjson encoding).
   The domain knows nothing of storage, NATS or policy.
2. `executors` never imports `ledger`: an executor runs with the executor's
   credentials only, and the ledger may be upgraded without it.
3. `schemas` imports nothing from `ledger`, `executors` or `policy`, and
   `policy` nothing from `ledger` or `executors`: the wire formats and the
   check are the bottom layers that every process shares.
4. No module imports a private module (a dotted name with a component that
   starts with `_`) unless that module's parent package is an ancestor of, or
   the same as, the importing module's package: a package's private modules
   are its own business, so another package reaches them only through the
   public re-exports.

Imports made with `importlib` from a string are not seen; only `import` and
`from ... import` statements (anywhere in a module, including inside functions
and `if TYPE_CHECKING:` blocks) are.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("ledger", "executors", "policy", "schemas", "bench", "deploy")
STDLIB = frozenset(sys.stdlib_module_names)

DOMAIN_ALLOWED = frozenset({"schemas", "eventsourcing", "pydantic", "orjson", "ledger.domain"})

KNOWN_VIOLATIONS: frozenset[tuple[str, str, int]] = frozenset()
"""(module, imported name, rule) allowed for now, each with the reason it is temporary."""


@dataclass(frozen=True, slots=True)
class Violation:
    """One import that breaks one rule."""

    module: str
    imported: str
    line: int
    rule: int
    reason: str

    @property
    def key(self) -> tuple[str, str, int]:
        """What `KNOWN_VIOLATIONS` lists: the module, the imported name, the rule."""
        return (self.module, self.imported, self.rule)

    def __str__(self) -> str:
        where = f"{self.module} (line {self.line})"
        return f"{where} imports {self.imported}: rule {self.rule}, {self.reason}"


def _within(name: str, package: str) -> bool:
    """Whether the dotted `name` is `package` or inside it."""
    return name == package or name.startswith(package + ".")


def _is_private(component: str) -> bool:
    # Dunder names (`__future__`, `__main__`) are not private, just special.
    return component.startswith("_") and not (
        component.startswith("__") and component.endswith("__")
    )


def _private_parent(name: str) -> str | None:
    """The package that owns the first private component of `name`, or None if none is private.

    `ledger.nats._conf` → `ledger.nats`; `policy._check._parse` → `policy`.
    """
    parts = name.split(".")
    for index, part in enumerate(parts):
        if _is_private(part):
            return ".".join(parts[:index])
    return None


def _imported_names(
    tree: ast.Module, module: str, *, is_package: bool
) -> Iterator[tuple[str, int]]:
    """Every dotted name a module's import statements name, with its line.

    `from a.b import c` names both `a.b` and `a.b.c`, because `c` may be a
    submodule or a private attribute; relative imports are made absolute.
    """
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if node.module:
                yield base, node.lineno
            for alias in node.names:
                if alias.name != "*":
                    yield f"{base}.{alias.name}", node.lineno


def _layer_violation(module: str, imported: str) -> tuple[int, str] | None:
    """The first of rules 1-3 that importing `imported` from `module` breaks, if any."""
    top = imported.partition(".")[0]
    if (
        _within(module, "ledger.domain")
        and top not in STDLIB
        and not any(_within(imported, allowed) for allowed in DOMAIN_ALLOWED)
    ):
        return 1, (
            "the domain imports only the stdlib, schemas, eventsourcing, pydantic, orjson"
            " and ledger.domain"
        )
    if _within(module, "executors") and top == "ledger":
        return 2, "executors never import ledger"
    if _within(module, "schemas") and top in {"ledger", "executors", "policy"}:
        return 3, "schemas imports nothing from ledger, executors or policy"
    if _within(module, "policy") and top in {"ledger", "executors"}:
        return 3, "policy imports nothing from ledger or executors"
    return None


def check_source(source: str, module: str, *, is_package: bool = False) -> list[Violation]:
    """The violations of rules 1-4 in the source text of `module`."""
    package = module if is_package else module.rpartition(".")[0]
    found: dict[tuple[int, int], Violation] = {}
    for imported, line in _imported_names(ast.parse(source), module, is_package=is_package):
        layer = _layer_violation(module, imported)
        if layer is not None:
            rule, reason = layer
            # `from a import b` names `a` and `a.b`: report a statement once per rule.
            found.setdefault((line, rule), Violation(module, imported, line, rule, reason))
        parent = _private_parent(imported)
        if parent is not None and not (parent and _within(package, parent)):
            found.setdefault(
                (line, 4),
                Violation(
                    module,
                    imported,
                    line,
                    4,
                    f"a private module of {parent or 'the top level'}, outside "
                    f"{package or module}; import its package's public re-export instead",
                ),
            )
    return sorted(found.values(), key=lambda v: (v.line, v.imported, v.rule))


def _modules() -> Iterator[tuple[str, Path, bool]]:
    for top in CHECKED:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            yield ".".join(parts), path, is_package


def _all_violations() -> list[Violation]:
    return [
        violation
        for module, path, is_package in _modules()
        for violation in check_source(
            path.read_text(encoding="utf-8"), module, is_package=is_package
        )
    ]


def test_every_checked_package_has_modules() -> None:
    found = {module.partition(".")[0] for module, _, _ in _modules()}
    assert found == set(CHECKED)


def test_imports_respect_the_layers() -> None:
    violations = [v for v in _all_violations() if v.key not in KNOWN_VIOLATIONS]
    assert not violations, "import-layer violations:\n" + "\n".join(map(str, violations))


def test_known_violations_still_occur() -> None:
    occurring = {v.key for v in _all_violations()}
    stale = KNOWN_VIOLATIONS - occurring
    assert not stale, (
        f"fixed; remove from KNOWN_VIOLATIONS in tests/test_layers.py: {sorted(stale)}"
    )


# The checker itself, on synthetic sources: each rule can fail.


@pytest.mark.parametrize(
    ("module", "source", "rule"),
    [
        ("ledger.domain.operation", "import psycopg\n", 1),
        ("ledger.domain.operation", "from nats.js import JetStreamContext\n", 1),
        ("ledger.domain.operation", "from ledger.adapters import sql\n", 1),
        ("ledger.domain.operation", "from ..adapters import sql\n", 1),
        ("executors.samples.orders", "from ledger.client import AgentHostClient\n", 2),
        ("executors._runner", "import ledger.nats\n", 2),
        ("schemas._messages", "from policy import ToolContract\n", 3),
        ("schemas._messages", "def f():\n    import ledger\n", 3),
        ("policy._export", "from executors import Tool\n", 3),
        ("deploy.generate", "from ledger.nats._conf import quote\n", 4),
        ("deploy.generate", "from ledger.nats import _conf\n", 4),
        ("ledger.entrypoints.processes", "from executors._main import run_executor_main\n", 4),
        ("ledger.server.relay", "from ledger.nats._conf import quote\n", 4),
        ("bench.e2e_bench", "from schemas._canonical import canonical_json\n", 4),
    ],
)
def test_the_checker_reports_a_broken_rule(module: str, source: str, rule: int) -> None:
    violations = check_source(source, module)
    assert [v.rule for v in violations] == [rule]
    message = str(violations[0])
    assert module in message
    assert f"rule {rule}" in message
    assert violations[0].imported in message


@pytest.mark.parametrize(
    ("module", "source", "is_package"),
    [
        ("ledger.domain.operation", "from __future__ import annotations\nimport hashlib\n", False),
        ("ledger.domain.operation", "from eventsourcing.domain import Aggregate\n", False),
        ("ledger.domain.operation", "from schemas import ToolProposal\n", False),
        ("ledger.domain.operation", "from ledger.domain.states import OperationState\n", False),
        ("ledger.domain.operation", "from .states import OperationState\n", False),
        ("ledger.server.relay", "from ledger._recent import Recent\n", False),
        ("ledger.server.relay", "from .._recent import Recent\n", False),
        ("policy._check._checker", "from policy._contract import ToolContract\n", False),
        ("policy", "from policy._check._checker import ProposalChecker\n", True),
        ("policy._check", "from ._checker import ProposalChecker\n", True),
        ("executors._process", "from policy import ToolContract\n", False),
        ("deploy.generate", "from ledger.nats import render_server_config\n", False),
    ],
)
def test_the_checker_accepts_a_permitted_import(module: str, source: str, is_package: bool) -> None:
    assert check_source(source, module, is_package=is_package) == []
