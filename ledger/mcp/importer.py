"""`opledger tools import-mcp`: draft contracts from an MCP server's `tools/list`.

An MCP server declares what a model needs to *call* a tool (name, description,
input and output schema) and, at most, hints about its behaviour. It declares
nothing of what opledger decides *whether* a call may run by: the side-effect
level, risk rules, approval, idempotency, retries. A draft carries what the
server said and leaves those fields to an operator, marked `FILL IN`; the
registry refuses a draft (its `draft:` block, or any `FILL IN` left) until the
operator has completed it and deleted the `draft:` block.

The server's annotations (`readOnlyHint`, ...) are copied into the draft as
notes, never into a field: they are hints from the server about itself, and a
server that calls a tool read-only is still held to what its contract says.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mcp_types as types
import yaml

from ledger.mcp._errors import McpConfigError, UpstreamUnavailable
from ledger.mcp.executor import McpUpstream

__all__ = [
    "FILL_IN",
    "DraftContract",
    "contract_name",
    "draft_contract",
    "list_upstream_tools",
    "select",
    "server_hints",
    "write_drafts",
]

FILL_IN = "FILL IN"
"""What a field an operator must complete holds in a draft (invalid for the registry)."""

_TODO_FIELDS = (
    "description.use_when",
    "description.avoid_when",
    "effect",
    "required_capabilities",
    "approval",
    "risk",
    "idempotency",
    "retry",
    "timeout_ms",
)

_HINTS = {
    "read_only_hint": "readOnlyHint",
    "destructive_hint": "destructiveHint",
    "idempotent_hint": "idempotentHint",
    "open_world_hint": "openWorldHint",
}


@dataclass(frozen=True, slots=True)
class DraftContract:
    """One draft: the file name it is written to and the document in it."""

    name: str
    upstream_tool: str
    document: dict[str, Any]

    def render(self) -> str:
        """The draft as YAML, with a header saying what to do with it."""
        header = (
            f"# DRAFT contract for MCP tool {self.upstream_tool!r}, imported from its server.\n"
            f"# The server declares none of: {', '.join(_TODO_FIELDS)}.\n"
            f"# Replace every {FILL_IN!r}, then delete the `draft:` block; the registry\n"
            "# refuses this file until then. The server's hints below are not trusted.\n"
        )
        body = yaml.safe_dump(self.document, sort_keys=False, allow_unicode=True, width=96)
        return header + body


def server_hints(tool: types.Tool) -> dict[str, bool]:
    """The behaviour hints a server gave for `tool`, under their MCP names (only those set)."""
    annotations = tool.annotations
    if annotations is None:
        return {}
    hints = {}
    for attribute, wire in _HINTS.items():
        value = getattr(annotations, attribute)
        if value is not None:
            hints[wire] = bool(value)
    return hints


def contract_name(upstream_tool: str) -> str:
    """A contract name (`^[a-z][a-z0-9_]{1,63}$`) for an MCP tool name."""
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", upstream_tool).lower()
    snake = re.sub(r"[^a-z0-9]+", "_", snake).strip("_")
    if not snake or not snake[0].isalpha():
        snake = f"mcp_{snake}"
    return snake[:64].rstrip("_") if len(snake) > 1 else f"{snake}_tool"


def _object_schema(schema: dict[str, Any] | None) -> dict[str, Any]:
    document = dict(schema or {"type": "object"})
    document.setdefault("$schema", "https://json-schema.org/draft/2020-12/schema")
    return document


def draft_contract(tool: types.Tool, *, source: str) -> DraftContract:
    """The draft contract for one tool of the server at `source`."""
    name = contract_name(tool.name)
    summary = (tool.description or tool.title or tool.name).strip()
    if len(summary) < 10:
        summary = f"{summary} (from the MCP server; describe it)"
    document: dict[str, Any] = {
        "draft": {
            "source": source,
            "upstream_tool": tool.name,
            "server_hints": server_hints(tool),
            "complete": list(_TODO_FIELDS),
        },
        "name": name,
        "version": "0.1.0",
        "description": {"summary": summary, "use_when": FILL_IN, "avoid_when": FILL_IN},
        "input_schema": _object_schema(tool.input_schema),
        # An MCP tool without an output schema returns content blocks; the executor
        # hands them on as {"text": ...}, which this permissive schema accepts.
        "output_schema": _object_schema(tool.output_schema),
        "effect": f"{FILL_IN}: pure_read | external_read | reversible_write | irreversible_write",
        "required_capabilities": [FILL_IN],
        "approval": {"mode": f"{FILL_IN}: never | always | risk_at_least | two_person | forbidden"},
        "timeout_ms": FILL_IN,
        "retry": {"max_attempts": FILL_IN},
        "idempotency": {"required": FILL_IN},
        "risk": {"base": f"{FILL_IN}: low | moderate | high | critical", "rules": []},
    }
    return DraftContract(name=name, upstream_tool=tool.name, document=document)


def _distinct(drafts: Iterable[DraftContract]) -> list[DraftContract]:
    """`drafts`, unless two tools would be one contract name (one file)."""
    drafts = list(drafts)
    by_name: dict[str, list[str]] = {}
    for draft in drafts:
        by_name.setdefault(draft.name, []).append(draft.upstream_tool)
    clashes = {name: tools for name, tools in by_name.items() if len(tools) > 1}
    if clashes:
        raise McpConfigError(
            "tools of the server map to one contract name; import them one at a time with"
            " --tool and rename the drafts",
            clashes={name: sorted(tools) for name, tools in sorted(clashes.items())},
        )
    return drafts


def write_drafts(
    drafts: Iterable[DraftContract], directory: Path, *, overwrite: bool = False
) -> list[Path]:
    """Write each draft to `<directory>/<name>.yaml`; if any file exists, none is written
    unless `overwrite` (it may be a completed contract), nor when two drafts would be
    one file."""
    planned = [(directory / f"{draft.name}.yaml", draft) for draft in _distinct(drafts)]
    directory.mkdir(parents=True, exist_ok=True)
    existing = [path for path, _ in planned if path.exists()]
    if existing and not overwrite:
        raise McpConfigError(
            f"{existing[0]} exists; it may be a completed contract (use --overwrite to"
            " replace it)",
            path=str(existing[0]),
        )
    for path, draft in planned:
        path.write_text(draft.render(), encoding="utf-8")
    return [path for path, _ in planned]


def select(tools: Sequence[types.Tool], names: Sequence[str]) -> list[types.Tool]:
    """The tools named (all when none are); an unknown name is an error."""
    if not names:
        return list(tools)
    by_name = {tool.name: tool for tool in tools}
    missing = [name for name in names if name not in by_name]
    if missing:
        raise McpConfigError(
            f"the server has no tool {', '.join(sorted(missing))}", available=sorted(by_name)
        )
    return [by_name[name] for name in names]


async def list_upstream_tools(
    upstream: McpUpstream,
    *,
    names: Sequence[str] = (),
    out: Path,
    overwrite: bool = False,
    timeout_s: float = 60.0,
) -> list[Path]:
    """Ask the server at `upstream` for its tools and write a draft for each one named
    (every one when none is); the paths written. Credentials come from this process's
    `OPLEDGER_SECRET_*` variables, as an executor's would. A server that has not
    listed its tools within `timeout_s` is `UpstreamUnavailable`."""
    import anyio
    from mcp import Client
    from mcp.shared.exceptions import MCPError

    from executors import load_secrets

    tools: list[types.Tool] = []
    try:
        with anyio.fail_after(timeout_s):
            target = upstream.client_target(load_secrets(None))
            async with Client(target, cache=None) as client:
                cursor: str | None = None
                for _ in range(100):  # a paginator that never ends cannot hang the import
                    page = await client.list_tools(cursor=cursor)
                    tools.extend(page.tools)
                    cursor = page.next_cursor
                    if cursor is None:
                        break
    except (OSError, RuntimeError, MCPError, TimeoutError, ExceptionGroup) as error:
        raise UpstreamUnavailable(
            f"cannot list the tools of the MCP server ({type(error).__name__})",
            upstream=upstream.describe(),
        ) from None
    drafts = [draft_contract(tool, source=upstream.describe()) for tool in select(tools, names)]
    return write_drafts(drafts, out, overwrite=overwrite)
