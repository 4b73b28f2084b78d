"""What a tool implementation sees: its definition, its context, and the errors it may raise.

A tool is up to four plain functions around one side effect:

- `run(arguments, context) -> dict`: do the work, return output matching the
  contract's output schema. Raise `ToolError` for expected failures.
- `check_preconditions(arguments, context) -> Precondition` (optional): re-read
  the target right before running (seed 001, "re-check preconditions right
  before execution"): time passed since the check and the approval.
- `reconcile(operation_id, context) -> Reconciliation` (optional): after a lost
  attempt, ask the provider what happened under this idempotency key.
- `check_postconditions(arguments, output, context) -> list[str]` (optional):
  verify the effect is what was asked for; any problem makes the result
  untrusted (failed for a read, outcome unknown for a write).
- `preview(arguments, context) -> dict` (optional): a dry run, without any
  side effect, saying what the call would do (resolved recipients, rendered
  content, amounts). A contract with `approval.preview` has the approvers see
  it before they approve; the executor runs it again right before the real
  run, and a call whose effect no longer previews the same is not run.

Each may be a plain or an `async` function. Plain functions run in a daemon
thread so that a blocking provider call does not stop the progress heartbeat.

    @tool("send_customer_email", version="1.0.0", required_secrets=("email_provider_db",))
    def send(arguments, context):
        ...

    @send.precondition
    def check(arguments, context):
        return Precondition.ok()
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from types import MappingProxyType
from typing import Any, TypeAlias, TypeVar

from executors._errors import MissingSecretError
from schemas import ErrorCategory, OpledgerError

__all__ = [
    "CheckFn",
    "PostconditionFn",
    "Precondition",
    "PreconditionVerdict",
    "PreviewFn",
    "ReconcileFn",
    "ReconcileStatus",
    "Reconciliation",
    "RunFn",
    "Tool",
    "ToolContext",
    "ToolError",
    "tool",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_C = TypeVar("_C", bound=Callable[[], Awaitable[None]])


class ToolError(OpledgerError):
    """An expected failure a tool reports: a stable code, its category, safe details only.

    The message and details are shown to the agent (after redaction), so they
    must never hold stack traces, credentials or data the caller may not see.
    `outcome_unknown` says the side effect may have happened anyway (a provider
    timed out mid-call); the ledger then reconciles instead of retrying.
    """

    def __init__(
        self,
        category: ErrorCategory | str,
        code: str,
        message: str,
        *,
        retryable: bool | None = None,
        safe_details: Mapping[str, Any] | None = None,
        retry_after_ms: int | None = None,
        outcome_unknown: bool = False,
    ) -> None:
        super().__init__(message, **dict(safe_details or {}))
        self.category = ErrorCategory(category)
        self.code = code
        # Only TRANSIENT failures are retryable unless the tool says otherwise:
        # retrying an INVALID_INPUT or a POLICY_DENIED can never succeed.
        self.retryable = self.category.retryable_by_default if retryable is None else retryable
        self.retry_after_ms = retry_after_ms
        self.outcome_unknown = outcome_unknown


class PreconditionVerdict(StrEnum):
    """What the re-check right before execution found."""

    OK = "ok"
    """The target is as approved: run the tool."""
    STALE = "stale"
    """The target changed since the check or the approval: do not run (CONFLICT)."""
    ALREADY_APPLIED = "already_applied"
    """The effect is already there (e.g. the invoice was sent): report it, do not repeat it."""


@dataclass(frozen=True, slots=True)
class Precondition:
    """The verdict of `check_preconditions`, with what the provider reports."""

    verdict: PreconditionVerdict
    reason: str = ""
    """A short safe explanation, e.g. "invoice changed after approval"."""
    code: str = ""
    """For STALE: the error code to report (default `PRECONDITION_STALE`)."""
    data: Mapping[str, Any] | None = None
    """For ALREADY_APPLIED: the output to report, valid against the output schema."""

    @classmethod
    def ok(cls) -> Precondition:
        """The target is as approved."""
        return cls(PreconditionVerdict.OK)

    @classmethod
    def stale(cls, reason: str, *, code: str = "PRECONDITION_STALE") -> Precondition:
        """The target changed after approval; the operation fails with CONFLICT."""
        return cls(PreconditionVerdict.STALE, reason=reason, code=code)

    @classmethod
    def already_applied(cls, data: Mapping[str, Any], reason: str = "") -> Precondition:
        """The effect already happened; `data` is reported as the operation's output."""
        return cls(PreconditionVerdict.ALREADY_APPLIED, reason=reason, data=data)


class ReconcileStatus(StrEnum):
    """What the provider says happened to an operation whose outcome was lost."""

    APPLIED = "applied"
    NOT_APPLIED = "not_applied"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """The observed outcome of an earlier attempt, looked up by idempotency key."""

    status: ReconcileStatus
    data: Mapping[str, Any] | None = None
    """For APPLIED: the output, valid against the output schema."""
    reason: str = ""

    @classmethod
    def applied(cls, data: Mapping[str, Any]) -> Reconciliation:
        """The effect happened; `data` is what the provider reports."""
        return cls(ReconcileStatus.APPLIED, data=data)

    @classmethod
    def not_applied(cls, reason: str = "") -> Reconciliation:
        """The provider has no record of the effect: a retry is safe."""
        return cls(ReconcileStatus.NOT_APPLIED, reason=reason)

    @classmethod
    def unknown(cls, reason: str = "") -> Reconciliation:
        """The provider cannot tell (yet): a human or a later reconciliation decides."""
        return cls(ReconcileStatus.UNKNOWN, reason=reason)


