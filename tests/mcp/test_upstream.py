"""`opledger executor mcp` against a real sample server over Streamable HTTP.

`--lookup-tool`: what the server's lookup says of a call whose answer was lost,
mapped to the executor's reconciliation; the server runs on after the executor
stops waiting for it, and the lookup answers by idempotency key, `unknown` while
the call still runs. `--bearer-secret`: the upstream's token, from the executor's
own secrets, and nowhere else."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp_types import INTERNAL_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR

from executors import ReconcileStatus, Reconciliation, Tool, ToolContext, ToolError
from ledger.mcp import McpConfigError, UpstreamUnavailable
from ledger.mcp._sends import NOT_CONNECTED
from ledger.mcp.executor import McpUpstream, mcp_tool
from tests.executors.helpers import context
from tests.mcp.conftest import _stop, alive, gone_within, start_sample_http_server
from tests.ports import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The sample server's URL, and the file where it records its effects."""
    home = tmp_path_factory.mktemp("lookup")
    effects = home / "effects.jsonl"
    server, url = start_sample_http_server(home, effects)
    try:
        yield url, effects
    finally:
        _stop(server)


async def _reconcile(tool: Tool, operation_id: str) -> Reconciliation:
    """The tool's reconciliation of `operation_id`, as the executor asks it."""
    assert tool.reconcile is not None
    answer = tool.reconcile(operation_id, context(operation_id))
    return answer if isinstance(answer, Reconciliation) else await answer


async def _run(tool: Tool, arguments: dict[str, Any], attempt: ToolContext) -> Any:
    """`tool`'s answer to `arguments` in `attempt`."""
    ran = tool.run(arguments, attempt)
    assert inspect.isawaitable(ran)  # the MCP tool is async
    return await ran


def _sent(effects: Path, key: str) -> list[dict[str, object]]:
    if not effects.exists():
        return []
    lines = [json.loads(line) for line in effects.read_text().splitlines() if line]
    return [line for line in lines if line["key"] == key]


async def test_a_lost_answer_is_unknown_while_it_runs_then_applied_once(
    upstream: tuple[str, Path],
) -> None:
    url, effects = upstream
    tool = mcp_tool("append_log", McpUpstream(url=url), lookup_tool="lookup_call")
    # The executor stops waiting after half a second; the server takes two.
    with pytest.raises(ToolError) as lost:
        await _run(tool, {"line": "slow", "delay_ms": 2000}, context("op-lost", seconds=0.5))
    assert lost.value.code == "UPSTREAM_NO_ANSWER" and lost.value.outcome_unknown
    # Asked at once, the call is still running: neither applied nor safe to retry.
    early = await _reconcile(tool, "op-lost")
    assert early.status is ReconcileStatus.UNKNOWN
    assert _sent(effects, "op-lost") == []
    for _ in range(50):
        if _sent(effects, "op-lost"):
            break
        await asyncio.sleep(0.1)
    late = await _reconcile(tool, "op-lost")
    assert late.status is ReconcileStatus.APPLIED
    (effect,) = _sent(effects, "op-lost")
    assert late.data is not None and late.data == effect["result"]
    assert late.data["line"] == "slow"


async def test_one_calls_lost_answer_leaves_the_others_in_flight_alone(
    upstream: tuple[str, Path],
) -> None:
    """A timeout is this call's: the session the calls share stays open, and a call
    beside it gets its answer."""
    url, effects = upstream
    tool = mcp_tool("append_log", McpUpstream(url=url))
    slow = asyncio.ensure_future(
        _run(tool, {"line": "beside", "delay_ms": 1500}, context("op-beside", seconds=10))
    )
    await asyncio.sleep(0.2)
    with pytest.raises(ToolError) as lost:
        await _run(tool, {"line": "cut", "delay_ms": 1500}, context("op-cut", seconds=0.5))
    assert lost.value.outcome_unknown
    assert (await slow)["line"] == "beside"
    assert len(_sent(effects, "op-beside")) == 1


