"""deploy/generate.py as a module, loaded once for every deployment test (it is a
script, not part of a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

GENERATOR = Path(__file__).resolve().parents[2] / "deploy" / "generate.py"
"""The generator script itself (the tests also run it as a command)."""


def _load() -> ModuleType:
    name = "opledger_deploy_generate"
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(name, GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


gen = _load()
"""The generator's module: its functions and types, for the tests to call."""
