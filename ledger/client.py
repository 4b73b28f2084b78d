"""The agent-host SDK: propose tool calls and wait for their outcomes over NATS.

A host speaks only on its own subjects (`ops.propose.<host>`, `ops.status.<host>`,
`ops.outcome.<host>.*`); the server's permissions make that the host's identity.
The SDK always sends an operation ID, minting one when the caller gives none,
so that retrying a proposal after a timeout can never create a second operation.

Outcomes arrive on one subscription per client (`ops.outcome.<host>.>`), taken
before the first proposal, so `outcome()` of an operation proposed through
this client needs no status request: it waits for the announcement, and asks
for the status only if none came for a while (core NATS may drop a notice).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable
from typing import Any, Literal

import nats
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry.trace import SpanKind
from pydantic import BaseModel, ValidationError

from ledger._recent import Recent
from ledger.nats.client import flush_all
from schemas import (
    ApproverRequest,
    CancelRequest,
    ErrorCategory,
    ErrorEnvelope,
    ErrorInfo,
    GenAI,
    OperationStatus,
    OperatorRequest,
    OpledgerError,
    PlanProposal,
    PlanRequest,
    PlanStatus,
    ProposalEnvelope,
    ProposeReply,
    RuntimeContext,
    StatusRequest,
    Subjects,
    ToolProposal,
    ToolsReply,
    ToolsRequest,
    TraceAttr,
    check_token,
    drop_undecodable_messages,
    new_operation_id,
    trace_headers,
    tracer,
)

__all__ = [
    "AgentHostClient",
    "ApproverClient",
    "LedgerUnavailable",
    "OperatorClient",
    "OutcomeTimeout",
    "RequestRefused",
]

_log = logging.getLogger(__name__)


class LedgerUnavailable(OpledgerError):
    """No ledger service answered in time. Safe to retry: proposals are idempotent."""

    category = ErrorCategory.TRANSIENT
    code = "LEDGER_UNAVAILABLE"
    retryable = True


class OutcomeTimeout(OpledgerError):
    """The operation did not reach a final state in time (it may still)."""

    category = ErrorCategory.TRANSIENT
    code = "OUTCOME_TIMEOUT"
    retryable = True


class RequestRefused(OpledgerError):
    """The ledger answered with an error envelope."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message, **info.safe_details)
        self.info = info
        self.category = info.category
        self.code = info.code
        self.retryable = info.retryable


