"""Every error the executors package raises on purpose; each is an `OpledgerError`.

One home for them, so that a caller can catch `OpledgerError` around any
executor API (or one of these, to be precise). `ToolError`, the failure a
*tool* reports, lives with the tool-writing API in `executors._api`.
"""

from __future__ import annotations

from schemas import ErrorCategory, ErrorInfo, OpledgerError

__all__ = ["ExecutorConfigError", "LeaseError", "MissingSecretError", "SecretsError"]


class ExecutorConfigError(OpledgerError, ValueError):
    """The executor cannot start: wrong contract, version or missing secrets.

    Also a `ValueError`, as it was before the executors had an error module.
    """

    category = ErrorCategory.INVALID_INPUT
    code = "INVALID_EXECUTOR_CONFIG"


class SecretsError(OpledgerError):
    """The secrets file or variables are unusable (the message never holds a value)."""

    category = ErrorCategory.INVALID_INPUT
    code = "INVALID_SECRETS"


class MissingSecretError(OpledgerError, KeyError):
    """`ToolContext.secret` was asked for a secret this executor was not given.

    Also a `KeyError`, so tools written against the old behaviour still catch
    it; the message names only the key, never a value.
    """

    category = ErrorCategory.NOT_FOUND
    code = "SECRET_NOT_CONFIGURED"


class LeaseError(OpledgerError):
    """The ledger answered a lease request with an error instead of a lease reply.

    It carries the ledger's own `ErrorInfo` (`error`), and takes its code and
    category, so that what the executor logs is what the ledger said.
    """

    def __init__(self, error: ErrorInfo) -> None:
        # `str(lease_error)` stays "CODE: message", as before it was an OpledgerError.
        super().__init__(f"{error.code}: {error.message}")
        self.message = error.message
        self.code = error.code
        self.category = error.category
        self.retryable = error.retryable
        self.retry_after_ms = error.retry_after_ms
        self.error = error