@pytest.mark.parametrize(
    "code", [INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR, INTERNAL_ERROR, NOT_CONNECTED]
)
async def test_an_error_a_tool_raises_after_its_effect_is_an_unknown_outcome(
    upstream: tuple[str, Path], code: int
) -> None:
    """Codes that usually mean "refused", but a tool may raise any code after its effect:
    no JSON-RPC error is taken as "nothing ran". `NOT_CONNECTED` included, the code of
    the answer the executor makes up for a request that got no connection: a server
    sending it gains nothing, since the executor counts what it sent."""
    url, effects = upstream
    key = f"op-raised-{code}"
    tool = mcp_tool("append_then_raise", McpUpstream(url=url))
    with pytest.raises(ToolError) as failed:
        await _run(tool, {"line": "then an error", "code": code}, context(key))
    assert failed.value.code == "UPSTREAM_NO_ANSWER" and failed.value.outcome_unknown
    assert len(_sent(effects, key)) == 1


SAMPLE_OVER_STDIO = McpUpstream(
    command=(sys.executable, "-m", "tests.mcp.sample_server"),
    env_secrets={"SAMPLE_MCP_EFFECTS": "sample_effects"},
)
"""The sample server, started by the executor over stdio (its effects file a secret)."""


def _stdio_attempt(effects: Path, key: str, seconds: float = 20) -> ToolContext:
    """An attempt for `SAMPLE_OVER_STDIO`, its server recording effects in `effects`."""
    return context(key, secrets={"sample_effects": str(effects)}, seconds=seconds)


async def test_a_hung_server_is_started_anew_for_the_next_call(tmp_path: Path) -> None:
    """A stdio server whose loop hangs answers nothing, not even `tools/list`: the
    session is dropped (and the server with it), and the next call gets a fresh one at
    once."""
    tool = mcp_tool("hang", SAMPLE_OVER_STDIO)

    def attempt(key: str, seconds: float) -> ToolContext:
        return _stdio_attempt(tmp_path / "effects.jsonl", key, seconds)

    assert await _run(tool, {"seconds": 0}, attempt("op-warm", 20)) == {"ok": True}
    with pytest.raises(ToolError) as hung:
        await _run(tool, {"seconds": 60}, attempt("op-hung", 0.5))
    assert hung.value.outcome_unknown
    started = time.monotonic()
    assert await _run(tool, {"seconds": 0}, attempt("op-next", 20)) == {"ok": True}
    assert time.monotonic() - started < 15  # a new server, not the hung one after 60 s


async def test_a_hung_server_cut_off_by_the_runners_deadline_is_replaced_for_the_next_call(
    tmp_path: Path,
) -> None:
    """Found in review: the runner cancels a call at its deadline, a moment before the
    SDK's own read timeout, so the session was never asked whether it still answers, and
    the next call went to the same hung server and timed out too (an unknown outcome
    each). The call cut off now leaves that question behind, and the next call waits for
    its answer: a new server."""
    tool = mcp_tool("hang", SAMPLE_OVER_STDIO)

    def attempt(key: str) -> ToolContext:
        return _stdio_attempt(tmp_path / "e.jsonl", key, seconds=30)

    assert await _run(tool, {"seconds": 0}, attempt("op-warm")) == {"ok": True}
    # As the runner does: its own deadline, well before the context's (the SDK's).
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(_run(tool, {"seconds": 60}, attempt("op-hung")), timeout=1)
    answer = await asyncio.wait_for(_run(tool, {"seconds": 0}, attempt("op-next")), timeout=10)
    assert answer == {"ok": True}