def _no_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    return logging.getLogger("opledger.executor.tool")


@dataclass(frozen=True, slots=True)
class ToolContext:
    """Everything a tool may know about the attempt it runs. Never the caller's credentials.

    The operation ID is the idempotency key: every attempt of one operation
    passes the same key, so a provider that deduplicates by key turns a retry
    after a lost response into "return the first result" (seed 001).
    """

    operation_id: str
    attempt: int
    deadline: datetime
    """When the attempt times out (UTC). Pass it on to providers that take one."""
    fencing_token: int
    secrets: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """This executor's own secrets (from `--secrets` or `OPLEDGER_SECRET_*`)."""
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger] = field(
        default_factory=_no_logger
    )
    tool: str = ""
    tool_version: str = ""
    executor: str = ""
    principal: str = ""
    """Who the call runs for, from the ledger's record (the lease), never the arguments."""
    tenant: str = ""
    """The tenant the call runs for (from the lease): scope every read and write by it.
    Empty only under a ledger older than this executor, which sends none."""
    capabilities: frozenset[str] = frozenset()
    """The caller's capabilities as the ledger recorded them (from the lease)."""
    environment: str = ""

    @property
    def idempotency_key(self) -> str:
        """The key to give the provider: always the operation ID, whatever the attempt."""
        return self.operation_id

    def seconds_left(self, now: datetime | None = None) -> float:
        """Seconds until the deadline (negative once it passed)."""
        return (self.deadline - (now or datetime.now(UTC))).total_seconds()

    def secret(self, name: str) -> str:
        """One secret by name; `MissingSecretError` (a `KeyError`) names only the key."""
        try:
            return self.secrets[name.lower()]
        except KeyError:
            raise MissingSecretError(f"secret {name.lower()!r} is not configured") from None


RunFn: TypeAlias = Callable[
    [Mapping[str, Any], ToolContext], Mapping[str, Any] | Awaitable[Mapping[str, Any]]
]
"""`run(arguments, context)`: perform the call, return its output."""
CheckFn: TypeAlias = Callable[
    [Mapping[str, Any], ToolContext], Precondition | Awaitable[Precondition]
]
"""`check_preconditions(arguments, context)`: re-check the target right before running."""
ReconcileFn: TypeAlias = Callable[[str, ToolContext], Reconciliation | Awaitable[Reconciliation]]
"""`reconcile(operation_id, context)`: look the outcome of a lost attempt up."""
CancelFn: TypeAlias = Callable[[str, ToolContext], bool | Awaitable[bool]]
"""`cancel(operation_id, context)`: the call was cancelled while it runs; stop it if no
effect has happened yet. True: stopped, nothing happened (the operation is `cancelled`);
False: too late, the call runs on and its outcome is recorded (`cancel: too_late`)."""
PostconditionFn: TypeAlias = Callable[
    [Mapping[str, Any], Mapping[str, Any], ToolContext],
    Sequence[str] | Awaitable[Sequence[str]],
]
"""`postconditions(arguments, output, context)`: problems with the effect; empty when fine."""
PreviewFn: TypeAlias = Callable[
    [Mapping[str, Any], ToolContext], Mapping[str, Any] | Awaitable[Mapping[str, Any]]
]
"""`preview(arguments, context)`: what the call would do, without doing it (JSON data).
Deterministic for an unchanged target: the same call previews the same, byte for byte."""
CloseFn: TypeAlias = Callable[[], Awaitable[None]]
"""`close()`: the executor stops, after its last item: release what the tool holds across
calls (sessions, connections, processes it started)."""


@dataclass(slots=True)
class Tool:
    """One tool implementation: the functions above and what it needs to run.

    Built once at import time (usually with `@tool(...)`), then only read.
    """

    name: str
    run: RunFn
    version: str | None = None
    """The contract version this implementation was written against (pinned)."""
    check_preconditions: CheckFn | None = None
    reconcile: ReconcileFn | None = None
    check_postconditions: PostconditionFn | None = None
    cancel: CancelFn | None = None
    preview: PreviewFn | None = None
    close: CloseFn | None = None
    """Awaited once when the executor stops, after its items (bounded; see the runner)."""
    required_secrets: tuple[str, ...] = ()
    """Secret names the executor refuses to start without (lower case)."""

    def precondition(self, fn: _F) -> _F:
        """Decorator: register `fn` as `check_preconditions`."""
        self.check_preconditions = fn
        return fn

    def reconciler(self, fn: _F) -> _F:
        """Decorator: register `fn` as `reconcile`."""
        self.reconcile = fn
        return fn

    def canceller(self, fn: _F) -> _F:
        """Decorator: register `fn` as `cancel` (without one, a cancel while running is
        too late: the call runs on)."""
        self.cancel = fn
        return fn

    def postcondition(self, fn: _F) -> _F:
        """Decorator: register `fn` as `check_postconditions`."""
        self.check_postconditions = fn
        return fn

    def previewer(self, fn: _F) -> _F:
        """Decorator: register `fn` as `preview` (the dry run approvers are shown)."""
        self.preview = fn
        return fn

    def closer(self, fn: _C) -> _C:
        """Decorator: register `fn` (async, no arguments) as `close`."""
        self.close = fn
        return fn


def tool(
    name: str, *, version: str | None = None, required_secrets: Sequence[str] = ()
) -> Callable[[RunFn], Tool]:
    """Decorator: turn a `run(arguments, context)` function into a `Tool`."""

    def wrap(run: RunFn) -> Tool:
        return Tool(
            name=name,
            run=run,
            version=version,
            required_secrets=tuple(s.lower() for s in required_secrets),
        )

    return wrap
