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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from faststream.nats import NatsBroker
from faststream.nats.security import NatsNKey
from nats.aio.client import Client
from nats.js import JetStreamContext
from pydantic import BaseModel, ValidationError

from ledger.domain.states import TERMINAL_STATES, ResultDisposition
from ledger.server.gateway import LedgerGateway
from ledger.server.metrics import LedgerMetrics
from ledger.server.redispatch import Redispatcher
from ledger.server.relay import Relay, RelayPorts, RelayPositions
from ledger.server.requests import RequestServer
from ledger.service import Ledger
from schemas import (
    RESULTS_CONSUMER,
    RESULTS_STREAM,
    ApproverRequest,
    CancelRequest,
    ErrorCategory,
    ErrorEnvelope,
    ErrorInfo,
    LeaseRequest,
    OperatorRequest,
    OpledgerError,
    ProposalEnvelope,
    ProposeReply,
    PullConsumer,
    ResultEnvelope,
    StatusRequest,
    Subjects,
    host_operation_id,
)

__all__ = ["LedgerService", "ServiceOptions", "build_relay", "relay_ports"]

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


def _reply(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


def _refused(error: ErrorInfo) -> bytes:
    """A refused proposal: the propose reply with its error."""
    return _reply(ProposeReply(error=error))


def _failed(error: ErrorInfo, operation_id: str | None = None) -> bytes:
    """A refused status or lease request: the error envelope (with the operation asked about)."""
    meta = {} if operation_id is None else {"operation_id": operation_id}
    return _reply(ErrorEnvelope(error=error, meta=meta))


def relay_ports(ledger: Ledger) -> RelayPorts:
    """The relay's ports on a real ledger: the composition root's one look inside it."""
    catalog = ledger.checker.catalog

    def sensitive_arguments(tool: str) -> tuple[str, ...]:
        contract = catalog.get(tool)
        return contract.sensitive_arguments if contract else ()

    def note_set_aside(operation_id: str, position: int, version: int, reason: str) -> None:
        ledger.note_publication_set_aside(
            operation_id, position=position, version=version, reason=reason
        )

    return RelayPorts(
        rows_after=ledger.stored_rows_after,
        refresh=ledger.refresh,
        routes=ledger.projector.routes,
        sensitive_arguments=sensitive_arguments,
        status=lambda operation_id, version, host: ledger.status(
            operation_id, known_version=version, host=host
        ),
        note_set_aside=note_set_aside,
        final_states=frozenset(state.value for state in TERMINAL_STATES),
    )


def build_relay(
    gateway: LedgerGateway, nc: Client, *, relay: Callable[..., Relay] = Relay, **options: Any
) -> Relay:
    """A relay over `gateway`'s ledger, publishing on `nc` (`options`: `Relay`'s keywords;
    `relay`: the class, or a factory taking `Relay`'s arguments)."""
    ledger = gateway.ledger
    return relay(gateway, nc, relay_ports(ledger), RelayPositions(ledger.db), **options)


class LedgerService:
    """The ledger on NATS: start, serve, stop."""

    def __init__(self, ledger: Ledger, options: ServiceOptions) -> None:
        self.ledger = ledger
        self.options = options
        servers = [url.strip() for url in options.nats_url.split(",") if url.strip()]
        connect = _broker_options(options.connect_options)
        self._on_reconnected_too = connect.pop("reconnected_cb", None)
        self.broker = NatsBroker(servers, reconnected_cb=self._on_reconnected, **connect)
        self.gateway: LedgerGateway | None = None
        self.relay: Relay | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._results: PullConsumer | None = None
        self._requests: RequestServer | None = None
        self._redispatcher: Redispatcher | None = None

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
        try:
            return _reply(await self._gateway.cancel(request.operation_id, host, request.reason))
        except OpledgerError as error:
            return _failed(error.to_info(), request.operation_id)

    async def _on_operate(self, body: bytes, operator: str) -> bytes:
        try:
            request = OperatorRequest.model_validate_json(body)
        except ValidationError as exc:
            return _failed(_invalid(exc))
        try:
            return _reply(await self._gateway.operate(request, operator))
        except OpledgerError as error:
            return _failed(error.to_info(), request.operation_id)

    async def _on_approve(self, body: bytes, approver: str) -> bytes:
        try:
            request = ApproverRequest.model_validate_json(body)
        except ValidationError as exc:
            return _failed(_invalid(exc))
        # Who decides is the subject's name (the broker let only that identity
        # publish there), with the roles this service was configured with.
        roles = self.options.approver_roles.get(approver, frozenset())
        try:
            return _reply(await self._gateway.decide(request, approver, roles))
        except OpledgerError as error:
            return _failed(error.to_info(), request.operation_id)

    @property
    def _gateway(self) -> LedgerGateway:
        assert self.gateway is not None, "the service is not started"
        return self.gateway

    async def _propose(self, body: bytes, host: str) -> ProposeReply:
        try:
            envelope = ProposalEnvelope.model_validate_json(body)
        except ValidationError as exc:
            return ProposeReply(error=_invalid(exc))
        allowed = self.options.allowed_tenants
        if allowed is not None and envelope.context.tenant not in allowed.get(host, frozenset()):
            return ProposeReply(
                error=ErrorInfo(
                    code="TENANT_NOT_ALLOWED",
                    category=ErrorCategory.UNAUTHORIZED,
                    message="this host may not act for that tenant",
                )
            )
        try:
            submission = await self._gateway.submit((envelope.proposal, envelope.context, host))
        except OpledgerError as error:
            return ProposeReply(error=error.to_info())
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
        try:
            if request.holding is not None:
                reply = await self._gateway.check_in(
                    request.operation_id, tool, request.holding
                )
            else:
                reply = await self._gateway.lease(request.operation_id, request.executor, tool)
        except OpledgerError as error:
            return _failed(error.to_info(), request.operation_id)
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
            except Exception:
                _log.exception("pulling results failed")
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
        outcomes = await self._gateway.record_many([envelope for _, envelope in accepted])
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

    async def _sweep(self) -> None:
        interval = self.options.sweep_interval.total_seconds()
        while True:
            await asyncio.sleep(interval)
            try:
                await self._gateway.call(self.ledger.expire_approvals)
                await self._gateway.call(self.ledger.expire_leases)
                self._gateway.written.set()
                if self._redispatcher is not None:
                    await self._redispatcher.sweep()
            except Exception:
                _log.exception("sweep failed")

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
        metrics = LedgerMetrics()
        if self.options.metrics_port is not None:
            metrics.serve(self.options.metrics_port, self.options.metrics_addr)
        self.metrics = metrics
        self.relay = build_relay(self.gateway, nc, metrics=metrics)
        self.relay.start()
        if self.options.redispatch_after is not None:
            self._redispatcher = Redispatcher(
                self.ledger.projector.waiting_since_before,
                js,
                after=self.options.redispatch_after,
            )
        await self.broker.start()
        await self._serve_requests(nc)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._consume_results(nc), name="ledger-results"),
            loop.create_task(self._sweep(), name="ledger-sweeps"),
        ]

    async def stop(self) -> None:
        """Stop serving; what was not relayed is relayed by the next start."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._requests is not None:
            await self._requests.stop()
        if self.relay is not None:
            await self.relay.stop()
        if self._results is not None:
            # Results delivered and not recorded go back at once.
            for message in await self._results.stop():
                with contextlib.suppress(Exception):
                    await message.nak()
        try:
            await asyncio.wait_for(self.broker.stop(), timeout=5)
        except Exception:
            with contextlib.suppress(Exception):
                await self.broker.connection.close()
        if self.gateway is not None:
            await self.gateway.stop()
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
