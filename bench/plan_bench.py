"""A plan of 10 no-op steps end to end, beside 10 single operations, in the same run.

The stack is `bench/e2e_bench.py`'s (nats-server, the ledger service, one `noop`
executor, each its own process). Per round, from the first request to the last
outcome:

- `plan chain`: one plan of 10 steps, each depending on the one before (the steps
  run one after another: each waits for the ledger to see the previous one
  succeed and release it);
- `singles sequential`: 10 single operations, each proposed after the previous
  one's outcome came (what a host does without plans, to keep the order);
- `plan fan`: one plan of 10 independent steps (released together);
- `singles concurrent`: 10 single operations proposed at once.

It prints the median and p90 of each over `--rounds` rounds, and the plan's
overhead as a ratio to its single-operation counterpart. No timed assertions:
figures only.

    python bench/plan_bench.py [--rounds 20] [--storage sqlite|postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

# The e2e bench's stack, imported as the script next to this one (bench/ is on the path).
from e2e_bench import CONTEXT, HOST, TOOL, Settings, Stack

from ledger.client import AgentHostClient
from ledger.nats import connect_as
from schemas import PlanProposal, ToolProposal

STEPS = 10


def _plan(plan_id: str, chained: bool) -> PlanProposal:
    return PlanProposal.model_validate({
        "plan_id": plan_id,
        "conversation_id": "bench",
        "requested_by_user_id": "bench",
        "steps": [
            {"step": f"s{i}", "operation_id": f"{plan_id}-s{i}", "tool_name": TOOL,
             "arguments": {"n": i}, "depends_on": [f"s{i - 1}"] if chained and i else []}
            for i in range(STEPS)
        ],
    })


def _single(operation_id: str, n: int) -> ToolProposal:
    return ToolProposal(proposal_id=operation_id, conversation_id="bench",
                        requested_by_user_id="bench", tool_name=TOOL, operation_id=operation_id,
                        arguments={"n": n})


async def _plan_round(host: AgentHostClient, chained: bool) -> float:
    plan_id = f"plan-{uuid.uuid4().hex[:12]}"
    start = time.perf_counter()
    await host.propose_plan(_plan(plan_id, chained), CONTEXT)
    status = await host.plan_outcome(plan_id, timeout=120)
    assert status.state == "succeeded", status
    return time.perf_counter() - start


async def _singles_round(host: AgentHostClient, concurrent: bool) -> float:
    ids = [f"op-{uuid.uuid4().hex[:12]}" for _ in range(STEPS)]
    start = time.perf_counter()

    async def one(index: int, operation_id: str) -> None:
        await host.propose(_single(operation_id, index), CONTEXT)
        status = await host.outcome(operation_id, timeout=60)
        assert status.state == "succeeded", status

    if concurrent:
        await asyncio.gather(*(one(i, op) for i, op in enumerate(ids)))
    else:
        for index, operation_id in enumerate(ids):
            await one(index, operation_id)
    return time.perf_counter() - start


async def _run(args: argparse.Namespace, root: Path) -> None:
    (root / "stack").mkdir()
    stack = Stack(root / "stack", Settings(1, 16, "noop", "WARNING", False,
                                           storage=args.storage))
    await stack.start()
    try:
        assert stack.credentials is not None
        nc = await connect_as(stack.url, stack.credentials.host(HOST))
        host = AgentHostClient(nc, HOST, poll_interval=0.005)
        phases: dict[str, Callable[[], Awaitable[float]]] = {
            "plan chain": lambda: _plan_round(host, chained=True),
            "singles sequential": lambda: _singles_round(host, concurrent=False),
            "plan fan": lambda: _plan_round(host, chained=False),
            "singles concurrent": lambda: _singles_round(host, concurrent=True),
        }
        timings: dict[str, list[float]] = {name: [] for name in phases}
        for name, phase in phases.items():
            await phase()  # warm-up, not measured
            timings[name].clear()
        for _ in range(args.rounds):  # interleaved, so that drift hits every phase alike
            for name, phase in phases.items():
                timings[name].append(await phase())
        await nc.close()
    finally:
        stack.stop()
        stack.drop_storage()
    print(f"plan bench: {STEPS} no-op steps, {args.rounds} rounds, {args.storage},"
          " one executor x 16 in flight; ms from the first request to the last outcome")
    print(f"  {'phase':<20} {'median':>8} {'p90':>8}")
    medians = {}
    for name, values in timings.items():
        ordered = sorted(values)
        medians[name] = statistics.median(ordered) * 1000
        p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))] * 1000
        print(f"  {name:<20} {medians[name]:8.1f} {p90:8.1f}")
    print(f"  ratio plan chain / singles sequential: "
          f"{medians['plan chain'] / medians['singles sequential']:.2f}")
    print(f"  ratio plan fan / singles concurrent:   "
          f"{medians['plan fan'] / medians['singles concurrent']:.2f}")


def main() -> int:
    """Run the bench and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--storage", choices=["sqlite", "postgres"], default="sqlite")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="opledger-plan-bench-"))
    try:
        asyncio.run(_run(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
