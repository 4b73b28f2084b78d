"""`opledger mcp serve`: an MCP server in front of the ledger, for any MCP client.

The gateway is an agent host (`ledger.client.AgentHostClient`) with one host
identity, its NATS seed, per process. The runtime context its proposals carry
(principal, tenant, capabilities, environment) comes from the gateway's own
configuration, set by whoever starts it, never from the MCP client: nothing an
MCP client sends can widen what the host may do.

- `tools/list` is the ledger's answer to "what may this host's caller call"
  (`AgentHostClient.tools` with the configured capabilities): tools forbidden to
  agents and tools needing a capability the caller lacks are not listed. Each
  definition, schemas and annotations included, is rendered from the contract
  by `policy.to_mcp_tool`; an upstream server's own hints never reach it.
- `tools/call` is a proposal. A rejection comes back as an `isError` result
  whose content is the structured repair feedback; a ready call waits for its
  outcome, returned as `structuredContent` (the executor's redacted output),
  marked untrusted in `_meta`; a call that needs approval is deferred with MCP's
  multi round-trip pattern (`resultType: "input_required"` carrying only a
  sealed `requestState`), so a conforming client asks again until the outcome is
  in. Why that pattern and not the Tasks extension: docs/mcp.md.
- Which operation a call is: `ledger.mcp._calls`.

A client that closes its stream (an MCP cancellation) stops the gateway from
waiting, not the operation: the specification has clients re-issue a lost
request, and the re-issue must find the operation still there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from ledger.client import AgentHostClient, LedgerUnavailable, OutcomeTimeout, RequestRefused
from ledger.mcp._calls import (
    IDEMPOTENCY_KEY_META,
    STATE_KEY_MIN_BYTES,
    CallIdentity,
    RequestStateSeal,
    call_digest,
    caller_of,
)
from ledger.mcp._errors import McpConfigError, RequestStateRefused
from schemas import (
    Decision,
    DecisionOutcome,
    ErrorCategory,
    ErrorInfo,
    OperationStatus,
    RuntimeContext,
    ToolProposal,
    new_operation_id,
)

__all__ = ["OPLEDGER_META", "GatewaySettings", "McpGateway"]

_log = logging.getLogger("opledger.mcp.gateway")

OPLEDGER_META = "io.opledger/"
"""The prefix of every `_meta` key the gateway writes (`…operationId`, `…trust`, …)."""

# States in which a person (or the check) still has to decide before anything runs.
_NOT_YET_DECIDED = frozenset({"awaiting_approval", "validated", "proposed"})


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """One gateway's trusted configuration: whom it speaks for and how long it waits."""

    host: str
    """The host identity (its NATS seed is the gateway's); operations are `<host>/<id>`."""
    context: RuntimeContext
    """The runtime context of every proposal: from configuration, never from a client."""
    conversation_id: str = "mcp"
    approval_round_s: float = 10.0
    """How long one round of a call awaiting approval waits before `input_required`."""
    outcome_wait_s: float = 60.0
    """How long one round of a ready call waits for its outcome before `input_required`."""
    legacy_wait_s: float = 300.0
    """For clients of protocol versions without MRTR: how long a call waits in all (at
    most half the dedup window, so that the call made again finds its operation)."""
    dedup_window_s: float = 600.0
    """A write converges with an identical one of this caller made less than this before."""
    state_key: bytes = field(default_factory=lambda: secrets.token_bytes(STATE_KEY_MIN_BYTES))
    """Seals `requestState`; give every replica behind one endpoint the same key."""
    state_ttl_s: float = 900.0
    tools_ttl_s: float = 10.0
    """How long the ledger's tool list is reused before it is asked again."""
    max_waiting: int = 256
    """Calls held open at once; past it a round answers at once (`input_required`, or
    `OUTCOME_PENDING` for a client without MRTR) instead of holding the request."""

    def __post_init__(self) -> None:
        if len(self.state_key) < STATE_KEY_MIN_BYTES:
            raise McpConfigError(
                f"the request-state key needs at least {STATE_KEY_MIN_BYTES} bytes"
            )
        if self.max_waiting < 0:
            raise McpConfigError("max_waiting cannot be negative")


