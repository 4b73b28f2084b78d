"""The plan follower: which plans to move on, learned from the events the relay reads.

A plan moves when one of its steps' operations changes (a step succeeded: its
dependents are released; one failed: they are skipped) and when it starts or
is retried. The relay reads every event once, in order, so it tells the
follower (`observe`); the service then has the gateway `advance` the plans
marked. What the follower knows is only a shortcut: `advance` decides from the
stored state, and the service's sweep advances every running plan now and
then (`running`), which catches whatever a restart or a takeover of the relay
made the follower miss.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import orjson

from ledger._recent import Recent
from ledger.adapters.event_tables import StoredRow
from ledger.domain.plan import is_plan_id

__all__ = ["PlanFollower"]

_STEPS_KEPT = 20_000
"""Step operations whose plan the follower remembers (a forgotten one waits for the sweep)."""
_OPEN = frozenset({"PlanApprovalRequested", "PlanStarted", "PlanRetried", "StepReleased"})
_CLOSED = frozenset({"PlanSettled", "PlanRejected", "PlanDenied", "PlanExpired"})


class PlanFollower:
    """Marks plans to advance as their events and their steps' events go by."""

    def __init__(self) -> None:
        self._plan_of: Recent[str, str] = Recent(_STEPS_KEPT)
        self._marked: set[str] = set()
        self.running: set[str] = set()
        """Plans open as far as the events read so far say (running or awaiting approval)."""
        self.marked = asyncio.Event()
        """Set when a plan was marked; the service then advances the marked plans."""

    def know(self, plan_ids: Iterable[str]) -> None:
        """Plans found open in the store (when this instance takes the relay: at its
        start, or from another instance)."""
        self.running.update(plan_ids)
        self._mark(plan_ids)

    def observe(self, rows: Sequence[StoredRow]) -> None:
        """Learn from one batch of events the relay read."""
        for _, aggregate_id, _, topic, stored in rows:
            kind = topic.rsplit(".", 1)[-1]
            if is_plan_id(aggregate_id):
                if kind in _OPEN:
                    self.running.add(aggregate_id)
                elif kind in _CLOSED:
                    self.running.discard(aggregate_id)
                if kind in ("PlanStarted", "PlanRetried"):
                    self._mark((aggregate_id,))
                continue
            if kind == "Proposed":
                plan_id = _plan_named(stored)
                if plan_id is not None:
                    self._plan_of.remember(aggregate_id, plan_id)
                continue
            plan_id = self._plan_of.get(aggregate_id)
            if plan_id is not None:
                self._mark((plan_id,))

    def take_marked(self) -> list[str]:
        """The plans marked since the last call (each once), and clear the mark."""
        marked, self._marked = sorted(self._marked), set()
        self.marked.clear()
        return marked

    def _mark(self, plan_ids: Iterable[str]) -> None:
        before = len(self._marked)
        self._marked.update(plan_ids)
        if len(self._marked) != before:
            self.marked.set()


def _plan_named(stored: bytes) -> str | None:
    try:
        state = orjson.loads(stored)
    except orjson.JSONDecodeError:
        return None
    plan_id = state.get("plan") if isinstance(state, dict) else None
    return plan_id if isinstance(plan_id, str) else None
