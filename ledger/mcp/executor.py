"""`opledger executor mcp`: one tool of an existing MCP server, run as an opledger executor.

The MCP server stays as it is; this module wraps one of its tools in an
`executors.Tool` whose `run` is the server's `tools/call`. Everything else an
executor does comes from the ordinary runner, unchanged: its own NATS identity
(`exec_<tool>`), the lease and its fencing token, the contract's timeout (the
remaining time is the call's read timeout), output validation against the
contract's output schema, redaction, one result envelope per attempt.

The upstream's credentials live in this process only: a bearer token for an
HTTP server, or environment variables for a server it starts over stdio, both
read from the executor's own secrets (`--secrets`, `OPLEDGER_SECRET_*`).

The operation ID goes to the server as the idempotency key in the request's
`_meta` (`io.opledger/operationId`, and `idempotencyKey`): MCP has no standard
key, so a server deduplicates only if it reads one of these. Whether an attempt
whose answer was lost had its effect cannot be asked of an MCP server in
general: reconciliation says "unknown" (a person decides) unless a lookup tool
is named (`--lookup-tool`), which is called with `{"operation_id": ...}` and
answers `{"status": "applied" | "not_applied" | "unknown", "data": {...}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import urllib.parse
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx2
import mcp_types as types
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError

from executors import (
    Reconciliation,
    Tool,
    ToolContext,
    ToolError,
)
from ledger.mcp._errors import McpConfigError, UpstreamUnavailable
from ledger.mcp._sends import NOT_CONNECTED, SendLog, SendLoggingClient
from ledger.mcp._transport import WatchedTransport, as_transport
from policy import ToolContract
from schemas import ErrorCategory

__all__ = ["OPERATION_ID_META", "McpUpstream", "mcp_tool"]

_log = logging.getLogger("opledger.mcp.executor")

OPERATION_ID_META = "io.opledger/operationId"
"""The `_meta` key the operation ID is sent under (also as `idempotencyKey`)."""

_MESSAGE_MAX = 500
_OPLEDGER_ENV = "OPLEDGER_"
"""Every opledger setting, secrets (`SECRET_ENV_PREFIX`) included, starts so."""
_CONNECT_MARGIN_S = 0.05
"""Connecting gives up this long before the attempt's deadline, so that a server that
never answers is `UPSTREAM_UNAVAILABLE` (nothing sent), not a timeout of the call."""


@dataclass(frozen=True, slots=True)
class McpUpstream:
    """Where the MCP server is: a Streamable HTTP URL, or a command to start over stdio."""

    url: str | None = None
    command: tuple[str, ...] = ()
    bearer_secret: str | None = None
    """The executor secret holding a bearer token for the HTTP server."""
    env_secrets: Mapping[str, str] = field(default_factory=dict)
    """Environment variable of the stdio server → the executor secret that fills it."""

    def __post_init__(self) -> None:
        if (self.url is None) == (not self.command):
            raise McpConfigError("give the upstream as a URL or as a command, not both")
        if self.url is not None:
            parts = urllib.parse.urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise McpConfigError("the upstream URL must be an http(s) URL with a host")
            if parts.username is not None or parts.password is not None:
                # A command line is visible to every user of the machine (`ps`), and
                # the URL is logged: credentials go in the executor's secrets.
                raise McpConfigError(
                    "the upstream URL carries credentials; give them as --bearer-secret"
                )

    def describe(self) -> str:
        """Where the server is, for logs and drafts: no credentials, query or fragment."""
        if self.url is None:
            return os.path.basename(self.command[0])
        parts = urllib.parse.urlsplit(self.url)
        netloc = parts.hostname or ""
        if ":" in netloc:
            netloc = f"[{netloc}]"
        with contextlib.suppress(ValueError):
            if parts.port is not None:
                netloc = f"{netloc}:{parts.port}"
        return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))

    def client_target(self, secrets: Mapping[str, str], *, sends: SendLog | None = None) -> Any:
        """What `mcp.Client` connects to, with the credentials from `secrets` (over HTTP,
        its requests counted in `sends`, if given)."""
        if self.url is not None:
            headers: dict[str, str] = {}
            if self.bearer_secret is not None:
                headers["Authorization"] = f"Bearer {_secret(secrets, self.bearer_secret)}"
            # The SDK's own defaults: 30 s to connect or write, 300 s to read (a server
            # may hold a stream open); the call's deadline is enforced per request.
            timeout = httpx2.Timeout(30.0, read=300.0)
            http = (httpx2.AsyncClient(headers=headers, timeout=timeout) if sends is None
                    else SendLoggingClient(headers=headers, timeout=timeout, sends=sends))
            return _http_transport(self.url, http)
        # The child inherits this process's environment but none of its secrets nor of
        # its opledger settings (a database DSN, where the seeds are), and gets exactly
        # the secrets it is configured to have, by the names it expects.
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith(_OPLEDGER_ENV)}
        env.update({var: _secret(secrets, name) for var, name in self.env_secrets.items()})
        return StdioServerParameters(command=self.command[0], args=list(self.command[1:]), env=env)


@contextlib.asynccontextmanager
async def _http_transport(url: str, http: httpx2.AsyncClient) -> AsyncIterator[Any]:
    """The SDK's Streamable HTTP transport over `http`, closing `http` (its connections)
    when the session ends: the SDK leaves a client it was given open."""
    from mcp.client.streamable_http import streamable_http_client

    async with http, streamable_http_client(url, http_client=http) as streams:
        yield streams


def _secret(secrets: Mapping[str, str], name: str) -> str:
    try:
        return secrets[name.lower()]
    except KeyError:
        raise McpConfigError(f"secret {name.lower()!r} is not configured") from None


class _Connection:
    """One long-lived client session to the upstream, owned by a task of its own.

    The SDK's client is an async context (its task group must be entered and left
    by one task), while the runner calls the tool from many: the owner task holds
    the context open and the calls share the session. A broken session is
    dropped and the next call opens a new one; so is a session whose server's
    side ended while no call was on it (`WatchedTransport`), before a call is
    sent on it.
    """

    def __init__(self, upstream: McpUpstream) -> None:
        self._upstream = upstream
        self._client: Client | None = None
        self._stop: asyncio.Event | None = None
        self._owner: asyncio.Task[None] | None = None
        self._transport: WatchedTransport | None = None
        self._lock = asyncio.Lock()
        self._probe: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._scopes: dict[asyncio.Task[None], anyio.CancelScope] = {}
        self._shut = False
        self._calls: dict[asyncio.Task[None], int] = {}
        """Calls in flight per session (its owner task)."""
        self._idle_stops: dict[asyncio.Task[None], asyncio.Event] = {}
        """Sessions handed out no more that close once their last call is over."""
        self.sends = SendLog(OPERATION_ID_META) if upstream.url is not None else None
        """Over HTTP: which keyed calls' requests may have reached the server (`SendLog`)."""

    @property
    def owner(self) -> asyncio.Task[None] | None:
        """The task holding the session `client` last handed out (its end is the session's)."""
        return self._owner

    async def client(self, secrets: Mapping[str, str], timeout_s: float) -> Client:
        """The open session, or a new one within `timeout_s` (`UpstreamUnavailable`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self._turn(deadline):
            self._refuse_if_shut()
            if self._probe is not None and not self._probe.done():
                # A call was cut short on this session a moment ago: whether it still
                # answers decides whether this call may go to it.
                await asyncio.wait({self._probe}, timeout=max(deadline - loop.time(), 0))
                self._refuse_if_shut()  # closed meanwhile: open nothing `close` would miss
            if self._client is not None and self._owner is not None and not self._owner.done():
                if self._transport is None or not self._transport.ended:
                    return self._client
                # The server's side ended (a stdio server exited while idle): this call
                # was not sent on it, so a new session may take it. The old one closes
                # in the background, not on this call's time.
                self._retire()
            ready: asyncio.Future[Client] = loop.create_future()
            stop = self._stop = asyncio.Event()
            server = self._transport = WatchedTransport(
                as_transport(self._upstream.client_target(secrets, sends=self.sends)),
                on_end=lambda: self._ended(stop),
            )
            owner = self._owner = asyncio.create_task(self._own(server, ready, stop))
            try:
                async with asyncio.timeout_at(deadline):
                    client = await ready
            except BaseException as error:
                # Not connected in time (or the call was cancelled): the half-open
                # session, and a server process it started, must not outlive the call.
                stop.set()
                if not isinstance(error, Exception):
                    await self._halt(owner)  # the caller stops: wait, as `drop` does
                    raise
                # Not on this call's time: the SDK's shutdown of a server that does not
                # answer takes seconds, and the runner's deadline is only a margin away
                # (found in review: the call became a timeout, an unknown outcome).
                self._cancel(owner)
                self._keep_closing(owner)
                _log.warning("cannot reach the MCP server at %s: %s",
                             self._upstream.describe(), type(error).__name__)
                raise UpstreamUnavailable(
                    "the MCP server could not be reached", upstream=self._upstream.describe()
                ) from None
            self._client = client
            return client

    def _refuse_if_shut(self) -> None:
        """After `close` (the executor stops), a session opened would start a server
        process that nothing closes any more: the call fails, not sent, retryable."""
        if self._shut:
            raise UpstreamUnavailable(
                "the executor is stopping", upstream=self._upstream.describe()
            )

    @contextlib.asynccontextmanager
    async def _turn(self, deadline: float) -> AsyncIterator[None]:
        """A call's turn at the session (one call connects at a time), waited for until
        `deadline` (the loop's time): behind a connect that takes longer, a call gives
        up as not sent (`UpstreamUnavailable`). Waiting on, the runner's deadline cut it
        off instead: a timeout, an unknown outcome, for a call that sent nothing."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._lock.acquire()
        except TimeoutError:
            raise UpstreamUnavailable(
                "the MCP server could not be reached in time (another call was connecting)",
                upstream=self._upstream.describe(),
            ) from None
        try:
            yield
        finally:
            self._lock.release()

    async def _own(self, server: Any, ready: asyncio.Future[Client], stop: asyncio.Event) -> None:
        task = asyncio.current_task()
        scope = anyio.CancelScope()
        if task is not None:
            self._scopes[task] = scope  # what `_halt` cancels the session through
        try:
            with scope:
                async with Client(server, raise_exceptions=False, cache=None) as client:
                    if ready.done():
                        return  # the caller gave up meanwhile
                    ready.set_result(client)
                    await stop.wait()
            if not ready.done():
                ready.cancel()  # halted before the handshake finished
        except BaseException as error:  # the session ended: the next call reconnects
            if not ready.done():
                ready.set_exception(error if isinstance(error, Exception) else RuntimeError())
            elif not isinstance(error, asyncio.CancelledError):
                # Warned of already if its end was read (`_ended`); this says why.
                _log.log(logging.INFO if stop.is_set() else logging.WARNING,
                         "the MCP session to %s ended: %s",
                         self._upstream.describe(), type(error).__name__)
            if isinstance(error, asyncio.CancelledError):
                raise
        finally:
            if task is not None:
                self._scopes.pop(task, None)
            if task is self._owner:
                self._client = None

    def _ended(self, stop: asyncio.Event) -> None:
        """The session's read side ended: its owner closes it (and a server it started)."""
        if not stop.is_set():
            if self._client is not None:  # not a handshake that failed: that is logged there
                _log.warning("the MCP session to %s ended; the next call opens a new one",
                             self._upstream.describe())
            stop.set()

    async def _halt(self, owner: asyncio.Task[None]) -> None:
        """Cancel the session held by `owner` and wait (boundedly) until it has ended.

        Through the session's cancel scope, not `Task.cancel`: the SDK's shutdown is
        shielded and runs to its end, stopping a server process it started, where
        `Task.cancel` cuts it short and leaves that server running (found in review:
        a server that ignores its closed input lives on). Waited for even when the
        caller is being cancelled (an executor stopping), since a loop that ends next
        cancels what is left of the shutdown natively. `Task.cancel` only as the last
        resort, or before the task holds a scope (then it holds nothing yet).
        """
        # Kept among the closing sessions until it has ended, so that a halt cut short (a
        # second cancel of its caller) still leaves it to `close`.
        self._keep_closing(owner)
        self._cancel(owner)
        done, _ = await asyncio.wait({owner}, timeout=_HALT_S)
        if not done:
            owner.cancel()
            await asyncio.wait({owner}, timeout=_HALT_S)
        if owner.done() and not owner.cancelled():
            owner.exception()  # retrieved: the owner logged how its session ended

    def _cancel(self, owner: asyncio.Task[None]) -> None:
        """Cancel the session held by `owner` through its scope (`_halt`); the task itself
        before it holds one."""
        scope = self._scopes.get(owner)
        if scope is None:
            owner.cancel()
        else:
            scope.cancel()

    def _keep_closing(self, owner: asyncio.Task[None]) -> None:
        """Let the session held by `owner` close in the background."""
        if not owner.done():
            self._closing.add(owner)  # held: a task nobody holds may be collected
            owner.add_done_callback(self._closed)

    def _retire(self, *, when_idle: bool = False) -> asyncio.Task[None] | None:
        """Hand the current session out no more and let it close in the background (with
        `when_idle`, once its calls in flight are over); the task holding it (None: there
        was none)."""
        owner, stop = self._owner, self._stop
        self._client = None
        if owner is not None:
            self._keep_closing(owner)
        if stop is not None:
            if when_idle and owner is not None and self._calls.get(owner, 0):
                self._idle_stops[owner] = stop
            else:
                stop.set()
        return owner

    def _stop_if_retired(self, session: asyncio.Task[None]) -> None:
        """Close now a session that waited to be idle (`retire_when_idle`), if it did."""
        idle_stop = self._idle_stops.pop(session, None)
        if idle_stop is not None:
            idle_stop.set()

    def _closed(self, owner: asyncio.Task[None]) -> None:
        self._closing.discard(owner)
        if not owner.cancelled():
            owner.exception()  # retrieved: the owner logged how its session ended

    @contextlib.contextmanager
    def in_call(self, session: asyncio.Task[None] | None) -> Iterator[None]:
        """While a call is in flight on `session`: counted, so that a session retired
        when idle (`retire_when_idle`) closes once its last call is over."""
        if session is None:
            yield
            return
        self._calls[session] = self._calls.get(session, 0) + 1
        try:
            yield
        finally:
            left = self._calls[session] - 1
            if left:
                self._calls[session] = left
            else:
                del self._calls[session]
                self._stop_if_retired(session)

    def retire_when_idle(self, session: asyncio.Task[None] | None) -> None:
        """Hand `session` out no more, and close it once its calls in flight are over:
        one of its requests got no connection (a server draining for a restart refuses
        new ones while it answers those it holds), so the next call opens a new session,
        while the calls on this one get their answers."""
        if session is not None and session is self._owner:  # else replaced already
            self._retire(when_idle=True)  # among those closing: `close` still halts it

    def check_later(self, client: Client, session: asyncio.Task[None] | None) -> None:
        """A call on `session` was cut short (the runner's deadline) before the SDK's own
        timeout could tell: probe the session in the background and drop it if it no
        longer answers, so that a hung server does not take the next call too."""
        if session is None or session is not self._owner:
            return  # replaced already
        if self._probe is not None and not self._probe.done():
            return  # one probe answers for every call cut short meanwhile
        self._probe = asyncio.create_task(self._probe_session(client, session))

    async def _probe_session(self, client: Client, session: asyncio.Task[None]) -> None:
        answers = await _still_answers(client)
        if answers is None:
            self.retire_when_idle(session)  # no new connection: the calls in flight go on
            return
        if not answers:
            _log.warning("the MCP server at %s no longer answers; the next call opens a new"
                         " session", self._upstream.describe())
            await self.drop(session)

    async def close(self) -> None:
        """Close every session and wait until each has ended (the executor stops): the
        current one, those closing in the background, and one a probe would drop.

        Awaited by the runner as the tool's `close` (`executors.Tool.close`). Without
        it, the event loop's end cancelled what was still closing natively, which cuts
        the SDK's shutdown short and left a server process it started running (found in
        review: a server busy in a call cut off by the deadline survived its executor).
        """
        self._shut = True  # for good: no call opens a session after this
        probe = self._probe
        if probe is not None and not probe.done():
            probe.cancel()  # its answer no longer matters; a drop under way halts its session
        self._retire()
        await asyncio.gather(*(self._halt(task) for task in tuple(self._closing)))
        if probe is not None:
            await asyncio.wait({probe})  # its own halt is bounded as these are

    async def drop(self, session: asyncio.Task[None] | None = None) -> None:
        """Close the session held by `session` (default: the current one) and wait until
        it has ended; the next call opens a new one."""
        if session is not None and session is not self._owner:
            # Replaced already: whoever replaced it stopped it, or it waits to be idle
            # (then it is lost: it closes now); the current session, another call's, is
            # not this one to close.
            self._stop_if_retired(session)
            await asyncio.wait({session}, timeout=5)
            return
        owner = self._retire()  # among those closing too, should this wait be cut short
        if owner is None:
            return
        # Not `wait_for` under `suppress(CancelledError)`: that also swallowed a cancel
        # of the caller arriving meanwhile (an executor stopping), which then ran on.
        try:
            done, _ = await asyncio.wait({owner}, timeout=_HALT_S)
        except asyncio.CancelledError:
            await self._halt(owner)  # the caller stops: the session (and its server) too
            raise
        if not done:
            await self._halt(owner)  # it does not close: it must not outlive the session
        elif not owner.cancelled():
            owner.exception()  # retrieved: the owner logged how its session ended


def _first_text(result: types.CallToolResult) -> str:
    for block in result.content:
        if isinstance(block, types.TextContent):
            return block.text[:_MESSAGE_MAX]
    return "the MCP tool reported an error"


def _output(result: types.CallToolResult) -> dict[str, Any]:
    """The tool's output for the contract: its structured content, or else its text."""
    if isinstance(result.structured_content, dict):
        return dict(result.structured_content)
    texts = [block.text for block in result.content if isinstance(block, types.TextContent)]
    return {"text": "\n".join(texts)}


def _category(
    contract: ToolContract | None, result: types.CallToolResult
) -> tuple[str, ErrorCategory]:
    """The error's code and category: the contract's error model decides, when the server
    named a code it declares; any other tool error is the tool's own failure."""
    structured = result.structured_content
    code = structured.get("code") if isinstance(structured, dict) else None
    if isinstance(code, str) and contract is not None:
        category = contract.error_category(code)
        if category is not None:
            return code, category
    return "UPSTREAM_TOOL_ERROR", ErrorCategory.INTERNAL


_SESSION_LOST = frozenset({types.CONNECTION_CLOSED})
"""Errors after which the session is gone for certain."""

_HALT_S = 8.0
"""How long a session has to close. The SDK's own shutdown is bounded at 6.5 s for a
server process it started: 0.5 s to flush, 2 s to exit once its input is closed, 2 s
after SIGTERM to its process group, then SIGKILL and 2 s to reap it."""

_PROBE_S = 2.0
"""How long a session that failed a call has to answer `tools/list` before it is dropped."""


async def _still_answers(client: Client) -> bool | None:
    """Whether the session still answers a request: a hung server or an expired session
    does not, and is dropped. `tools/list`, which every server of tools answers, and not
    a ping: the 2026-07-28 revision removed ping. None: the probe got no connection (the
    server takes none now), which says nothing of the session's calls in flight."""
    try:
        with anyio.fail_after(_PROBE_S):
            await client.list_tools()
    except MCPError as error:
        return None if error.code == NOT_CONNECTED else False
    except Exception:  # a timeout, an MCPError, a closed stream: not answering
        return False
    return True


def _no_answer_reason(error: BaseException) -> str:
    if isinstance(error, MCPError):
        if error.code == types.REQUEST_TIMEOUT:
            return "timed out"
        if error.code == types.CONNECTION_CLOSED:
            return "connection closed"
        return f"error {error.code}"
    return type(error).__name__


def mcp_tool(
    name: str,
    upstream: McpUpstream,
    *,
    upstream_tool: str | None = None,
    version: str | None = None,
    contract: ToolContract | None = None,
    lookup_tool: str | None = None,
) -> Tool:
    """An executor `Tool` named `name` (its contract's name) that calls `upstream_tool`
    (default: the same name) on the MCP server `upstream`."""
    remote = upstream_tool or name
    connection = _Connection(upstream)
    secrets_needed = tuple(
        s.lower() for s in (upstream.bearer_secret, *upstream.env_secrets.values()) if s
    )

    async def call(
        tool_name: str, arguments: Mapping[str, Any], context: ToolContext, *, keyed: bool = True
    ) -> types.CallToolResult:
        client = await connection.client(
            context.secrets, max(context.seconds_left() - _CONNECT_MARGIN_S, 0.01)
        )
        session = connection.owner  # no await since `client`: the session just handed out
        timeout = max(context.seconds_left(), 0.05)
        meta: types.RequestParamsMeta | None = None
        if keyed:
            key = context.idempotency_key
            meta = types.RequestParamsMeta()
            meta[OPERATION_ID_META] = key  # type: ignore[literal-required]
            meta["idempotencyKey"] = key  # type: ignore[typeddict-unknown-key]
        sends = connection.sends if keyed else None
        with (sends.call(key) if sends is not None else contextlib.nullcontext() as reached,
              connection.in_call(session)):
            try:
                return await client.call_tool(
                    tool_name,
                    dict(arguments),
                    read_timeout_seconds=timeout,
                    meta=meta,
                )
            except asyncio.CancelledError:
                # The runner's deadline comes a moment before the SDK's read timeout, so
                # the check below never runs for a call that hangs: it runs later.
                connection.check_later(client, session)
                raise
            except MCPError as error:
                # No JSON-RPC error proves the tool did not run: a running tool may raise
                # any code after its effect (the SDK passes a handler's error through, and
                # raises `INVALID_REQUEST` itself when a tool asks its client something
                # over a transport that cannot carry it), and the client makes up
                # `INVALID_REQUEST` and `PARSE_ERROR` from a response it cannot read. With
                # the SDK's own read timeout (`REQUEST_TIMEOUT`) and a closed connection,
                # all are: sent, and no answer. (A tool's own failure is an `isError`
                # result, below.)
                no_answer: BaseException = error
                # A timeout or an error the server sent leaves the session open for the
                # calls in flight beside this one, unless it no longer answers at all (a
                # hung server, an expired session): then it goes, and the next call opens
                # anew.
                if error.code == NOT_CONNECTED:
                    # This request got no connection: the session keeps its calls in
                    # flight and takes no new one. Whether the call was sent is the
                    # count's to say, not this code's, which any server may send.
                    connection.retire_when_idle(session)
                    if reached is not None and not reached():
                        raise UpstreamUnavailable(
                            "the MCP server could not be reached", upstream=upstream.describe()
                        ) from None
                    session_lost = False
                elif error.code in _SESSION_LOST:
                    session_lost = True
                else:
                    answers = await _still_answers(client)
                    if answers is None:
                        # The probe got no connection: the server is draining,
                        # and the calls in flight on this session may still be answered.
                        connection.retire_when_idle(session)
                    session_lost = answers is False
            except (TimeoutError, anyio.ClosedResourceError, anyio.BrokenResourceError,
                    httpx2.HTTPError, OSError) as error:
                no_answer, session_lost = error, True
            if session_lost:
                await connection.drop(session)
                # With the session gone (its owner ended), no request of this call can
                # start any more: if none of them got a connection, nothing was sent.
                if (reached is not None and session is not None and session.done()
                        and not reached()):
                    raise UpstreamUnavailable(
                        "the MCP server could not be reached", upstream=upstream.describe()
                    )
        # Sent, but no answer: it may have happened.
        raise ToolError(
            ErrorCategory.TRANSIENT, "UPSTREAM_NO_ANSWER",
            f"the MCP server gave no answer ({_no_answer_reason(no_answer)})",
            outcome_unknown=True,
        )

    async def run(arguments: Mapping[str, Any], context: ToolContext) -> Mapping[str, Any]:
        try:
            result = await call(remote, arguments, context)
        except UpstreamUnavailable as unavailable:
            raise ToolError(
                ErrorCategory.TRANSIENT, unavailable.code, unavailable.message, retryable=True
            ) from None
        if result.is_error:
            code, category = _category(contract, result)
            raise ToolError(category, code, _first_text(result), retryable=False)
        return _output(result)

    async def reconcile(operation_id: str, context: ToolContext) -> Reconciliation:
        if lookup_tool is None:
            return Reconciliation.unknown(
                "an MCP server offers no lookup by idempotency key; a person decides"
            )
        try:
            # Not under the operation's own key: a server that deduplicates by key would
            # keep the lookup's answer under it, and hand it back to the call run again.
            result = await call(lookup_tool, {"operation_id": operation_id}, context,
                                keyed=False)
        except (ToolError, UpstreamUnavailable):
            return Reconciliation.unknown("the lookup tool did not answer")
        found = result.structured_content if isinstance(result.structured_content, dict) else {}
        status = found.get("status")
        if result.is_error or status not in ("applied", "not_applied"):
            return Reconciliation.unknown("the lookup tool could not tell")
        if status == "not_applied":
            return Reconciliation.not_applied("the MCP server's lookup has no such call")
        data = found.get("data")
        return Reconciliation.applied(data if isinstance(data, dict) else {})

    return Tool(
        name=name,
        run=run,
        version=version,
        reconcile=reconcile,
        close=connection.close,
        required_secrets=secrets_needed,
    )
