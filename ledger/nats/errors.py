"""Errors of the NATS layer: a missing or failing server, bad credentials, a topology clash,
a feed that cannot be read.

All are `OpledgerError`s, so entry points report them as an `ErrorEnvelope`
with a stable code instead of a stack trace.
"""

from __future__ import annotations

from schemas import ErrorCategory, OpledgerError

__all__ = [
    "CredentialsError",
    "FeedAccessDenied",
    "FeedReadError",
    "FeedReadTimeout",
    "NatsServerNotFound",
    "NatsServerStartError",
    "NatsSetupError",
    "TopologyError",
    "UnknownIdentity",
]


class NatsSetupError(OpledgerError):
    """Base of the errors raised while setting up NATS (server, credentials, topology)."""

    category = ErrorCategory.INTERNAL
    code = "NATS_SETUP_FAILED"


class NatsServerNotFound(NatsSetupError):
    """No `nats-server` binary next to the interpreter, on PATH, or where we were told."""

    code = "NATS_SERVER_NOT_FOUND"


class NatsServerStartError(NatsSetupError):
    """The server exited or did not become ready in time; the message carries its log tail."""

    code = "NATS_SERVER_START_FAILED"
    # A port collision or a slow disk can clear up on a second attempt.
    retryable = True


class CredentialsError(NatsSetupError):
    """A seed file or credentials manifest is missing, malformed or not private."""

    category = ErrorCategory.INVALID_INPUT
    code = "NATS_CREDENTIALS_INVALID"


class UnknownIdentity(CredentialsError, KeyError):
    """No identity of that role and name in the credentials (also a `KeyError`)."""

    code = "NATS_IDENTITY_UNKNOWN"

    def __str__(self) -> str:
        # KeyError's own __str__ would quote the message.
        return self.message


class TopologyError(NatsSetupError):
    """A stream or consumer exists with a configuration that cannot be updated to ours."""

    category = ErrorCategory.CONFLICT
    code = "NATS_TOPOLOGY_CONFLICT"


class FeedReadError(OpledgerError):
    """Reading `OPS_FEED` by sequence failed: an error answer, or an answer that does not add up.

    Not a `NatsSetupError`: it happens while reading, to an auditor. The
    subclasses say whether waiting longer (`FeedReadTimeout`) or other
    credentials (`FeedAccessDenied`) could help.
    """

    category = ErrorCategory.INTERNAL
    code = "NATS_FEED_READ_FAILED"


class FeedReadTimeout(FeedReadError):
    """The server did not answer within the timeout (down, partitioned, or overloaded)."""

    category = ErrorCategory.TRANSIENT
    code = "NATS_FEED_READ_TIMEOUT"
    retryable = True


class FeedAccessDenied(FeedReadError):
    """The server refused a request of the read: the identity may not read the feed so."""

    category = ErrorCategory.UNAUTHORIZED
    code = "NATS_FEED_ACCESS_DENIED"
