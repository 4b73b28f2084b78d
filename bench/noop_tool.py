"""The `noop` tool for `bench/e2e_bench.py`: answers `{"ok": True}` and does nothing else.

Two implementations of the same contract (`bench/contracts/noop.yaml`):

- `noop`: an `async` function, which the executor awaits on its event loop;
- `noop_sync`: a plain function, which the executor runs in a worker thread
  (`executors._process._invoke`), as it would a blocking provider call.

The difference between the two is the cost of that thread hop per operation.

    python -m executors run bench.noop_tool:noop --creds ... --nats-url ... --contracts DIR
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from executors import Tool, ToolContext, tool

__all__ = ["noop", "noop_sync"]

_OK: Mapping[str, Any] = {"ok": True}


@tool("noop", version="1.0.0")
async def noop(arguments: Mapping[str, Any], context: ToolContext) -> Mapping[str, Any]:  # noqa: ARG001 - the Tool signature
    """Do nothing, on the executor's event loop."""
    return dict(_OK)


def _run_sync(arguments: Mapping[str, Any], context: ToolContext) -> Mapping[str, Any]:  # noqa: ARG001 - the Tool signature
    return dict(_OK)


noop_sync: Tool = tool("noop", version="1.0.0")(_run_sync)
"""The same no-op as a plain function: the executor runs it in a worker thread."""