def _running_children(module: str) -> set[int]:
    """This process's children, zombies aside, whose command line names `module`."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state_and_parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, UnicodeDecodeError):
            continue
        if (int(state_and_parent[1]) == os.getpid() and state_and_parent[0] != "Z"
                and module in command):
            found.add(int(entry.name))
    return found


async def test_an_executor_stopping_while_a_session_closes_leaves_no_server_behind(
    tmp_path: Path,
) -> None:
    """Found in review: a caller cancelled while `drop` waited for the session to close
    (an executor stopping) cancelled the session's task, which cut the SDK's shielded
    shutdown short: a server busy in a call, which does not see its input close, was
    left running. The session is now halted through its cancel scope, and the SDK's
    shutdown stops its server."""
    from ledger.mcp.executor import _Connection

    before = _running_children("tests.mcp.sample_server")
    connection = _Connection(SAMPLE_OVER_STDIO)
    client = await connection.client({"sample_effects": str(tmp_path / "e.jsonl")}, 20)
    [server] = _running_children("tests.mcp.sample_server") - before
    busy = asyncio.ensure_future(client.call_tool("hang", {"seconds": 60}))
    await asyncio.sleep(0.5)  # the server's loop is inside the call: it reads nothing now
    caller = asyncio.ensure_future(connection.drop())
    await asyncio.sleep(0.5)  # the shutdown has begun: input closed, waiting for an exit
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    with contextlib.suppress(Exception):
        await asyncio.wait_for(busy, timeout=5)
    assert await gone_within(15, server)


async def test_a_halt_cut_short_by_a_second_cancel_is_still_finished_by_close(
    tmp_path: Path,
) -> None:
    """A caller of `drop` cancelled twice (a second signal) cuts its wait for the session
    short; a new session may replace it meanwhile. `close` (the executor stops) must
    still wait for the old one: here a server that ignores SIGTERM, busy in a call, which
    only the SDK's SIGKILL ends. Before, the old session was no longer known, `close`
    returned at once, and the loop's end would have cut its shutdown short."""
    from ledger.mcp.executor import _Connection

    stubborn = McpUpstream(
        command=(sys.executable, "-c",
                 "import runpy, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                 " runpy.run_module('tests.mcp.sample_server', run_name='__main__')"),
        env_secrets={"SAMPLE_MCP_EFFECTS": "sample_effects"},
    )
    secrets = {"sample_effects": str(tmp_path / "e.jsonl")}
    before = _running_children("sample_server")
    connection = _Connection(stubborn)
    client = await connection.client(secrets, 20)
    [old] = _running_children("sample_server") - before
    busy = asyncio.ensure_future(client.call_tool("hang", {"seconds": 60}))
    await asyncio.sleep(0.5)  # the server's loop is inside the call: it reads nothing now
    caller = asyncio.ensure_future(connection.drop())
    await asyncio.sleep(0.3)
    caller.cancel()  # the first signal: `drop` halts the session and waits
    await asyncio.sleep(0.2)
    caller.cancel()  # the second: the wait is cut short
    with contextlib.suppress(asyncio.CancelledError):
        await caller
    try:
        await connection.client(secrets, 20)  # a new session replaces the old one
        assert alive(old)  # SIGTERM was ignored: only the SDK's SIGKILL ends it
        await connection.close()
        assert not alive(old)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old, signal.SIGKILL)  # never left behind, whatever failed
        with contextlib.suppress(BaseException):
            await busy


def test_an_executor_that_stops_after_a_call_was_cut_off_leaves_no_server_behind(
    tmp_path: Path,
) -> None:
    """Found in review: a call the runner cut off leaves its session closing in the
    background (a probe, then a drop). When the executor stopped during that close, the
    event loop's end cancelled it natively, which cuts the SDK's shutdown short: the
    server, busy in the call, was neither terminated nor waited for boundedly, and the
    executor's exit hung until the call ended. The runner now awaits the tool's `close`
    (`executors.Tool.close`, `tests/executors/test_runner.py`) before the loop ends."""
    before = _running_children("tests.mcp.sample_server")
    servers: set[int] = set()

    async def executor() -> None:
        tool = mcp_tool("hang", SAMPLE_OVER_STDIO)

        def attempt(key: str) -> ToolContext:
            return _stdio_attempt(tmp_path / "e.jsonl", key, seconds=30)

        assert await _run(tool, {"seconds": 0}, attempt("op-warm")) == {"ok": True}
        servers.update(_running_children("tests.mcp.sample_server") - before)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1):  # the runner's deadline
                await _run(tool, {"seconds": 60}, attempt("op-hung"))
        # The probe finds the server hung after 2 s and drops its session: the SDK
        # closes the server's input and gives it 2 s to exit before SIGTERM. The
        # executor stops in the middle of that: the runner closes the tool.
        await asyncio.sleep(3)
        assert tool.close is not None
        await tool.close()

    started = time.monotonic()
    asyncio.run(executor())  # a loop of its own, which ends as the executor's does
    # Without the close, the loop's end cancelled the shutdown under way, and the
    # executor's exit then waited for the server to end its 60 s call (62 s, checked).
    assert time.monotonic() - started < 30, "the executor waited for the server's call"
    assert len(servers) == 1
    assert asyncio.run(gone_within(10, *servers))