class AgentHostClient:
    """One agent host's connection to the ledger."""

    def __init__(
        self,
        nc: Client,
        host: str,
        *,
        timeout: float = 5.0,
        poll_interval: float = 2.0,
        remembered: int = 4096,
        on_attention: Callable[[OperationStatus], object] | None = None,
        on_outcome: Callable[[OperationStatus], object] | None = None,
    ) -> None:
        """`on_attention` is called with each notice that an operation, not final,
        needs a person (`needs_resolution`); `attention` returns the last one.

        `on_outcome` is called with each final status announced for this host's
        operations, as it arrives (for a host that handles outcomes as events
        rather than awaiting each one); `outcome()` returns them all the same.
        Announcements start with the first `propose` or `outcome` (or `listen`). At
        least once: the ledger publishes a notice again when it cannot tell that one
        was delivered, so a handler keys what it does by the operation ID.

        Both are called, not awaited: a coroutine function is refused (`TypeError`);
        schedule async work from a plain function."""
        for name, hook in (("on_attention", on_attention), ("on_outcome", on_outcome)):
            if inspect.iscoroutinefunction(hook):
                raise TypeError(f"{name} is called, not awaited: pass a plain function")
        self._nc = nc
        self.host = check_token(host)
        self._timeout = timeout
        self._poll = poll_interval
        self._outcomes: Subscription | None = None
        self._subscribing = asyncio.Lock()
        # Final statuses announced but not yet asked for, and the operations
        # proposed since the subscription started (their notices will come
        # to it); both bounded, oldest dropped first.
        self._announced: Recent[str, OperationStatus] = Recent(remembered)
        self._proposed: Recent[str, None] = Recent(remembered)
        self._waiters: dict[str, list[asyncio.Future[OperationStatus]]] = {}
        self._attention: Recent[str, OperationStatus] = Recent(remembered)
        self._on_attention = on_attention
        self._outcome_hook = on_outcome

    @classmethod
    async def connect(
        cls, url: str, host: str, *, timeout: float = 5.0, **connect_options: Any
    ) -> AgentHostClient:
        """Connect as `host` (`connect_options`: credentials and inbox prefix)."""
        drop_undecodable_messages()
        return cls(await nats.connect(url, **connect_options), host, timeout=timeout)

    async def close(self) -> None:
        """Drain and close the connection."""
        await self._nc.drain()

    async def listen(self) -> None:
        """Subscribe to this host's outcome announcements now, if not yet (`propose`
        and `outcome` do so first): outcomes of operations proposed before, by this
        host's other processes, then reach `on_outcome` too."""
        await self._listen()
        await flush_all(self._nc, self._timeout)  # subscribed at the server on return

    async def _listen(self) -> None:
        """Subscribe to this host's outcome announcements (once)."""
        if self._outcomes is not None:
            return
        async with self._subscribing:
            if self._outcomes is None:
                self._outcomes = await self._nc.subscribe(
                    Subjects.all_outcomes(self.host), cb=self._on_outcome
                )

    async def _on_outcome(self, message: Msg) -> None:
        try:
            status = OperationStatus.model_validate_json(message.data)
        except ValidationError:
            return  # not an announcement the ledger makes: ignore it
        if not status.final:
            # Not an outcome: the operation waits for a person (the ledger's
            # lookups could not tell what happened). `outcome()` keeps waiting.
            self._attention.remember(status.operation_id, status)
            if self._on_attention is not None:
                try:
                    self._on_attention(status)
                except Exception:
                    _log.exception("on_attention failed for %s", status.operation_id)
            return
        if self._outcome_hook is not None:
            try:
                self._outcome_hook(status)
            except Exception:
                _log.exception("on_outcome failed for %s", status.operation_id)
        waiters = self._waiters.pop(status.operation_id, None)
        if waiters:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(status)
            return
        self._announced.remember(status.operation_id, status)

    async def _request(self, subject: str, payload: bytes, attempts: int) -> bytes:
        return await _request(self._nc, subject, payload, attempts, self._timeout)

    async def propose(
        self,
        proposal: ToolProposal,
        context: RuntimeContext,
        *,
        attempts: int = 3,
    ) -> ProposeReply:
        """Submit a proposal; the reply carries the decision (with repair feedback).

        Raises `RequestRefused` when the ledger refuses the request itself (a
        malformed envelope, an ID that belongs to another call).
        """
        operation_id = proposal.operation_id
        if operation_id is None:
            operation_id = new_operation_id()
            proposal = proposal.model_copy(update={"operation_id": operation_id})
        envelope = ProposalEnvelope(proposal=proposal, context=context)
        await self._listen()  # before the proposal: its outcome may come at once
        self._proposed.remember(operation_id, None)
        # The ledger continues this span's trace (a `traceparent` header) through the
        # check, the approval and the executor; in the host's own trace, if it has one.
        with tracer().start_as_current_span(
            "opledger.propose",
            kind=SpanKind.CLIENT,
            attributes={
                GenAI.TOOL_NAME: proposal.tool_name,
                GenAI.TOOL_CALL_ID: operation_id,
                TraceAttr.HOST: self.host,
            },
        ) as span:
            data = await self._request(
                Subjects.propose(self.host), envelope.model_dump_json().encode(), attempts
            )
            reply = ProposeReply.model_validate_json(data)
            if reply.error is not None:
                span.set_attribute(TraceAttr.REFUSAL, reply.error.code)
                raise RequestRefused(reply.error)
            if reply.state is not None:
                span.set_attribute(TraceAttr.STATE, reply.state)
        return reply

    async def tools(
        self,
        *,
        format: Literal["openai", "anthropic", "mcp"] = "mcp",
        capabilities: frozenset[str] | None = None,
        attempts: int = 3,
    ) -> list[dict[str, Any]]:
        """The tool definitions to offer a model acting for a caller with `capabilities`
        (None: every tool agents may call), in a model API's `format`: the contracts'
        own schemas, from the ledger the calls will be checked by."""
        request = ToolsRequest(
            format=format,
            capabilities=None if capabilities is None else sorted(capabilities),
        )
        data = await self._request(
            Subjects.tools(self.host), request.model_dump_json().encode(), attempts
        )
        body = orjson.loads(data)
        if isinstance(body, dict) and body.get("ok") is False:
            raise RequestRefused(ErrorEnvelope.model_validate(body).error)
        return ToolsReply.model_validate(body).tools

    async def status(self, operation_id: str, *, attempts: int = 3) -> OperationStatus:
        """Where one of this host's operations stands."""
        request = StatusRequest(operation_id=operation_id).model_dump_json().encode()
        data = await self._request(Subjects.status(self.host), request, attempts)
        # The answer is a status, or the error envelope (`"ok": false`, no `final`).
        return _status_or_refusal(data)

    async def cancel(
        self, operation_id: str, *, reason: str = "", attempts: int = 3
    ) -> OperationStatus:
        """Cancel one of this host's operations; its status right after.

        Not run yet: `cancelled` (final). Running: `cancel_requested` with
        `cancel="requested"`; the executor is told at its next check-in, and
        `outcome()` then returns `cancelled`, or what happened with
        `cancel="too_late"`. Already settled: its outcome, `cancel="too_late"`.
        Asking again is safe: a cancel converges.
        """
        request = CancelRequest(operation_id=operation_id, reason=reason)
        data = await self._request(
            Subjects.cancel(self.host), request.model_dump_json().encode(), attempts
        )
        return _status_or_refusal(data)

    async def propose_plan(
        self, plan: PlanProposal, context: RuntimeContext, *, attempts: int = 3
    ) -> PlanStatus:
        """Propose a plan of tool calls, checked and approved as one unit; its status.

        A rejected plan answers `rejected` with every finding, each naming its step
        and its place in the plan. Idempotent by `plan.plan_id`: the same plan again
        answers its status; another plan under that ID is refused (`RequestRefused`,
        `OPERATION_CONFLICT`). Each step is an operation of this host under its own
        `operation_id`, announced and asked about like any other.
        """
        request = PlanRequest(command="propose", plan=plan, context=context)
        await self._listen()  # the steps' outcomes are announced like any operation's
        for step in plan.steps:
            self._proposed.remember(step.operation_id, None)
        return await self._plan_request(request, attempts)

    async def plan_status(self, plan_id: str, *, attempts: int = 3) -> PlanStatus:
        """Where one of this host's plans stands, with its step table."""
        return await self._plan_request(PlanRequest(command="status", plan_id=plan_id), attempts)

    async def cancel_plan(
        self, plan_id: str, *, reason: str = "", attempts: int = 3
    ) -> PlanStatus:
        """Cancel one of this host's plans: steps not started never will; running ones
        are asked to stop (each ends `cancelled`, or with `cancel="too_late"`)."""
        request = PlanRequest(command="cancel", plan_id=plan_id, reason=reason)
        return await self._plan_request(request, attempts)

    async def plan_outcome(self, plan_id: str, timeout: float = 60.0) -> PlanStatus:
        """Wait until the plan is final (`succeeded`, `partially_succeeded`, `failed`,
        `cancelled`, or refused, denied or expired) and return its status. Asks every
        poll interval: a plan's steps are announced one by one, the plan itself is not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            status = await self.plan_status(plan_id)
            if status.final:
                return status
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise OutcomeTimeout(
                    "the plan is not final yet", operation_id=plan_id, state=status.state
                )
            await asyncio.sleep(min(remaining, self._poll, 0.2))

    async def _plan_request(self, request: PlanRequest, attempts: int) -> PlanStatus:
        data = await self._request(
            Subjects.plan(self.host), request.model_dump_json().encode(), attempts
        )
        return _plan_or_refusal(data)

    def attention(self, operation_id: str) -> OperationStatus | None:
        """The last notice that `operation_id` needs a person, if one came (not final)."""
        return self._attention.get(operation_id)

    async def outcome(self, operation_id: str, timeout: float = 30.0) -> OperationStatus:
        """Wait until the operation is final and return its status with the result.

        Listens before asking, so an outcome announced in between is not missed.
        """
        await self._listen()
        announced = self._announced.pop(operation_id, None)
        if announced is not None:
            return announced
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        waiter: asyncio.Future[OperationStatus] = loop.create_future()
        self._waiters.setdefault(operation_id, []).append(waiter)
        try:
            # Proposed through this client after it started listening: the
            # announcement will come. Otherwise it may have come and gone.
            ask = operation_id not in self._proposed
            while True:
                if ask:
                    status = await self.status(operation_id)
                    if status.final:
                        return status
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise OutcomeTimeout(
                        "the operation is not final yet",
                        operation_id=operation_id,
                        state=status.state if ask else "unknown",
                    )
                try:
                    async with asyncio.timeout(min(remaining, self._poll)):
                        return await asyncio.shield(waiter)
                except TimeoutError:
                    ask = True  # in case the announcement was lost
        finally:
            waiters = self._waiters.get(operation_id)
            if waiters is not None:
                with contextlib.suppress(ValueError):
                    waiters.remove(waiter)
                if not waiters:
                    del self._waiters[operation_id]
            waiter.cancel()


class _PersonClient:
    """A person's connection to the ledger, on the one request subject of their own
    identity: what they may do is the broker's grant, who they are its word."""

    _subject: Callable[[str], str]

    def __init__(self, nc: Client, name: str, *, timeout: float = 5.0) -> None:
        self._nc = nc
        self.name = check_token(name)
        self._timeout = timeout

    async def _send(self, request: BaseModel, attempts: int) -> OperationStatus:
        data = await _request(
            self._nc,
            type(self)._subject(self.name),
            request.model_dump_json().encode(),
            attempts,
            self._timeout,
        )
        return _status_or_refusal(data)

    async def close(self) -> None:
        """Drain and close the connection."""
        await self._nc.drain()


