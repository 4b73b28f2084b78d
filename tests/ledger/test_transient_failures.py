"""What the service rides out is one line in its log; a bug keeps its traceback."""

from __future__ import annotations

import logging

import nats.errors
import nats.js.errors
import pytest

from ledger.server.metrics import LedgerMetrics
from ledger.server.transient import is_transient, log_failure


def _unavailable() -> nats.js.errors.APIError:
    error = nats.js.errors.APIError()
    error.code = 503
    error.description = "JetStream system temporarily unavailable"
    return error


@pytest.mark.parametrize(
    "exc",
    [
        nats.errors.TimeoutError(),
        nats.errors.NoRespondersError(),
        nats.errors.ConnectionClosedError(),
        nats.js.errors.ServiceUnavailableError(),
        _unavailable(),
        RuntimeError("publish failed"),  # caused by a timeout: see below
    ],
)
def test_a_leader_election_is_one_line(
    exc: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    if isinstance(exc, RuntimeError):
        exc.__cause__ = nats.errors.TimeoutError()
    assert is_transient(exc)
    with caplog.at_level(logging.WARNING):
        log_failure(logging.getLogger("t"), "relay failed; retrying", exc)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "relay failed; retrying" in record.getMessage()
    assert "\n" not in caplog.text.strip()


def test_a_bug_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    bug: KeyError | None = None
    try:
        raise KeyError("state")
    except KeyError as exc:
        bug = exc
    assert bug is not None and not is_transient(bug)
    with caplog.at_level(logging.WARNING):
        log_failure(logging.getLogger("t"), "relay failed; retrying", bug)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert "Traceback" in caplog.text and "KeyError" in caplog.text


def test_the_service_names_itself_in_its_metrics() -> None:
    metrics = LedgerMetrics(instance="ledger-b")
    assert metrics.registry.get_sample_value(
        "opledger_ledger_instance_info", {"instance_name": "ledger-b"}
    ) == 1.0
    assert metrics.registry.get_sample_value("opledger_relay_lag_events") == 0.0
