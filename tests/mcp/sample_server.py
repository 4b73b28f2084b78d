"""A small MCP server built with the SDK, standing in for the tools people already run.

    python -m tests.mcp.sample_server [--http PORT]

Every side effect is one JSON line in the file `$SAMPLE_MCP_EFFECTS` (with the
idempotency key the caller sent in `_meta`, if any, and the server's process ID), so
a test counts what the server really did, and which server process did it.
`write_note` *claims* to be read-only (`readOnlyHint: true`): it is the server that
lies, and its contract must hold anyway.

`lookup_call` is the lookup an executor's `--lookup-tool` asks after a lost answer:
by idempotency key, `applied` with what the call returned, `unknown` while a call
with that key is still running (`append_log` notes its start in
`$SAMPLE_MCP_EFFECTS.started`), `not_applied` only for a key never seen.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, TypedDict

from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import ToolAnnotations

server = MCPServer("sample-notes", instructions="Notes and a log, for opledger's tests.")


class Note(TypedDict):
    """A note as stored."""

    key: str
    text: str


class Appended(TypedDict):
    """What `append_log` did."""

    line: str
    count: int


class Done(TypedDict):
    """A no-op's answer."""

    ok: bool


def _effects() -> Path:
    return Path(os.environ["SAMPLE_MCP_EFFECTS"])


def _record(
    tool: str, arguments: dict[str, Any], ctx: Context, result: dict[str, Any] | None = None
) -> int:
    meta = ctx.request_context.meta or {}
    line = {"tool": tool, "arguments": arguments, "key": meta.get("io.opledger/operationId"),
            "result": result, "pid": os.getpid()}
    with _effects().open("a", encoding="utf-8") as file:
        file.write(json.dumps(line) + "\n")
    return len(effects())


def effects() -> list[dict[str, Any]]:
    """Every side effect so far, oldest first."""
    path = _effects()
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def lookup_note(key: str) -> Note:
    """Read the note stored under a key (empty text when there is none)."""
    text = ""
    for effect in effects():
        if effect["tool"] == "write_note" and effect["arguments"]["key"] == key:
            text = effect["arguments"]["text"]
    return {"key": key, "text": text}


# The lie: this tool writes, and says it only reads.
@server.tool(annotations=ToolAnnotations(read_only_hint=True, destructive_hint=False))
def write_note(key: str, text: str, ctx: Context) -> Note:
    """Store a note under a key, replacing the one there."""
    _record("write_note", {"key": key, "text": text}, ctx)
    return {"key": key, "text": text}


class Lookup(TypedDict):
    """What became of a call, by its idempotency key."""

    status: str
    data: dict[str, Any]


def _started() -> Path:
    return _effects().with_name(_effects().name + ".started")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def lookup_call(operation_id: str, ctx: Context) -> Lookup:
    """What became of the call sent with this idempotency key."""
    sent_key = (ctx.request_context.meta or {}).get("io.opledger/operationId")
    with _effects().with_name(_effects().name + ".lookups").open("a", encoding="utf-8") as file:
        file.write(json.dumps({"operation_id": operation_id, "key": sent_key}) + "\n")
    for effect in reversed(effects()):
        if effect["key"] == operation_id and effect["tool"] == "append_log":
            return {"status": "applied", "data": effect["result"]}
    started = _started()
    if started.exists() and operation_id in started.read_text(encoding="utf-8").splitlines():
        return {"status": "unknown", "data": {}}  # still running: it may yet take effect
    return {"status": "not_applied", "data": {}}


@server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False))
def append_log(line: str, delay_ms: int, ctx: Context) -> Appended:
    """Append a line to the log, after waiting delay_ms (a slow provider)."""
    key = (ctx.request_context.meta or {}).get("io.opledger/operationId")
    if key:
        with _started().open("a", encoding="utf-8") as file:
            file.write(f"{key}\n")
    time.sleep(delay_ms / 1000)
    count = len(effects()) + 1
    _record("append_log", {"line": line, "delay_ms": delay_ms}, ctx,
            result={"line": line, "count": count})
    return {"line": line, "count": count}


@server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False))
def append_then_raise(line: str, code: int, ctx: Context) -> Appended:
    """Append a line, then fail with JSON-RPC error `code`, often one that means "refused"
    (invalid request, method not found): a tool may raise any error after its effect."""
    count = _record("append_then_raise", {"line": line}, ctx)
    raise MCPError(code, f"error {code} after appending line {count}")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def hang(seconds: float) -> Done:
    """Hold the server's event loop for `seconds` (a server that hangs): nothing else,
    not even `tools/list`, is answered meanwhile."""
    time.sleep(seconds)
    return {"ok": True}


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def noop() -> Done:
    """Do nothing, for timing the path to a tool."""
    return {"ok": True}


def _requiring_bearer(app: Any, token: str) -> Any:
    """`app`, answering 401 to any HTTP request without `Authorization: Bearer <token>`."""
    expected = f"Bearer {token}".encode()

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != expected:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await app(scope, receive, send)

    return guarded


def main() -> None:
    """Serve over stdio, or over Streamable HTTP with `--http PORT` (with `--token-env NAME`,
    only to requests bearing the token in that environment variable)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None)
    parser.add_argument("--token-env", default=None)
    args = parser.parse_args()
    if args.http is None:
        server.run("stdio")
    elif args.token_env is None:
        server.run("streamable-http", host="127.0.0.1", port=args.http, stateless_http=True)
    else:
        import uvicorn

        app = _requiring_bearer(
            server.streamable_http_app(stateless_http=True), os.environ[args.token_env]
        )
        uvicorn.run(app, host="127.0.0.1", port=args.http, log_level="warning")


if __name__ == "__main__":
    main()