class OperatorClient(_PersonClient):
    """One operator's connection to the ledger: settle unknown outcomes, cancel, retry.

    The operator's own NATS identity (`Role.OPERATOR`) may publish only to
    `ops.operate.<name>`, and the ledger records every action as
    `operator:<name>`: who settled what is the broker's word, not the caller's.
    Operation IDs are the ledger's (`<host>/<id>`), as `opledger ops` shows them.
    """

    _subject = staticmethod(Subjects.operate)

    async def resolve(
        self, operation_id: str, *, applied: bool, reason: str, attempts: int = 3
    ) -> OperationStatus:
        """Settle an unknown outcome (or one that needs resolution): what happened, and why."""
        request = OperatorRequest(
            command="resolve", operation_id=operation_id, applied=applied, reason=reason
        )
        return await self._send(request, attempts)

    async def cancel(
        self, operation_id: str, *, reason: str = "", attempts: int = 3
    ) -> OperationStatus:
        """Cancel any operation (see `AgentHostClient.cancel` for what follows)."""
        request = OperatorRequest(command="cancel", operation_id=operation_id, reason=reason)
        return await self._send(request, attempts)

    async def retry(self, operation_id: str, *, reason: str, attempts: int = 1) -> OperationStatus:
        """Run a failed call again, saying why; the answer is the status of the new
        operation it runs as (`<host>/<id>-r1`), checked and approved afresh.

        The failed operation keeps its final outcome. Refused (`ILLEGAL_TRANSITION`)
        for anything but a failed call, a cancelled one, one retried already, and
        one an executor reported as succeeded after all. Asked once by default:
        after a lost reply, a second retry is refused (`already run again as ...`),
        which names the new operation.
        """
        request = OperatorRequest(command="retry", operation_id=operation_id, reason=reason)
        return await self._send(request, attempts)


    async def compensate(
        self, operation_id: str, *, reason: str, attempts: int = 3
    ) -> OperationStatus:
        """Propose undoing a succeeded call with the tool its contract names; the answer
        is the status of the compensation (`<host>/<id>-c`), an operation of its own,
        checked and approved afresh. Asking again answers the same compensation.
        `RequestRefused` when the call did not succeed or its effect has no compensation."""
        request = OperatorRequest(command="compensate", operation_id=operation_id, reason=reason)
        return await self._send(request, attempts)


