"""The ledger service: proposals, leases, results and status over NATS.

A FastStream `NatsBroker` owns the connection and its lifecycle. The
request/reply subjects are served in a queue group by lean nats-py
subscriptions (`ledger.server.requests`), so several service instances share
the load without answering twice. Results come from a durable JetStream pull
consumer shared the same way. Every handler parses its input itself and always
answers with a structured message: a bad request gets an error envelope, never
silence or a stack trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any, cast

from faststream.nats import NatsBroker
from faststream.nats.security import NatsNKey
from nats.aio.client import Client
from nats.js import JetStreamContext
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from pydantic import BaseModel, ValidationError

from ledger.adapters.append_notices import AppendNotices
from ledger.adapters.event_tables import StoredRow
from ledger.adapters.recorders import ArrayInsertRecorder
from ledger.domain.states import TERMINAL_STATES, ResultDisposition
from ledger.server.gateway import LedgerGateway
from ledger.server.metrics import LedgerMetrics
from ledger.server.plan_follower import PlanFollower
from ledger.server.redispatch import Redispatcher
from ledger.server.relay import AppendedRows, Relay, RelayPorts, RelayPositions
from ledger.server.requests import RequestServer
from ledger.server.sweep_reads import SweepReads
from ledger.server.transient import log_failure
from ledger.server.view_refresher import ViewRefresher
from ledger.service import Ledger, Submission
from policy import export_tool, offered_contracts
from schemas import (
    RESULTS_CONSUMER,
    RESULTS_STREAM,
    ApproverRequest,
    CancelRequest,
    ErrorCategory,
    ErrorEnvelope,
    ErrorInfo,
    GenAI,
    LeaseRequest,
    OperatorRequest,
    OpledgerError,
    PlanRequest,
    ProposalEnvelope,
    ProposeReply,
    PullConsumer,
    ResultEnvelope,
    RuntimeContext,
    StatusRequest,
    Subjects,
    ToolsReply,
    ToolsRequest,
    TraceAttr,
    cancel_and_wait,
    context_from_headers,
    context_from_traceparent,
    current_traceparent,
    drop_undecodable_messages,
    host_operation_id,
    ledger_operation_id,
    tracer,
)

__all__ = ["LedgerService", "ServiceOptions", "build_relay", "relay_ports"]

# How long a sweep waits for a question asked off the loop before it asks on the loop.
_SWEEP_QUESTION_TIMEOUT_S = 10.0

_log = logging.getLogger(__name__)

_RESULT_BYTES = 16 * 1024 * 1024
"""Result bytes asked for per pull request (more than any one message can be)."""


@dataclass(frozen=True, slots=True)
class ServiceOptions:
    """How the service connects and behaves."""

    nats_url: str
    """One URL, or several separated by commas (the nodes of a cluster)."""
    connect_options: dict[str, Any] = field(default_factory=dict)
    """Extra `nats.connect` options: credentials and inbox prefix."""
    queue_group: str = "opledger-ledger"
    result_batch: int = 256
    max_requests: int = 512
    """Propose, status and lease requests served at once (the rest wait in the subscription)."""
    sweep_interval: timedelta = timedelta(seconds=2)
    declare: Callable[[JetStreamContext], Awaitable[None]] | None = None
    """Declares streams and consumers at start (the service owns the topology)."""
    allowed_tenants: dict[str, frozenset[str]] | None = None
    """Host → tenants it may act for; None trusts every host for every tenant."""
    approver_roles: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """Approver identity → the approver roles it holds. The only source of an
    approver's roles: an identity not named here holds none, and whatever it
    approves or denies is refused (and recorded) as `not_an_approver`."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1 at this port."""
    metrics_addr: str = "127.0.0.1"
    instance: str = "ledger"
    """This instance's name (its identity's, `--name`): in its log lines, its metrics
    (`opledger_ledger_instance_info`) and the relay's holder."""
    view_thread: bool | None = None
    """Bring the operations view and the seal up to date on a thread of their own
    (`ledger.server.view_refresher`) instead of on the event loop; None: on
    PostgreSQL only, where the loop would otherwise wait for the database."""
    redispatch_after: timedelta | None = timedelta(seconds=60)
    """How long an operation may stay ready with its tool's queue empty before its work
    item is published again (`ledger.server.redispatch`); None: never."""