async def test_a_stdio_server_that_died_while_idle_is_started_anew_before_the_call(
    tmp_path: Path,
) -> None:
    """The attack: the server process is killed between two calls. The session's end
    is seen as it happens, so the next call goes to a new server, once, and is no
    unknown outcome: the call was never sent, and a person would have been asked to
    settle it. (Before the transport was watched, that call failed with
    `UPSTREAM_NO_ANSWER`, outcome unknown, and nothing recorded by any server.)"""
    effects = tmp_path / "effects.jsonl"
    tool = mcp_tool("append_log", SAMPLE_OVER_STDIO)

    def attempt(key: str) -> ToolContext:
        return _stdio_attempt(effects, key)

    first = await _run(tool, {"line": "before", "delay_ms": 0}, attempt("op-before"))
    assert first == {"line": "before", "count": 1}
    [before] = _sent(effects, "op-before")
    old_pid = before["pid"]
    assert isinstance(old_pid, int)
    os.kill(old_pid, signal.SIGKILL)
    assert await gone_within(10, old_pid)
    await asyncio.sleep(0.5)  # the executor idles: its loop reads the pipe's end meanwhile

    after = await _run(tool, {"line": "after", "delay_ms": 0}, attempt("op-after"))
    assert after == {"line": "after", "count": 2}
    [sent] = _sent(effects, "op-after")  # once, by a new server
    assert sent["pid"] != old_pid


async def test_a_call_to_an_http_server_that_is_down_is_unavailable_not_unknown(
    tmp_path: Path,
) -> None:
    """The server stops between two calls (a restart): the second call's request gets no
    connection, so it was not sent, and it is retryable, not an unknown outcome that a
    lookup or a person would have to settle. (Before the requests were counted, the SDK's
    closed session made it `UPSTREAM_NO_ANSWER`, outcome unknown.)"""
    effects = tmp_path / "effects.jsonl"
    server, url = start_sample_http_server(tmp_path, effects)
    tool = mcp_tool("append_log", McpUpstream(url=url))
    try:
        first = await _run(tool, {"line": "up", "delay_ms": 0}, context("op-up", seconds=20))
        assert first == {"line": "up", "count": 1}
    finally:
        _stop(server)
    with pytest.raises(ToolError) as down:
        await _run(tool, {"line": "down", "delay_ms": 0}, context("op-down", seconds=20))
    assert down.value.code == "UPSTREAM_UNAVAILABLE"
    assert down.value.retryable and not down.value.outcome_unknown
    assert _sent(effects, "op-down") == []


async def test_a_call_whose_http_server_dies_while_it_runs_stays_unknown(
    tmp_path: Path,
) -> None:
    """The other side of the same line: the request got its connection and the server
    started the call, then died before answering. It may have had its effect (here it
    had not yet: the sample server sleeps first), and nothing proves otherwise: unknown."""
    effects = tmp_path / "effects.jsonl"
    server, url = start_sample_http_server(tmp_path, effects)
    tool = mcp_tool("append_log", McpUpstream(url=url))
    started = effects.with_name(effects.name + ".started")
    try:
        await _run(tool, {"line": "warm", "delay_ms": 0}, context("op-warm", seconds=20))
        call = asyncio.ensure_future(
            _run(tool, {"line": "slow", "delay_ms": 5000}, context("op-slow", seconds=20))
        )
        deadline = time.monotonic() + 10
        while "op-slow" not in (started.read_text() if started.exists() else ""):
            assert time.monotonic() < deadline and not call.done()
            await asyncio.sleep(0.05)
        server.kill()
        server.wait(timeout=10)
        with pytest.raises(ToolError) as lost:
            await call
    finally:
        _stop(server)
    assert lost.value.code == "UPSTREAM_NO_ANSWER" and lost.value.outcome_unknown


