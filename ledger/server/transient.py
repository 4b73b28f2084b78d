"""Failures the service expects and rides out, told apart from bugs in its logs.

While a JetStream stream or the meta group elects a leader (a node lost, a
rolling restart), requests time out or find no responders for seconds; while
a connection reconnects, it is closed or stale. The service retries all of
these anyway. Logged as one line each, they tell an operator what happened;
logged with a traceback, they bury the one failure that is a bug.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import nats.js.errors

__all__ = ["is_transient", "log_failure"]

_TRANSIENT: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,
    asyncio.TimeoutError,
    ConnectionError,
)

_UNAVAILABLE_CODES = frozenset({408, 503})
"""JetStream API answers that mean "no leader or no quorum right now"."""


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a failure the service rides out."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _TRANSIENT):
            return True
        if isinstance(current, nats.js.errors.APIError) and current.code in _UNAVAILABLE_CODES:
            return True
        current = current.__cause__ or current.__context__
    return False


def log_failure(log: logging.Logger, what: str, exc: BaseException) -> None:
    """`what` failed with `exc`: one warning line if it is transient, else with its
    traceback (a bug, or an outage the operator must see in full)."""
    if is_transient(exc):
        log.warning(
            "%s: %s%s (transient: a JetStream leader election or a reconnect)",
            what,
            type(exc).__name__,
            f": {exc}" if str(exc) else "",
        )
    else:
        log.error("%s", what, exc_info=exc)
