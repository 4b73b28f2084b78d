"""One exception tree: every error class our packages define is an `OpledgerError`.

Imports every module of `ledger executors policy schemas` and checks each
exception class defined there. Exempt: private classes (a leading `_`, never
raised past their module) and the sample tools' fake providers, whose errors
stand for a third party's.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from schemas import OpledgerError

PACKAGES = ("ledger", "executors", "policy", "schemas")
EXEMPT_MODULES = ("executors.samples",)


def _error_classes() -> list[type[BaseException]]:
    found: list[type[BaseException]] = []
    for top in PACKAGES:
        package = importlib.import_module(top)
        for info in pkgutil.walk_packages(package.__path__, f"{top}."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                if (
                    inspect.isclass(value)
                    and issubclass(value, BaseException)
                    and value.__module__ == module.__name__
                    and not name.startswith("_")
                ):
                    found.append(value)
    return found


def test_every_error_class_is_an_opledger_error() -> None:
    classes = _error_classes()
    assert len(classes) > 30  # the walk found the packages' errors
    stray = [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in classes
        if not issubclass(cls, OpledgerError) and not cls.__module__.startswith(EXEMPT_MODULES)
    ]
    assert not stray, f"not OpledgerErrors: {stray}"


def test_the_ledgers_api_errors_are_all_reexported_from_ledger_errors() -> None:
    import ledger.errors

    internal = ("ledger.entrypoints", "ledger.server")  # the commands' and the service's own
    missing = [
        cls.__qualname__
        for cls in _error_classes()
        if cls.__module__.startswith("ledger.")
        and not cls.__module__.startswith(internal)
        and cls.__qualname__ not in ledger.errors.__all__
    ]
    assert not missing, f"raise them, and list them in ledger/errors.py: {missing}"
