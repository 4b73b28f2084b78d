"""The agent-host SDK: propose tool calls and wait for their outcomes over NATS.

A host speaks only on its own subjects (`ops.propose.<host>`, `ops.status.<host>`,
`ops.outcome.<host>.*`); the server's permissions make that the host's identity.
The SDK always sends an operation ID, minting one when the caller gives none,
so that retrying a proposal after a timeout can never create a second operation.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from schemas import (
    ErrorCategory,
    ErrorInfo,
    OperationStatus,
    OpledgerError,
    ProposalEnvelope,
    ProposeReply,
    RuntimeContext,
    StatusRequest,
    Subjects,
    ToolProposal,
    check_token,
)

__all__ = ["AgentHostClient", "LedgerUnavailable", "OutcomeTimeout", "RequestRefused"]


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

    def __init__(self, nc: Client, host: str, *, timeout: float = 5.0) -> None:
        self._nc = nc
        self.host = check_token(host)
        self._timeout = timeout

    @classmethod
    async def connect(
        cls, url: str, host: str, *, timeout: float = 5.0, **connect_options: Any
    ) -> AgentHostClient:
        """Connect as `host` (`connect_options`: credentials and inbox prefix)."""
        return cls(await nats.connect(url, **connect_options), host, timeout=timeout)

    async def close(self) -> None:
        """Drain and close the connection."""
        await self._nc.drain()

    async def _request(self, subject: str, payload: bytes, attempts: int) -> bytes:
        for attempt in range(attempts):
            try:
                reply = await self._nc.request(subject, payload, timeout=self._timeout)
            except (NatsTimeout, NoRespondersError):
                if attempt + 1 == attempts:
                    raise LedgerUnavailable("no ledger service answered") from None
                await asyncio.sleep(min(0.2 * 2**attempt, 2.0))
                continue
            return bytes(reply.data)
        raise LedgerUnavailable("no ledger service answered")

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
        if proposal.operation_id is None:
            proposal = proposal.model_copy(update={"operation_id": f"op-{uuid.uuid4().hex}"})
        envelope = ProposalEnvelope(proposal=proposal, context=context)
        data = await self._request(
            Subjects.propose(self.host), envelope.model_dump_json().encode(), attempts
        )
        reply = ProposeReply.model_validate_json(data)
        if reply.error is not None:
            raise RequestRefused(reply.error)
        return reply

    async def status(self, operation_id: str, *, attempts: int = 3) -> OperationStatus:
        """Where one of this host's operations stands."""
        request = StatusRequest(operation_id=operation_id).model_dump_json().encode()
        data = await self._request(Subjects.status(self.host), request, attempts)
        if b'"final"' not in data:
            reply = ProposeReply.model_validate_json(data)
            assert reply.error is not None
            raise RequestRefused(reply.error)
        return OperationStatus.model_validate_json(data)

    async def outcome(self, operation_id: str, timeout: float = 30.0) -> OperationStatus:
        """Wait until the operation is final and return its status with the result.

        Subscribes before asking, so an outcome announced in between is not missed.
        """
        subscription = await self._nc.subscribe(Subjects.outcome(self.host, operation_id))
        try:
            status = await self.status(operation_id)
            deadline = asyncio.get_running_loop().time() + timeout
            while not status.final:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    raise OutcomeTimeout(
                        "the operation is not final yet",
                        operation_id=operation_id,
                        state=status.state,
                    )
                try:
                    message = await subscription.next_msg(timeout=min(remaining, 5.0))
                except NatsTimeout:
                    status = await self.status(operation_id)  # in case a notice was lost
                    continue
                status = OperationStatus.model_validate_json(message.data)
            return status
        finally:
            await subscription.unsubscribe()
