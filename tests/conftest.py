"""Shared fixtures: the storage backends every ledger contract test runs against."""

from __future__ import annotations

import compileall
import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ledger import StorageConfig

_REPO = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the project's sources once, before the suite starts its processes.

    The end-to-end tests start a few hundred service, executor and CLI processes
    from this checkout, and each imported the project from source, compiling it
    again, wherever Python may not write bytecode as it imports (a read-only
    checkout, or `PYTHONDONTWRITEBYTECODE` set, as on the CI machine): about a
    quarter of a second of CPU per process. Written here once (a few seconds),
    every process reads it.
    """
    for package in ("ledger", "executors", "policy", "schemas", "bench", "deploy", "tests"):
        with contextlib.suppress(OSError):
            compileall.compile_dir(_REPO / package, quiet=1)


POSTGRES_DSN = os.environ.get(
    "OPLEDGER_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test"
)
# CI sets this so that a missing PostgreSQL fails the run instead of skipping.
REQUIRE_POSTGRES = os.environ.get("OPLEDGER_REQUIRE_POSTGRES", "") not in ("", "0", "false")


def _postgres_available() -> str | None:
    try:
        with psycopg.connect(POSTGRES_DSN, connect_timeout=3):
            return None
    except psycopg.Error as exc:
        return f"PostgreSQL not reachable at {POSTGRES_DSN}: {exc}".splitlines()[0]


_POSTGRES_PROBLEM: str | None = None
_POSTGRES_PROBED = False


def postgres_storage_or_skip() -> StorageConfig:
    """A fresh schema on the test PostgreSQL, or a skip (a failure under CI)."""
    global _POSTGRES_PROBED, _POSTGRES_PROBLEM
    if not _POSTGRES_PROBED:
        _POSTGRES_PROBLEM = _postgres_available()
        _POSTGRES_PROBED = True
    if _POSTGRES_PROBLEM is not None:
        if REQUIRE_POSTGRES:
            pytest.fail(f"OPLEDGER_REQUIRE_POSTGRES is set but {_POSTGRES_PROBLEM}")
        pytest.skip(_POSTGRES_PROBLEM)
    return StorageConfig.postgres(POSTGRES_DSN, schema=f"t_{uuid.uuid4().hex[:12]}")


def drop_schema(storage: StorageConfig) -> None:
    """Remove a test schema and everything in it."""
    with psycopg.connect(storage.postgres_dsn or "", autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{storage.postgres_schema}" CASCADE')


@pytest.fixture(params=["sqlite", "postgres"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageConfig]:
    """Each backend in turn: the ledger's contract suite runs on both."""
    if request.param == "sqlite":
        yield StorageConfig.sqlite(tmp_path / "ledger.db")
        return
    config = postgres_storage_or_skip()
    yield config
    drop_schema(config)


@pytest.fixture
def postgres_storage() -> Iterator[StorageConfig]:
    """PostgreSQL only (for multi-writer tests)."""
    config = postgres_storage_or_skip()
    yield config
    drop_schema(config)


@pytest.fixture
def anyio_backend() -> str:
    """asyncio only: nats-py and the service are asyncio code. Without this, anyio also
    runs every `anyio` test under trio whenever trio is installed (selenium brings it)."""
    return "asyncio"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Every span this process ends while the test runs.

    OpenTelemetry lets a process set its tracer provider once: the first test that
    asks sets an SDK provider for the rest of the session (code under test that
    traces then records spans, which changes nothing it does), and each test adds
    an exporter of its own, shut down after it.
    """
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()
