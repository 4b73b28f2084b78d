"""Every error the executors package raises is an `OpledgerError`, from one module."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

import executors
from executors import (
    ExecutorConfigError,
    LeaseError,
    MissingSecretError,
    SecretsError,
    ToolContext,
)
from schemas import ErrorCategory, ErrorInfo, OpledgerError


@pytest.mark.parametrize(
    "error", [ExecutorConfigError, LeaseError, MissingSecretError, SecretsError]
)
def test_each_executor_error_is_an_opledger_error_from_the_errors_module(
    error: type[Exception],
) -> None:
    assert issubclass(error, OpledgerError)
    assert error.__module__ == "executors._errors"
    assert getattr(executors, error.__name__) is error


def test_a_lease_error_carries_the_ledger_s_error() -> None:
    info = ErrorInfo(code="NOT_LEASED", category=ErrorCategory.CONFLICT, message="held")
    error = LeaseError(info)
    assert str(error) == "NOT_LEASED: held"
    assert (error.code, error.category, error.message, error.error) == (
        "NOT_LEASED", ErrorCategory.CONFLICT, "held", info
    )


def test_a_missing_secret_is_an_opledger_error_and_still_a_key_error() -> None:
    context = ToolContext(
        operation_id="op-1",
        attempt=1,
        deadline=datetime.now(UTC),
        fencing_token=1,
        secrets={"present": "value"},
    )
    with pytest.raises(MissingSecretError, match="'absent' is not configured") as raised:
        context.secret("Absent")
    assert isinstance(raised.value, KeyError)
    assert raised.value.code == "SECRET_NOT_CONFIGURED"
    assert "value" not in str(raised.value)
