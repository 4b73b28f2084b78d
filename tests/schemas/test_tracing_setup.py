"""`setup_tracing`: spans are exported only when the environment asks, each process
names itself, and a process that already has a provider keeps it."""

from __future__ import annotations

import os
import subprocess
import sys

_SCRIPT = """
from opentelemetry import trace
from schemas import setup_tracing, tracer
print("installed", setup_tracing("opledger-test", instance="i-1"))
with tracer().start_as_current_span("opledger.test-span"):
    pass
provider = trace.get_tracer_provider()
if hasattr(provider, "force_flush"):
    provider.force_flush()
print("again", setup_tracing("opledger-other"))
"""


def _run(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
        check=False,
    )


def test_nothing_is_exported_unless_asked() -> None:
    done = _run()
    assert done.returncode == 0, done.stderr
    assert "installed False" in done.stdout and "opledger.test-span" not in done.stdout


def test_the_console_exporter_prints_spans_named_after_the_process() -> None:
    done = _run(OTEL_TRACES_EXPORTER="console")
    assert done.returncode == 0, done.stderr
    assert "installed True" in done.stdout
    assert '"name": "opledger.test-span"' in done.stdout
    assert '"service.name": "opledger-test"' in done.stdout
    assert '"service.instance.id": "i-1"' in done.stdout
    assert "again False" in done.stdout  # the provider set first stands


def test_an_otlp_endpoint_installs_the_exporter() -> None:
    # Nothing listens there: the spans are dropped, and the process is not held up.
    done = _run(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_BSP_EXPORT_TIMEOUT="500")
    assert done.returncode == 0, done.stderr
    assert "installed True" in done.stdout