async def test_a_call_whose_stdio_server_dies_while_it_runs_stays_unknown(
    tmp_path: Path,
) -> None:
    """Over stdio nothing counts requests (no HTTP client carries them), so a call whose
    server dies under it stays unknown, whatever the session's end looks like."""
    effects = tmp_path / "effects.jsonl"
    tool = mcp_tool("append_log", SAMPLE_OVER_STDIO)

    def attempt(key: str) -> ToolContext:
        return _stdio_attempt(effects, key)

    await _run(tool, {"line": "warm", "delay_ms": 0}, attempt("op-warm"))
    [warm] = _sent(effects, "op-warm")
    pid = warm["pid"]
    assert isinstance(pid, int)
    started = effects.with_name(effects.name + ".started")
    call = asyncio.ensure_future(_run(tool, {"line": "slow", "delay_ms": 5000}, attempt("op-slow")))
    deadline = time.monotonic() + 10
    while "op-slow" not in (started.read_text() if started.exists() else ""):
        assert time.monotonic() < deadline and not call.done()
        await asyncio.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ToolError) as lost:
        await call
    assert lost.value.code == "UPSTREAM_NO_ANSWER" and lost.value.outcome_unknown


def _established_to(port: int) -> int:
    """TCP connections on this machine established to `port` (IPv4 loopback), any side."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote_port = int(fields[2].split(":")[1], 16)
        if remote_port == port and fields[3] == "01":
            count += 1
    return count


async def test_an_http_session_closes_its_connections_when_it_ends(tmp_path: Path) -> None:
    """Found in review: the SDK leaves an HTTP client it was given open, so every session
    that ended (a restart of the server, a hung one dropped) kept its keep-alive
    connection until garbage collection. Sessions now close their client."""
    server, url = start_sample_http_server(tmp_path, tmp_path / "effects.jsonl")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        for _ in range(3):
            async with Client(McpUpstream(url=url).client_target({})) as client:
                await client.list_tools()
                assert _established_to(port) >= 1  # kept alive while the session lasts
        # Well within the server's own keep-alive timeout (uvicorn's: 5 s), which would
        # otherwise close them in the end.
        deadline = time.monotonic() + 1
        while _established_to(port) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert _established_to(port) == 0
    finally:
        _stop(server)


async def test_the_lookup_is_not_sent_under_the_operations_key(
    upstream: tuple[str, Path],
) -> None:
    """A server that deduplicates by key would keep the lookup's answer under the
    operation's key and hand it to the call run again after `not_applied`."""
    url, effects = upstream
    tool = mcp_tool("append_log", McpUpstream(url=url), lookup_tool="lookup_call")
    await _reconcile(tool, "op-looked-up")
    lookups = effects.with_name(effects.name + ".lookups").read_text().splitlines()
    asked = [json.loads(line) for line in lookups if "op-looked-up" in line]
    assert asked == [{"operation_id": "op-looked-up", "key": None}]


async def test_a_call_never_sent_is_not_applied(upstream: tuple[str, Path]) -> None:
    url, _ = upstream
    tool = mcp_tool("append_log", McpUpstream(url=url), lookup_tool="lookup_call")
    answer = await _reconcile(tool, "op-never")
    assert answer.status is ReconcileStatus.NOT_APPLIED