class McpGateway:
    """The MCP request handlers of one host, over its `AgentHostClient`."""

    def __init__(self, host: AgentHostClient, settings: GatewaySettings) -> None:
        """`host` is connected as `settings.host` (the ledger takes the name from the
        subject the server lets it publish on, so the two cannot differ in effect)."""
        self._host = host
        self._settings = settings
        caller = caller_of(settings.host, settings.context)
        self._ids = CallIdentity(caller, settings.dedup_window_s)
        self._seal = RequestStateSeal(settings.state_key, caller, settings.state_ttl_s)
        self._caller = caller
        self._waiting = 0
        self._tools: list[dict[str, Any]] = []
        self._tools_at = -float("inf")
        self._tools_lock = asyncio.Lock()

    def server(self, name: str = "opledger") -> Server[Any]:
        """A low-level MCP server with this gateway's `tools/list` and `tools/call`."""
        return Server(
            name,
            version="1",
            instructions="Tool calls are proposals to an operation ledger: checked, maybe"
            " approved by a person, then run. Results are untrusted data.",
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
        )

    # ------------------------------------------------------------------ tools/list

    async def _definitions(self, *, refresh: bool = False) -> list[dict[str, Any]]:
        async with self._tools_lock:
            now = time.monotonic()
            if refresh or now - self._tools_at > self._settings.tools_ttl_s:
                self._tools = await self._host.tools(
                    format="mcp", capabilities=self._settings.context.capabilities
                )
                self._tools_at = now
            return self._tools

    async def list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        """The tools this host's caller may call, as the ledger renders their contracts."""
        del ctx, params
        try:
            definitions = await self._definitions(refresh=True)
        except (LedgerUnavailable, RequestRefused) as error:
            message = f"the ledger did not answer: {error.code}"
            raise MCPError(types.INTERNAL_ERROR, message) from None
        tools = [types.Tool.model_validate(definition) for definition in definitions]
        # Private: another gateway (another host identity) lists other tools.
        ttl_ms = int(self._settings.tools_ttl_s * 1000)
        return types.ListToolsResult(tools=tools, ttl_ms=ttl_ms, cache_scope="private")

    async def _writes(self, tool: str) -> bool | None:
        """Whether `tool` writes, by the ledger's rendering of its contract (None: not
        offered to this caller; the ledger will say why when it is proposed)."""
        for definition in await self._definitions():
            if definition.get("name") == tool:
                hints = definition.get("annotations") or {}
                return not bool(hints.get("readOnlyHint", False))
        return None

    # ------------------------------------------------------------------ tools/call

    async def call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult | types.InputRequiredResult:
        """One round of a tool call: propose it (or find it again), then answer."""
        arguments: dict[str, Any] = dict(params.arguments or {})
        digest = call_digest(self._caller, params.name, arguments)
        modern = ctx.protocol_version in MODERN_PROTOCOL_VERSIONS
        if params.request_state is not None:
            try:
                sealed = self._seal.open(params.request_state, digest)
            except RequestStateRefused as refused:
                raise MCPError(types.INVALID_PARAMS, refused.message) from None
            return await self._answer(sealed, digest, modern, awaiting=True, derived=True)
        try:
            proposal = ToolProposal(
                proposal_id=f"mcp-{uuid.uuid4().hex}",
                conversation_id=self._settings.conversation_id,
                requested_by_user_id=self._settings.context.principal,
                tool_name=params.name,
                arguments=arguments,
            )
        except ValidationError:  # only the tool name comes from the client
            return _error_result(
                ErrorInfo(
                    code="UNKNOWN_TOOL",
                    category=ErrorCategory.INVALID_INPUT,
                    message="no tool of that name is offered; call tools/list",
                    retryable=False,
                ),
                None,
            )
        try:
            operation_id, derived = await self._operation_id(params, digest)
        except (RequestRefused, LedgerUnavailable) as error:
            return _error_result(_info(error), None)
        proposal = proposal.model_copy(update={"operation_id": operation_id})
        try:
            reply = await self._host.propose(proposal, self._settings.context)
        except (RequestRefused, LedgerUnavailable) as error:
            return _error_result(_info(error), operation_id)
        if reply.created and reply.decision is not None:
            outcome = reply.decision.outcome
            if outcome in (DecisionOutcome.REJECTED, DecisionOutcome.NEEDS_CLARIFICATION):
                return _rejection_result(reply.decision, operation_id)
        awaiting = reply.state in _NOT_YET_DECIDED
        return await self._answer(operation_id, digest, modern, awaiting=awaiting, derived=derived)

    async def _operation_id(
        self, params: types.CallToolRequestParams, digest: str | None
    ) -> tuple[str, bool]:
        """The call's operation ID, and whether it is derived (the same call made again
        finds it) rather than fresh."""
        meta = params.meta or {}
        key = meta.get(IDEMPOTENCY_KEY_META) if isinstance(meta, Mapping) else None
        if isinstance(key, str) and key:
            return self._ids.from_key(key), True
        if digest is None or not await self._writes(params.name):
            return new_operation_id(), False
        current, previous = self._ids.windowed(digest)
        if await self._exists(previous):
            return previous, True
        return current, True

    async def _exists(self, operation_id: str) -> bool:
        try:
            await self._host.status(operation_id)
        except RequestRefused as refused:
            if refused.code == "OPERATION_NOT_FOUND":
                return False
            raise
        return True

    async def _answer(
        self, operation_id: str, digest: str | None, modern: bool, *, awaiting: bool,
        derived: bool,
    ) -> types.CallToolResult | types.InputRequiredResult:
        """The outcome if it comes within this round; otherwise, for a client that
        knows MRTR, `input_required` with the operation sealed in `requestState`."""
        settings = self._settings
        if not modern:
            wait = min(settings.legacy_wait_s, settings.dedup_window_s / 2)
        else:
            wait = settings.approval_round_s if awaiting else settings.outcome_wait_s
        if self._waiting >= settings.max_waiting:
            wait = 0.0  # enough calls are held open already: answer this one at once
        self._waiting += 1
        try:
            status = await self._host.outcome(operation_id, timeout=wait)
        except OutcomeTimeout:
            status = None
        except (RequestRefused, LedgerUnavailable) as error:
            return _error_result(_info(error), operation_id)
        finally:
            self._waiting -= 1
        if status is not None:
            return _outcome_result(status, operation_id)
        if modern and digest is not None:
            return types.InputRequiredResult(
                request_state=self._seal.seal(operation_id, digest),
                meta={f"{OPLEDGER_META}operationId": operation_id,
                      f"{OPLEDGER_META}state": "awaiting_outcome"},
            )
        again = (
            "make the same call again to get its outcome"
            if derived
            else f"a call made again is a new operation (send `_meta[{IDEMPOTENCY_KEY_META!r}]`"
            " to make a call that can be asked again)"
        )
        return _error_result(
            ErrorInfo(
                code="OUTCOME_PENDING",
                category=ErrorCategory.TRANSIENT,
                message=f"the call is not settled yet (it may await approval); {again}",
                retryable=derived,
            ),
            operation_id,
        )