class ApproverClient(_PersonClient):
    """One approver's connection to the ledger: approve or deny calls.

    The approver's own NATS identity (`Role.APPROVER`) may publish only to
    `ops.approve.<name>`; the ledger records each decision as `<name>`'s, with
    the approver roles its own configuration gives that name. Nothing the
    approver sends can claim another name or another role.
    """

    _subject = staticmethod(Subjects.approve)

    async def approve(
        self,
        operation_id: str,
        *,
        proposal_hash: str,
        preview_hash: str | None = None,
        attempts: int = 1,
    ) -> OperationStatus:
        """Approve exactly the call that hashes to `proposal_hash` (as shown to you), and,
        for a call its tool previews, exactly the effect whose preview hashes to
        `preview_hash` (as shown to you).

        `RequestRefused` (`APPROVAL_REFUSED`) when the ledger refused it; the
        refusal is recorded, and its message says what to do next. Asked once by
        default: after a lost reply, a second approval by the same person is
        refused (`duplicate_approver`), so look at the operation instead.
        """
        request = ApproverRequest(
            command="approve",
            operation_id=operation_id,
            proposal_hash=proposal_hash,
            preview_hash=preview_hash,
        )
        return await self._send(request, attempts)

    async def deny(
        self, operation_id: str, *, reason: str = "", attempts: int = 1
    ) -> OperationStatus:
        """Deny the call: it will never run (`RequestRefused` if you may not)."""
        request = ApproverRequest(command="deny", operation_id=operation_id, reason=reason)
        return await self._send(request, attempts)

    async def approve_plan(
        self, plan_id: str, *, plan_hash: str, attempts: int = 1
    ) -> PlanStatus:
        """Approve exactly the plan that hashes to `plan_hash` (every step, its order and
        its edges, as shown to you): one approval for all its steps. `plan_id` is the
        ledger's `<host>/<plan id>`. Refused like an approval of a call."""
        request = ApproverRequest(command="approve", plan_id=plan_id, proposal_hash=plan_hash)
        return await self._send_plan(request, attempts)

    async def deny_plan(self, plan_id: str, *, reason: str = "", attempts: int = 1) -> PlanStatus:
        """Deny the plan: none of it runs."""
        request = ApproverRequest(command="deny", plan_id=plan_id, reason=reason)
        return await self._send_plan(request, attempts)

    async def _send_plan(self, request: ApproverRequest, attempts: int) -> PlanStatus:
        data = await _request(
            self._nc, Subjects.approve(self.name), request.model_dump_json().encode(),
            attempts, self._timeout,
        )
        return _plan_or_refusal(data)