async def test_without_a_lookup_or_with_one_that_fails_a_person_decides(
    upstream: tuple[str, Path],
) -> None:
    url, _ = upstream
    for lookup in (None, "no_such_tool"):
        tool = mcp_tool("append_log", McpUpstream(url=url), lookup_tool=lookup)
        answer = await _reconcile(tool, "op-x")
        assert answer.status is ReconcileStatus.UNKNOWN, lookup


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A sample server that answers only requests bearing its token: URL, token."""
    home = tmp_path_factory.mktemp("bearer")
    token = secrets.token_urlsafe(24)
    server, url = start_sample_http_server(
        home, home / "effects.jsonl", "--token-env", "SAMPLE_TOKEN", env={"SAMPLE_TOKEN": token}
    )
    try:
        yield url, token
    finally:
        _stop(server)


async def _call_noop(tool: Tool, secret: dict[str, str]) -> Any:
    return await _run(tool, {}, context("op-bearer", secrets=secret))


async def test_an_http_upstream_gets_the_bearer_token_from_the_executors_secrets(
    guarded: tuple[str, str],
) -> None:
    url, token = guarded
    upstream = McpUpstream(url=url, bearer_secret="NOTES_TOKEN")
    # The token is the executor's secret, by its name (case-insensitive).
    assert await _call_noop(mcp_tool("noop", upstream), {"notes_token": token}) == {"ok": True}
    # Another token: the server turns the session away before any call is sent.
    with pytest.raises(ToolError) as refused:
        await _call_noop(mcp_tool("noop", upstream), {"notes_token": "not-" + token})
    assert refused.value.code == "UPSTREAM_UNAVAILABLE" and refused.value.retryable
    assert not refused.value.outcome_unknown
    assert token not in str(refused.value) and token not in upstream.describe()
    # No secret of that name: a configuration error naming the secret, not its value.
    with pytest.raises(McpConfigError, match="notes_token"):
        await _call_noop(mcp_tool("noop", upstream), {})
    # A token in the URL is refused outright: command lines and logs show URLs.
    with pytest.raises(McpConfigError, match="credentials"):
        McpUpstream(url=url.replace("http://", f"http://x:{token}@"))


async def test_a_call_after_close_starts_no_server_and_is_not_sent(tmp_path: Path) -> None:
    """Once closed (the executor stops), the connection opens no session: a call then is
    `UPSTREAM_UNAVAILABLE` (nothing sent, retryable), and no server process is started
    that nothing would close any more. Before, it opened a new session."""
    from ledger.mcp.executor import _Connection

    before = _running_children("tests.mcp.sample_server")
    connection = _Connection(SAMPLE_OVER_STDIO)
    secrets = {"sample_effects": str(tmp_path / "e.jsonl")}
    await connection.client(secrets, 20)
    [server] = _running_children("tests.mcp.sample_server") - before
    await connection.close()
    assert await gone_within(15, server)
    with pytest.raises(UpstreamUnavailable) as refused:
        await connection.client(secrets, 20)
    assert refused.value.code == "UPSTREAM_UNAVAILABLE" and refused.value.retryable
    assert _running_children("tests.mcp.sample_server") - before == set()


class _Gate:
    """A TCP forwarder in front of a server that can stop taking new connections while
    those it holds carry on: a server draining for a restart, or one whose backlog is
    full, as a client sees them (a connect refused, its other requests answered)."""

    def __init__(self, target: int) -> None:
        self.port = free_port()
        self._target = target
        self._listener: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        self._listener = await asyncio.start_server(self._forward, "127.0.0.1", self.port)

    async def shut(self) -> None:
        """Refuse new connections (the listening socket is closed); open ones go on."""
        assert self._listener is not None
        self._listener.close()
        self._listener = None

    async def close(self) -> None:
        if self._listener is not None:
            await self.shut()
        for pipe in self._pipes:
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except OSError:
                pass
            finally:
                sink.close()

        for task in (asyncio.ensure_future(pipe(reader, up_writer)),
                     asyncio.ensure_future(pipe(up_reader, writer))):
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)


async def test_a_call_that_gets_no_connection_leaves_the_calls_in_flight_alone(
    tmp_path: Path,
) -> None:
    """The server stops taking connections while a call runs on one it holds (a server
    draining for a rolling restart). The next call's request gets no connection: it is
    `UPSTREAM_UNAVAILABLE`, retryable, and the call in flight still gets its answer.
    Before, the SDK ended the whole session on that one connection error, and the call
    in flight, answered or not, became `UPSTREAM_NO_ANSWER`: an unknown outcome, for a
    lookup or a person. The session then takes no new call: once it is idle it closes,
    and the call after the server is back opens a new one."""
    async with _draining(tmp_path) as (gate, tool, effects):
        slow = await _in_flight(tool, effects, "op-slow", 2000)
        await gate.shut()
        with pytest.raises(ToolError) as refused:
            await _run(tool, {"line": "refused", "delay_ms": 0},
                       context("op-refused", seconds=20))
        assert refused.value.code == "UPSTREAM_UNAVAILABLE"
        assert refused.value.retryable and not refused.value.outcome_unknown
        assert await slow == {"line": "op-slow", "count": 2}
        assert _sent(effects, "op-refused") == []
        await gate.open()  # back
        after = await _run(tool, {"line": "after", "delay_ms": 0},
                           context("op-after", seconds=20))
        assert after == {"line": "after", "count": 3}


@contextlib.asynccontextmanager
async def _draining(
    tmp_path: Path, *, lookup_tool: str | None = None
) -> AsyncIterator[tuple[_Gate, Tool, Path]]:
    """The sample server over HTTP behind a gate, and a tool warmed up on it (closed,
    with the gate and the server, at the end)."""
    effects = tmp_path / "effects.jsonl"
    server, url = start_sample_http_server(tmp_path, effects)
    gate = _Gate(int(url.rsplit(":", 1)[1].split("/")[0]))
    tool = mcp_tool("append_log", McpUpstream(url=f"http://127.0.0.1:{gate.port}/mcp"),
                    lookup_tool=lookup_tool)
    try:
        await gate.open()
        await _run(tool, {"line": "warm", "delay_ms": 0}, context("op-warm", seconds=20))
        yield gate, tool, effects
    finally:
        await gate.close()
        _stop(server)
        if tool.close is not None:
            await tool.close()


async def _in_flight(tool: Tool, effects: Path, key: str, delay_ms: int) -> asyncio.Future[Any]:
    """A call of `delay_ms` that the server has started."""
    started = effects.with_name(effects.name + ".started")
    call = asyncio.ensure_future(
        _run(tool, {"line": key, "delay_ms": delay_ms}, context(key, seconds=20))
    )
    deadline = time.monotonic() + 10
    while key not in (started.read_text() if started.exists() else ""):
        assert time.monotonic() < deadline and not call.done()
        await asyncio.sleep(0.05)
    return call


async def _behind(tool: Tool, key: str, *, seconds: float) -> asyncio.Future[Any]:
    """A call of 3 s within `seconds`, sent while another is in flight: once it returns,
    its request has its connection, and waits behind the other's."""
    call = asyncio.ensure_future(
        _run(tool, {"line": key, "delay_ms": 3000}, context(key, seconds=seconds))
    )
    await asyncio.sleep(0.3)
    return call


