"""docs/claims.md names code and tests that exist: a refactor that moves a symbol
or renames a test fails here until the map of promises is updated with it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLAIMS = ROOT / "docs" / "claims.md"

# `path.py` followed by backticked symbols (`Class.method`, `function`, `NAME`), up to
# the next path, and `tests/...py::test_name` with `::more` names after it on its line
# (notes in parentheses may come between them).
_CODE = re.compile(
    r"`((?:ledger|executors|policy|schemas|bench|deploy)/[\w/]+\.py)`((?:,? `[^`/]+`)*)"
)
_TEST = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]]*\])?`")
_MORE_TESTS = re.compile(r"`::(\w+)(?:\[[^\]]*\])?`")
_NAME = re.compile(r"^[A-Za-z_][\w.]*")


def _defines(source: str, symbol: str) -> bool:
    """Whether `source` defines the last part of `symbol` (a def, class or assignment)."""
    name = symbol.split(".")[-1]
    return bool(
        re.search(rf"^\s*(?:async\s+def|def|class)\s+{re.escape(name)}\b", source, re.M)
        or re.search(rf"^\s*{re.escape(name)}\s*(?::[^=\n]+)?=", source, re.M)
    )


def _code_references(text: str) -> list[tuple[str, str | None]]:
    found: list[tuple[str, str | None]] = [(path, None) for path, _ in _CODE.findall(text)]
    for path, symbols in _CODE.findall(text):
        for symbol in re.findall(r"`([^`]+)`", symbols):
            name = _NAME.match(symbol)
            # `(cache_bytes)`-style notes and call forms like `Ledger.get(version=)` keep
            # only their leading name; a bare note in parentheses is not a symbol.
            if name and not symbol.startswith("("):
                found.append((path, name.group(0)))
    return found


def _test_references(text: str) -> list[tuple[str, str]]:
    """(file, test) for every test named; a bare `::test` belongs to the last file named
    before it on its line, and one with no file before it is reported as `?`."""
    found = []
    for line in text.splitlines():
        named = [(m.start(), m.group(1), m.group(2)) for m in _TEST.finditer(line)]
        bare = [(m.start(), "", m.group(1)) for m in _MORE_TESTS.finditer(line)]
        path = "?"
        for _, file, name in sorted(named + bare):
            path = file or path
            found.append((path, name))
    return found


def test_every_code_reference_in_the_claims_exists() -> None:
    text = CLAIMS.read_text(encoding="utf-8")
    references = _code_references(text)
    assert len(references) > 50  # the patterns still match the file's style
    missing = []
    for path, symbol in references:
        file = ROOT / path
        if not file.exists():
            missing.append(path)
        elif symbol is not None and not _defines(file.read_text(encoding="utf-8"), symbol):
            missing.append(f"{path} {symbol}")
    assert not missing, "docs/claims.md names code that does not exist:\n" + "\n".join(
        sorted(set(missing))
    )


def test_every_test_named_in_the_claims_exists() -> None:
    text = CLAIMS.read_text(encoding="utf-8")
    references = _test_references(text)
    assert len(references) > 50
    missing = []
    for path, name in references:
        file = ROOT / path
        if not file.exists() or not _defines(file.read_text(encoding="utf-8"), name):
            missing.append(f"{path}::{name}")
    assert not missing, "docs/claims.md names tests that do not exist:\n" + "\n".join(
        sorted(set(missing))
    )


def test_the_checker_notices_a_missing_symbol() -> None:
    assert _defines("class Relay:\n    def pump(self): ...\n", "Relay.pump")
    assert not _defines("class Relay:\n    def pump(self): ...\n", "Relay.claim")
    assert _code_references("`ledger/x.py` `Ledger.get(version=)`, `fold` `(cache_bytes)`") == [
        ("ledger/x.py", None),
        ("ledger/x.py", "Ledger.get"),
        ("ledger/x.py", "fold"),
    ]
    assert _test_references("`tests/a.py::test_one[x]`, `::test_two`") == [
        ("tests/a.py", "test_one"),
        ("tests/a.py", "test_two"),
    ]
    # A note between them does not hide the next name; another file takes over.
    assert _test_references(
        "`tests/a.py::test_one` (a note, `x`), `::test_two` | `tests/b.py::test_3`, `::t4`\n"
        "`::orphan`"
    ) == [
        ("tests/a.py", "test_one"),
        ("tests/a.py", "test_two"),
        ("tests/b.py", "test_3"),
        ("tests/b.py", "t4"),
        ("?", "orphan"),
    ]