def _broker_options(connect_options: dict[str, Any]) -> dict[str, Any]:
    """nats-py connect options as FastStream broker arguments (NKeys via `security`)."""
    options = dict(connect_options)
    seed = options.pop("nkeys_seed", None)
    if seed is not None:
        options["security"] = NatsNKey(seed)
    return options


def _invalid(exc: ValidationError) -> ErrorInfo:
    return ErrorInfo(
        code="INVALID_MESSAGE",
        category=ErrorCategory.INVALID_INPUT,
        message="the message does not match its schema",
        safe_details={
            "errors": [
                {"path": "/" + "/".join(str(p) for p in e["loc"]), "message": e["msg"]}
                for e in exc.errors()[:10]
            ]
        },
    )


_NAME_BYTES = 128
"""How much of a name a caller sent (a tool, say) a span attribute keeps."""


def _named(value: str) -> str:
    return value[:_NAME_BYTES]


def _refusal(span: Span, error: ErrorInfo) -> None:
    """Mark `span` refused with `error`'s code; an error status only where the ledger,
    not the caller, failed."""
    span.set_attribute(TraceAttr.REFUSAL, error.code)
    if error.category is ErrorCategory.INTERNAL:
        span.set_status(Status(StatusCode.ERROR, error.code))


def _reply(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


_TENANT_NOT_ALLOWED = ErrorInfo(
    code="TENANT_NOT_ALLOWED",
    category=ErrorCategory.UNAUTHORIZED,
    message="this host may not act for that tenant",
)


def _refused(error: ErrorInfo) -> bytes:
    """A refused proposal: the propose reply with its error."""
    return _reply(ProposeReply(error=error))


def _failed(error: ErrorInfo, operation_id: str | None = None) -> bytes:
    """A refused status or lease request: the error envelope (with the operation asked about)."""
    meta = {} if operation_id is None else {"operation_id": operation_id}
    return _reply(ErrorEnvelope(error=error, meta=meta))


def relay_ports(
    ledger: Ledger,
    observe: Callable[[Sequence[StoredRow]], object] | None = None,
    taken_over: Callable[[], object] | None = None,
    refresh_soon: Callable[[], object] | None = None,
    rows_after: Callable[[int, int], Sequence[StoredRow]] | None = None,
    forget_appended: Callable[[], object] | None = None,
) -> RelayPorts:
    """The relay's ports on a real ledger: the composition root's one look inside it
    (`observe`: who else reads each batch of events, the plan follower; `taken_over`:
    what it does when this instance starts relaying; `refresh_soon`: a view refresher's,
    if the view is refreshed on a thread of its own; `rows_after`: where the relay
    reads the log, the table itself unless given; `forget_appended`: what forgets the
    rows `rows_after` kept from this process's appends, when another writer appends)."""
    catalog = ledger.checker.catalog

    def sensitive_arguments(tool: str) -> tuple[str, ...]:
        contract = catalog.get(tool)
        return contract.sensitive_arguments if contract else ()

    def note_set_aside(operation_id: str, position: int, version: int, reason: str) -> None:
        ledger.note_publication_set_aside(
            operation_id, position=position, version=version, reason=reason
        )

    return RelayPorts(
        rows_after=rows_after or ledger.stored_rows_after,
        refresh=ledger.refresh,
        routes=ledger.projector.routes,
        sensitive_arguments=sensitive_arguments,
        status=lambda operation_id, version, host: ledger.status(
            operation_id, known_version=version, host=host
        ),
        note_set_aside=note_set_aside,
        final_states=frozenset(state.value for state in TERMINAL_STATES),
        last_position=ledger.event_reader.last_position,
        prefetch=ledger.status_reader.prefetch,
        observe=observe,
        taken_over=taken_over,
        refresh_soon=refresh_soon,
        forget_appended=forget_appended,
    )


def _append_notices(ledger: Ledger, relay: Relay) -> AppendNotices | None:
    """On PostgreSQL, a listener for other instances' appends: it wakes `relay`, and drops
    this process's copies of the operations they appended to."""
    storage = ledger.events.storage
    recorder = ledger.events.recorder
    if storage.postgres_dsn is None or not isinstance(recorder, ArrayInsertRecorder):
        return None  # SQLite: one writer, this process

    def on_notice(operation_ids: Sequence[str] | None) -> None:
        # Before any command could use a stale copy.
        if operation_ids is None:
            ledger.runner.evict_all()  # notices may have gone unheard
        else:
            ledger.runner.evict(operation_ids)
        relay.others_appended()

    return AppendNotices(
        storage.postgres_dsn,
        recorder.channel_name,
        store=recorder.notice_store,
        writer=recorder.notice_writer,
        on_notice=on_notice,
    )


def build_relay(
    gateway: LedgerGateway,
    nc: Client,
    *,
    relay: Callable[..., Relay] = Relay,
    observe: Callable[[Sequence[StoredRow]], object] | None = None,
    taken_over: Callable[[], object] | None = None,
    refresh_soon: Callable[[], object] | None = None,
    **options: Any,
) -> Relay:
    """A relay over `gateway`'s ledger, publishing on `nc` (`options`: `Relay`'s keywords;
    `relay`: the class, or a factory taking `Relay`'s arguments; `observe`, `taken_over`,
    `refresh_soon`: see `relay_ports`)."""
    ledger = gateway.ledger
    # What this process appends reaches the relay without a read of the table,
    # when it provably follows the relay's position (`AppendedRows`).
    appended = AppendedRows(ledger.stored_rows_after)
    ledger.runner.on_stored(appended.add)
    ports = relay_ports(
        ledger, observe, taken_over, refresh_soon, appended.rows_after, appended.forget
    )
    return relay(gateway, nc, ports, RelayPositions(ledger.db), **options)


def _record_span(message: Any, envelope: ResultEnvelope) -> Span:
    """The span of recording one result, in the trace the executor's result carries
    (a no-op span if tracing fails: recording never depends on it)."""
    try:
        return tracer().start_span(
            "opledger.record",
            context=context_from_headers(message.headers),
            kind=SpanKind.CONSUMER,
            attributes={
                TraceAttr.OPERATION_ID: envelope.operation_id,
                GenAI.TOOL_NAME: envelope.provenance.tool,
                TraceAttr.FENCING_TOKEN: envelope.fencing_token,
                TraceAttr.OUTCOME: envelope.outcome.value,
            },
        )
    except Exception:
        _log.debug("no span for the result of %s", envelope.operation_id, exc_info=True)
        return trace.INVALID_SPAN


def _end_record_span(span: Span, outcome: ResultDisposition | BaseException) -> None:
    try:
        if isinstance(outcome, OpledgerError):
            _refusal(span, outcome.to_info())
        elif isinstance(outcome, BaseException):
            span.record_exception(outcome)
            span.set_status(Status(StatusCode.ERROR, type(outcome).__name__))
        else:
            span.set_attribute(TraceAttr.DISPOSITION, outcome.value)
        span.end()
    except Exception:
        _log.debug("could not end a result's span", exc_info=True)


def _ledger_id(host: str, operation_id: str) -> str:
    """The ledger's ID of a host's operation, or the host's ID as sent if it is none
    (the request is refused anyway; the span still names what was asked)."""
    try:
        return ledger_operation_id(host, operation_id)
    except ValueError:
        return _named(operation_id)


def _describe_submission(span: Span, submission: Submission) -> None:
    """The check's verdict on the span: the operation, its state and decision, risk."""
    span.set_attributes(
        {
            TraceAttr.OPERATION_ID: submission.operation_id,
            TraceAttr.STATE: submission.state.value,
            TraceAttr.CREATED: submission.created,
        }
    )
    decision = submission.decision
    if decision is None:
        return
    span.set_attributes(
        {
            TraceAttr.DECISION: decision.outcome.value,
            TraceAttr.APPROVAL_REQUIRED: decision.approval is not None,
        }
    )
    if decision.risk is not None:
        span.set_attribute(TraceAttr.RISK, decision.risk.value)
        span.set_attribute(TraceAttr.RISK_REASONS, list(decision.risk_reasons))
    if decision.issues:
        span.set_attribute(TraceAttr.REFUSAL, decision.issues[0].code)


class LedgerService:
    """The ledger on NATS: start, serve, stop."""

    def __init__(self, ledger: Ledger, options: ServiceOptions) -> None:
        self.ledger = ledger
        self.options = options
        servers = [url.strip() for url in options.nats_url.split(",") if url.strip()]
        # Before any connection: a request nats-py cannot decode is dropped, not fatal.
        drop_undecodable_messages()
        connect = _broker_options(options.connect_options)
        self._on_reconnected_too = connect.pop("reconnected_cb", None)
        self.broker = NatsBroker(servers, reconnected_cb=self._on_reconnected, **connect)
        self.gateway: LedgerGateway | None = None
        self.relay: Relay | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._results: PullConsumer | None = None
        self._requests: RequestServer | None = None
        self._redispatcher: Redispatcher | None = None
        self._plans = PlanFollower()
        self.view_refresher: ViewRefresher | None = None
        self._sweep_reads: SweepReads | None = None
        self.append_notices: AppendNotices | None = None
        """On PostgreSQL: other instances' appends, heard as they happen (for the relay)."""

    async def _on_reconnected(self) -> None:
        # The server dropped the results consumer's open pull requests.
        if self._results is not None:
            self._results.reset()
        if self._on_reconnected_too is not None:
            await self._on_reconnected_too()

    # ----------------------------------------------------------------- handlers

    async def _serve_requests(self, nc: Client) -> None:
        # Plain nats-py subscriptions, not FastStream subscribers: see
        # ledger.server.requests for why, and for the reply-subject check.
        requests = RequestServer(
            nc, queue=self.options.queue_group, limit=self.options.max_requests
        )
        # A refused proposal is a propose reply with its `error`; a refused
        # status or lease request is the common error envelope (see
        # docs/wire-format.md#errors), told from an answer by its `ok`.
        await requests.serve(Subjects.all_proposals(), self._on_propose, error_reply=_refused)
        await requests.serve(Subjects.all_status_requests(), self._on_status)
        await requests.serve(Subjects.all_cancel_requests(), self._on_cancel)
        await requests.serve(Subjects.all_plan_requests(), self._on_plan)
        await requests.serve(Subjects.all_tool_requests(), self._on_tools)
        await requests.serve(Subjects.all_operator_requests(), self._on_operate)
        await requests.serve(Subjects.all_approver_requests(), self._on_approve)
        await requests.serve(Subjects.all_lease_requests(), self._lease)
        self._requests = requests

    async def _on_propose(self, body: bytes, host: str) -> bytes:
        return _reply(await self._propose(body, host))

    async def _on_status(self, body: bytes, host: str) -> bytes:
        try:
            request = StatusRequest.model_validate_json(body)
        except ValidationError as exc:
            return _failed(_invalid(exc))
        try:
            return _reply(await self._gateway.status(request.operation_id, host))
        except OpledgerError as error:
            return _failed(error.to_info(), request.operation_id)

    async def _on_cancel(self, body: bytes, host: str) -> bytes:
        try:
            request = CancelRequest.model_validate_json(body)
        except ValidationError as exc:
            return _failed(_invalid(exc))
        operation_id = _ledger_id(host, request.operation_id)
        with self._operation_span("opledger.cancel", operation_id) as span:
            span.set_attribute(TraceAttr.COMMAND, "cancel")
            try:
                status = await self._gateway.cancel(request.operation_id, host, request.reason)
            except OpledgerError as error:
                _refusal(span, error.to_info())
                return _failed(error.to_info(), request.operation_id)
            span.set_attribute(TraceAttr.STATE, status.state)
            return _reply(status)

    async def _on_plan(self, body: bytes, host: str) -> bytes:
        try:
            request = PlanRequest.model_validate_json(body)
        except ValidationError as exc:
            return _failed(_invalid(exc))
        if request.context is not None and not self._tenant_allowed(host, request.context):
            return _failed(_TENANT_NOT_ALLOWED, request.asked_id)
        try:
            return _reply(await self._gateway.plan(request, host))
        except OpledgerError as error:
            return _failed(error.to_info(), request.asked_id)

    def _tenant_allowed(self, host: str, context: RuntimeContext) -> bool:
        allowed = self.options.allowed_tenants
        return allowed is None or context.tenant in allowed.get(host, frozenset())

    async def _on_tools(self, body: bytes, host: str) -> bytes:  # noqa: ARG002
        try:
            request = ToolsRequest.model_validate_json(body)
        except ValidationError as exc:
            return _failed(_invalid(exc))
        # The catalog the service checks against: what the model is shown is what
        # the ledger will hold its calls to (the host's name is not a filter: a
        # host's callers differ, their capabilities say what each may call).
        catalog = self.ledger.checker.catalog
        capabilities = None if request.capabilities is None else frozenset(request.capabilities)
        offered = offered_contracts([contract for _, contract in catalog.items()], capabilities)
        tools = [export_tool(contract, request.format) for contract in offered]
        return _reply(ToolsReply(format=request.format, tools=tools))

    async def _on_operate(self, body: bytes, operator: str) -> bytes:
        try:
            request = OperatorRequest.model_validate_json(body)
        except ValidationError as exc:
            return _failed(_invalid(exc))
        with self._operation_span(f"opledger.{request.command}", request.operation_id) as span:
            span.set_attributes({TraceAttr.COMMAND: request.command, "opledger.operator": operator})
            try:
                status = await self._gateway.operate(request, operator)
            except OpledgerError as error:
                _refusal(span, error.to_info())
                return _failed(error.to_info(), request.operation_id)
            span.set_attribute(TraceAttr.STATE, status.state)
            return _reply(status)

    async def _on_approve(self, body: bytes, approver: str) -> bytes:
        try:
            request = ApproverRequest.model_validate_json(body)
        except ValidationError as exc:
            return _failed(_invalid(exc))
        # Who decides is the subject's name (the broker let only that identity
        # publish there), with the roles this service was configured with.
        roles = self.options.approver_roles.get(approver, frozenset())
        with self._operation_span("opledger.approval", request.decided_id) as span:
            span.set_attributes(
                {
                    TraceAttr.APPROVAL_ACTION: request.command,
                    TraceAttr.APPROVAL_APPROVER: approver,
                    TraceAttr.APPROVAL_VIA: "nats",
                }
            )
            if request.preview_hash is not None:
                span.set_attribute(TraceAttr.APPROVAL_PREVIEW_HASH, request.preview_hash)
            try:
                status = await self._gateway.decide(request, approver, roles)
            except OpledgerError as error:
                _refusal(span, error.to_info())
                return _failed(error.to_info(), request.decided_id)
            span.set_attribute(TraceAttr.STATE, status.state)
            return _reply(status)

    @contextlib.contextmanager
    def _operation_span(self, name: str, operation_id: str) -> Iterator[Span]:
        """A span in the trace of the operation's proposal (which may be days old),
        linked to the trace of the request that caused it, if it came with one."""
        stored = self.ledger.projector.trace_parent(operation_id)
        caller = trace.get_current_span().get_span_context()
        with tracer().start_as_current_span(
            name,
            context=context_from_traceparent(stored) if stored else None,
            kind=SpanKind.SERVER,
            links=[Link(caller)] if stored and caller.is_valid else None,
            attributes={TraceAttr.OPERATION_ID: operation_id},
        ) as span:
            yield span

    @property
    def _gateway(self) -> LedgerGateway:
        assert self.gateway is not None, "the service is not started"
        return self.gateway

    async def _propose(self, body: bytes, host: str) -> ProposeReply:
        try:
            envelope = ProposalEnvelope.model_validate_json(body)
        except ValidationError as exc:
            return ProposeReply(error=_invalid(exc))
        if not self._tenant_allowed(host, envelope.context):
            return ProposeReply(error=_TENANT_NOT_ALLOWED)
        proposal = envelope.proposal
        with tracer().start_as_current_span(
            "opledger.check",
            kind=SpanKind.SERVER,
            attributes={
                GenAI.TOOL_NAME: _named(proposal.tool_name),
                TraceAttr.HOST: host,
                TraceAttr.TENANT: _named(envelope.context.tenant),
            },
        ) as span:
            try:
                # The check's own context is kept with the operation: every later
                # span about it, on any process, joins this trace.
                submission = await self._gateway.submit(
                    (proposal, envelope.context, host, current_traceparent())
                )
            except OpledgerError as error:
                _refusal(span, error.to_info())
                return ProposeReply(error=error.to_info())
            _describe_submission(span, submission)
        return ProposeReply(
            # The host's own ID: the ledger's `<host>/<id>` is not the host's concern.
            operation_id=host_operation_id(submission.operation_id),
            state=submission.state.value,
            created=submission.created,
            decision=submission.decision,
        )

    async def _lease(self, body: bytes, tool: str) -> bytes:
        try:
            request = LeaseRequest.model_validate_json(body)
        except ValidationError as exc:
            return _failed(_invalid(exc))
        if request.holding is not None:  # a check-in: frequent, read only, not traced
            try:
                reply = await self._gateway.check_in(request.operation_id, tool, request.holding)
            except OpledgerError as error:
                return _failed(error.to_info(), request.operation_id)
            return _reply(reply)
        if request.preview is not None:  # the preview a `preview` answer asked for
            try:
                reply = await self._gateway.record_preview(
                    request.operation_id, tool, request.executor, request.preview
                )
            except OpledgerError as error:
                return _failed(error.to_info(), request.operation_id)
            return _reply(reply)
        with tracer().start_as_current_span(
            "opledger.lease",
            kind=SpanKind.SERVER,
            attributes={
                TraceAttr.OPERATION_ID: _named(request.operation_id),
                GenAI.TOOL_NAME: tool,
                TraceAttr.EXECUTOR: _named(request.executor),
            },
        ) as span:
            try:
                reply = await self._gateway.lease(request.operation_id, request.executor, tool)
            except OpledgerError as error:
                _refusal(span, error.to_info())
                return _failed(error.to_info(), request.operation_id)
            span.set_attribute(TraceAttr.LEASE_DECISION, reply.decision.value)
            if reply.attempt is not None:
                span.set_attribute(TraceAttr.ATTEMPT, reply.attempt)
            if reply.fencing_token is not None:
                span.set_attribute(TraceAttr.FENCING_TOKEN, reply.fencing_token)
        return _reply(reply)

    # ------------------------------------------------------------------ results

    async def _consume_results(self, nc: Client) -> None:
        # In bytes too: a batch of 256 results of 1 MiB each would be 256 MiB.
        results = PullConsumer(nc, RESULTS_STREAM, RESULTS_CONSUMER, max_bytes=_RESULT_BYTES)
        self._results = results
        await results.start()
        while True:
            try:
                # What arrived while the last batch was recorded is the next batch.
                messages = await results.take(self.options.result_batch, timeout=5)
            except Exception as exc:
                log_failure(_log, "pulling results failed", exc)
                await asyncio.sleep(1)
                continue
            if messages:
                await self._record(messages)

    async def _record(self, messages: Sequence[Any]) -> None:
        accepted: list[tuple[Any, ResultEnvelope]] = []
        for message in messages:
            tool = message.subject.rsplit(".", 1)[-1]
            try:
                envelope = ResultEnvelope.model_validate_json(message.data)
            except ValidationError:
                _log.warning("dropping a malformed result on %s", message.subject)
                await message.term()
                continue
            if envelope.provenance.tool != tool:
                _log.warning(
                    "dropping a result for %s published on %s",
                    envelope.provenance.tool,
                    message.subject,
                )
                await message.term()
                continue
            accepted.append((message, envelope))
        spans = [_record_span(message, envelope) for message, envelope in accepted]
        outcomes = await self._gateway.record_many([envelope for _, envelope in accepted])
        for span, outcome in zip(spans, outcomes, strict=True):
            _end_record_span(span, outcome)
        for (message, envelope), outcome in zip(accepted, outcomes, strict=True):
            if isinstance(outcome, OpledgerError) and outcome.retryable:
                await message.nak(delay=1)  # the ledger was unavailable: try again
                continue
            if isinstance(outcome, BaseException):
                _log.warning("result for %s refused: %s", envelope.operation_id, outcome)
            elif outcome is ResultDisposition.REFUSED:
                _log.warning(
                    "result for %s refused: the operation is not a %s operation",
                    envelope.operation_id,
                    envelope.provenance.tool,
                )
            await message.ack()

    # ------------------------------------------------------------------- sweeps

    async def _off_the_loop(self, reads: SweepReads | None, question: str, *args: Any) -> Any:
        """The answer of one of `reads`' questions; None if there is no `reads` or the
        question failed (the sweep then asks the view on the loop, whose connection is
        another); [] if it took longer than a sweep may wait (a view that slow would stop
        the loop: this sweep skips the question, says so, and the next asks again, over
        a new connection since this question is cancelled)."""
        if reads is None:
            return None
        try:
            async with asyncio.timeout(_SWEEP_QUESTION_TIMEOUT_S):
                return await getattr(reads, question)(*args)
        except TimeoutError:
            reads.cancel()
            _log.warning(
                "sweep: the view did not answer %s within %.0f s; asking again next sweep",
                question, _SWEEP_QUESTION_TIMEOUT_S,
            )
            return []
        except Exception as exc:
            log_failure(_log, f"sweep: asking the view off the loop ({question}) failed", exc)
            return None

    async def _waiting_since_before(
        self, moment: datetime
    ) -> Sequence[tuple[str, str, str | None, int, str, str | None]]:
        """The redispatcher's question: off the loop where the service asks the view
        there, on the loop otherwise or if that failed (see `_off_the_loop`)."""
        answer = await self._off_the_loop(self._sweep_reads, "waiting_since_before", moment)
        if answer is None:
            return self.ledger.projector.waiting_since_before(moment)
        return cast(Sequence[tuple[str, str, str | None, int, str, str | None]], answer)

    async def _sweep(self) -> None:
        interval = self.options.sweep_interval.total_seconds()
        while True:
            await asyncio.sleep(interval)
            try:
                # The view names the candidates and the aggregates decide, so a view a
                # quarter second behind only expires the newest a sweep later; with the
                # view thread keeping it close, the sweeps no longer refresh it on the
                # loop (two refreshes every sweep, 20 ms each on PostgreSQL).
                refresh = self.view_refresher is None or not self.view_refresher.healthy
                # Where the view is asked off the loop, the sweeps' questions too: a
                # slow view (dead row versions before a vacuum) never stops the loop.
                # Not while the loop refreshes the view itself (the thread failing):
                # the questions must follow that refresh.
                reads = None if refresh else self._sweep_reads
                awaiting = await self._off_the_loop(
                    reads, "approval_expiry_candidates", self.ledger.clock()
                )
                await self._gateway.call(
                    partial(self.ledger.expire_approvals, refresh=refresh, candidates=awaiting)
                )
                leased = await self._off_the_loop(
                    reads, "lease_expiry_candidates", self.ledger.clock()
                )
                await self._gateway.call(
                    partial(self.ledger.expire_leases, refresh=refresh, candidates=leased)
                )
                if self.view_refresher is not None:
                    self.view_refresher.refresh_soon()
                # Every open plan now and then: whatever the follower missed (a restart,
                # a takeover of the relay), and plan approvals that expired.
                await self._gateway.advance_plans(sorted(self._plans.running))
                self._gateway.written.set()
                if self._redispatcher is not None:
                    await self._redispatcher.sweep()
            except Exception as exc:
                log_failure(_log, "sweep failed", exc)

    async def _advance_plans(self) -> None:
        """Move on the plans whose steps the relay saw change, as they change."""
        while True:
            await self._plans.marked.wait()
            try:
                await self._gateway.advance_plans(self._plans.take_marked())
            except Exception as exc:
                log_failure(_log, "advancing plans failed", exc)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Connect, declare the topology, and begin serving."""
        self.gateway = LedgerGateway(self.ledger)
        self.gateway.start()
        await self.broker.connect()
        nc = self.broker.connection
        js = nc.jetstream()
        if self.options.declare is not None:
            await self.options.declare(js)
        metrics = LedgerMetrics(instance=self.options.instance)
        if self.options.metrics_port is not None:
            metrics.serve(self.options.metrics_port, self.options.metrics_addr)
        self.metrics = metrics
        view_thread = self.options.view_thread
        if view_thread is None:
            view_thread = self.ledger.db.is_postgres
        if self.ledger.budget is not None:
            # The relay or the view thread keeps the view current from now on.
            self.ledger.budget.view_kept_current()
        if view_thread:
            self.view_refresher = ViewRefresher(self.ledger)
            self.view_refresher.start()
            # Where the view is refreshed off the loop, it is also asked off the loop.
            self._sweep_reads = SweepReads(self.ledger)
        # The follower learns the open plans when this instance starts relaying (now,
        # or when it takes over from another), then from every event the relay reads.
        self.relay = build_relay(
            self.gateway, nc, metrics=metrics, instance=self.options.instance,
            observe=self._plans.observe,
            taken_over=lambda: self._plans.know(self.ledger.plans.open_ids()),
            refresh_soon=self.view_refresher.refresh_soon if self.view_refresher else None,
        )
        self.relay.start()
        self.append_notices = _append_notices(self.ledger, self.relay)
        if self.append_notices is not None:
            self.append_notices.start()
        if self.options.redispatch_after is not None:
            catalog = self.ledger.checker.catalog
            self._redispatcher = Redispatcher(
                self._waiting_since_before,
                js,
                after=self.options.redispatch_after,
                previewed=lambda tool: bool(
                    (contract := catalog.get(tool)) is not None and contract.approval.preview
                ),
            )
        await self.broker.start()
        await self._serve_requests(nc)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._consume_results(nc), name="ledger-results"),
            loop.create_task(self._sweep(), name="ledger-sweeps"),
            loop.create_task(self._advance_plans(), name="ledger-plans"),
        ]

    async def stop(self) -> None:
        """Stop serving; what was not relayed is relayed by the next start."""
        await cancel_and_wait(*self._tasks)
        if self._requests is not None:
            await self._requests.stop()
        if self.append_notices is not None:
            await self.append_notices.stop()
        if self.relay is not None:
            await self.relay.stop()
        if self._results is not None:
            # Results delivered and not recorded go back at once.
            for message in await self._results.stop():
                with contextlib.suppress(Exception):
                    await message.nak()
        try:
            async with asyncio.timeout(5):
                await self.broker.stop()
        except Exception:
            with contextlib.suppress(Exception):
                await self.broker.connection.close()
        if self.gateway is not None:
            await self.gateway.stop()
        if self._sweep_reads is not None:
            self._sweep_reads.close()
        if self.view_refresher is not None:
            # Off the loop: it finishes its refresh, then seals the tail (it holds the
            # sealer; the ledger's own `seal_now` below then only catches the view up).
            await asyncio.to_thread(self.view_refresher.stop)
        # The seal runs at most every quarter second: seal the tail before going.
        try:
            self.ledger.seal_now()
        except Exception:
            _log.exception("could not seal the last events before stopping")

    async def run_until(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set."""
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()