async def test_a_lookup_that_gets_no_connection_leaves_the_calls_in_flight_alone(
    tmp_path: Path,
) -> None:
    """Found in review: a lookup (sent without a key, so not counted as a call) that got
    no connection during a drain took the path of an error the server sent: the probe
    that followed got no connection either, the session was dropped, and the call in
    flight on it became an unknown outcome. A probe without a connection now says
    nothing of the session: it only takes no new call."""
    async with _draining(tmp_path, lookup_tool="lookup_call") as (gate, tool, effects):
        slow = await _in_flight(tool, effects, "op-slow", 2000)
        await gate.shut()
        looked_up = await _reconcile(tool, "op-other")
        assert looked_up.status is ReconcileStatus.UNKNOWN  # the lookup did not answer
        assert await slow == {"line": "op-slow", "count": 2}


async def test_a_cancel_that_gets_no_connection_leaves_the_calls_in_flight_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: against a server of an older revision the SDK sends a call cut
    off by the runner's deadline a `notifications/cancelled` POST. During a drain it got
    no connection, the client raised, and the SDK ended the session: the call in flight
    beside it became an unknown outcome. A cancel that cannot be delivered is now taken
    as sent (it is a courtesy)."""
    import functools

    import mcp

    import ledger.mcp.executor

    monkeypatch.setattr(ledger.mcp.executor, "Client",
                        functools.partial(mcp.Client, mode="legacy"))
    async with _draining(tmp_path) as (gate, tool, effects):
        slow = await _in_flight(tool, effects, "op-slow", 3000)
        cut = await _behind(tool, "op-cut", seconds=20)
        await gate.shut()
        await asyncio.sleep(0.2)
        cut.cancel()  # the runner's deadline: the SDK posts its cancel, refused
        with pytest.raises(asyncio.CancelledError):
            await cut
        assert await slow == {"line": "op-slow", "count": 2}


async def test_a_refused_connect_at_session_open_does_not_downgrade_the_protocol(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the SDK falls back to the older handshake on any JSON-RPC error
    from `server/discover`. Answered with one, a single refused connect at session open
    gave a session of the older revision for its whole life. The handshake's connection
    errors are raised as before: that session does not open (`UPSTREAM_UNAVAILABLE`),
    and the next one negotiates the current revision."""
    import httpx2

    from ledger.mcp.executor import _Connection

    server, url = start_sample_http_server(tmp_path, tmp_path / "effects.jsonl")
    refusals = [1]
    real_send = httpx2.AsyncClient.send

    async def refusing(self: Any, request: Any, **options: Any) -> Any:
        if refusals[0] and request.method == "POST":
            refusals[0] -= 1
            raise httpx2.ConnectError("[Errno 111] Connection refused")
        return await real_send(self, request, **options)

    monkeypatch.setattr(httpx2.AsyncClient, "send", refusing)
    connection = _Connection(McpUpstream(url=url))
    try:
        with pytest.raises(UpstreamUnavailable):
            await connection.client({}, 20)
        client = await connection.client({}, 20)
        assert client.protocol_version == "2026-07-28"
    finally:
        await connection.close()
        _stop(server)