async def _request(
    nc: Client, subject: str, payload: bytes, attempts: int, timeout: float
) -> bytes:
    """One request to the ledger, asked again on no answer or `LEDGER_BUSY`.

    Every request the SDK sends is safe to repeat: proposals are idempotent by
    their operation ID, status requests read, and cancels and resolutions converge.
    """
    # The caller's trace context travels along: the ledger's spans continue it.
    headers = trace_headers()
    for attempt in range(attempts):
        try:
            reply = await nc.request(subject, payload, timeout=timeout, headers=headers)
        except MaxPayloadError:
            # Never sent: the server takes no message this large. The caller's own
            # mistake, told as such (an MCP client got "Internal server error").
            raise RequestRefused(ErrorInfo(
                code="REQUEST_TOO_LARGE",
                category=ErrorCategory.INVALID_INPUT,
                message=f"the request is {len(payload)} bytes, more than the NATS server"
                f" takes in one message ({nc.max_payload} bytes): send less",
                safe_details={"bytes": len(payload), "max_payload": nc.max_payload},
            )) from None
        except (NatsTimeout, NoRespondersError):
            if attempt + 1 == attempts:
                raise LedgerUnavailable("no ledger service answered") from None
            await asyncio.sleep(min(0.2 * 2**attempt, 2.0))
            continue
        data = bytes(reply.data)
        busy = _busy_wait_s(data)
        if busy is not None and attempt + 1 < attempts:
            # Too many requests wait at the ledger: back off, then ask again.
            await asyncio.sleep(max(busy, min(0.2 * 2**attempt, 2.0)))
            continue
        return data
    raise LedgerUnavailable("no ledger service answered")


def _status_or_refusal(data: bytes) -> OperationStatus:
    """A status answer, or `RequestRefused` for the error envelope.

    A status always has `final`; a failed operation's failure is in its `outcome`
    (the status's own `error` field is never written). A ledger older than this SDK
    refuses with `{"operation_id", "error"}` and no `ok`: an error without `final`
    is a refusal in either shape.
    """
    body = orjson.loads(data)
    if isinstance(body, dict) and "final" not in body and body.get("error") is not None:
        if body.get("ok") is False:
            raise RequestRefused(ErrorEnvelope.model_validate(body).error)
        raise RequestRefused(ErrorInfo.model_validate(body["error"]))
    return OperationStatus.model_validate(body)


def _plan_or_refusal(data: bytes) -> PlanStatus:
    """A plan's status, or `RequestRefused` for the error envelope."""
    body = orjson.loads(data)
    if isinstance(body, dict) and body.get("ok") is False:
        raise RequestRefused(ErrorEnvelope.model_validate(body).error)
    return PlanStatus.model_validate(body)


def _busy_wait_s(data: bytes) -> float | None:
    """Seconds to wait if `data` is a LEDGER_BUSY answer (None: any other answer)."""
    if b"LEDGER_BUSY" not in data:  # the common case, without decoding
        return None
    try:
        error = orjson.loads(data).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if error.get("code") != "LEDGER_BUSY":
        return None
    return float(error.get("retry_after_ms") or 0) / 1000