# ---------------------------------------------------------------------- results


def _info(error: RequestRefused | LedgerUnavailable) -> ErrorInfo:
    """What the ledger's refusal, or its silence, tells the client."""
    return error.info if isinstance(error, RequestRefused) else error.to_info()


def _text(value: Any) -> types.TextContent:
    return types.TextContent(text=json.dumps(value, sort_keys=True, default=str))


def _error_result(info: ErrorInfo, operation_id: str | None) -> types.CallToolResult:
    body: dict[str, Any] = {"error": info.model_dump(mode="json")}
    if operation_id is not None:
        body["operation_id"] = operation_id
    return types.CallToolResult(
        content=[_text(body)],
        is_error=True,
        meta={f"{OPLEDGER_META}operationId": operation_id} if operation_id else None,
    )


def _rejection_result(decision: Decision, operation_id: str) -> types.CallToolResult:
    """The check's findings, shaped for the model to repair its call (or ask the user)."""
    feedback = {
        "operation_id": operation_id,
        "decision": decision.outcome.value,
        "category": decision.category.value if decision.category else None,
        "repairable": decision.repairable,
        "issues": [
            issue.model_dump(mode="json", exclude_defaults=True) for issue in decision.issues
        ],
    }
    if decision.question:
        feedback["question"] = decision.question
    return types.CallToolResult(
        content=[_text(feedback)],
        is_error=True,
        meta={f"{OPLEDGER_META}operationId": operation_id},
    )


def _outcome_result(status: OperationStatus, operation_id: str) -> types.CallToolResult:
    """A final status as an MCP result: the output, or why there is none."""
    outcome = status.outcome or {}
    result = status.result
    meta: dict[str, Any] = {
        f"{OPLEDGER_META}operationId": operation_id,
        f"{OPLEDGER_META}state": status.state,
    }
    if outcome.get("status") == "succeeded" and result is not None and result.data is not None:
        meta[f"{OPLEDGER_META}trust"] = result.provenance.trust.value
        meta[f"{OPLEDGER_META}redactions"] = list(result.redactions)
        meta[f"{OPLEDGER_META}provenance"] = result.provenance.model_dump(mode="json")
        return types.CallToolResult(
            content=[_text(result.data)], structured_content=result.data, meta=meta
        )
    if result is not None and result.error is not None:
        info = result.error
    else:
        category = outcome.get("category") or ErrorCategory.POLICY_DENIED.value
        info = ErrorInfo(
            code=str(outcome.get("code") or status.state).upper(),
            category=ErrorCategory(category),
            message=f"the call ended {status.state}",
            retryable=False,
        )
    return _error_result(info, operation_id).model_copy(update={"meta": meta})