async def test_a_call_waiting_for_a_probe_as_the_tool_closes_opens_no_session(
    tmp_path: Path,
) -> None:
    """Found in review: a call waiting for a probe's answer inside `client()` when the
    tool closed then opened a new session, and a server process nothing closes."""
    before = _running_children("tests.mcp.sample_server")
    tool = mcp_tool("hang", SAMPLE_OVER_STDIO)
    effects = tmp_path / "e.jsonl"
    assert await _run(tool, {"seconds": 0}, _stdio_attempt(effects, "op-warm", 30)) == {
        "ok": True
    }
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):  # the runner's deadline: the probe starts
                await _run(tool, {"seconds": 3}, _stdio_attempt(effects, "op-hung", 30))
        waiting = asyncio.ensure_future(
            _run(tool, {"seconds": 0}, _stdio_attempt(effects, "op-next", 30))
        )
        await asyncio.sleep(0.2)  # inside `client()`, waiting for the probe
        assert tool.close is not None
        await tool.close()
        with pytest.raises(ToolError) as stopping:
            await waiting
        assert stopping.value.code == "UPSTREAM_UNAVAILABLE"
        await asyncio.sleep(0.5)
        assert _running_children("tests.mcp.sample_server") - before == set()
    finally:
        for pid in _running_children("tests.mcp.sample_server") - before:
            os.kill(pid, signal.SIGKILL)


async def test_a_timeout_whose_probe_gets_no_connection_leaves_the_calls_in_flight_alone(
    tmp_path: Path,
) -> None:
    """A call whose answer does not come in time (the SDK's own timeout) is followed by a
    probe of its session. During a drain the probe gets no connection, which says nothing
    of the session: it is retired, not dropped, and the call in flight beside it gets its
    answer. The call that timed out stays unknown: it was sent."""
    async with _draining(tmp_path) as (gate, tool, effects):
        slow = await _in_flight(tool, effects, "op-slow", 3000)
        late = await _behind(tool, "op-late", seconds=1.2)
        await gate.shut()
        with pytest.raises(ToolError) as timed_out:
            await late
        assert timed_out.value.code == "UPSTREAM_NO_ANSWER" and timed_out.value.outcome_unknown
        assert await slow == {"line": "op-slow", "count": 2}
