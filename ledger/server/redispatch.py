"""Redispatch: work items again for operations left waiting with nothing queued for them.

The relay publishes one work item per attempt, and JetStream keeps it until
an executor acknowledges it. If the work stream loses it anyway (a purged or
rebuilt stream, lost storage, a move to another server or account), nothing
would dispatch that attempt again, and the operation would stay ready for
good. So every sweep looks for operations ready for longer than `after`
whose tool's consumer has nothing waiting and nothing in flight, and
publishes their work item again. The same holds for an operation whose
outcome is unknown (or whose lookup's executor vanished): its lookup item can
be lost the same ways, or run out of deliveries while it waits for a long
backoff, and it gets a lookup item again.

While a tool's executors are down, its items wait in the stream: the
consumer is not empty, and nothing is republished. A copy that does go out
beside a live item is harmless: the lease answers it (`busy`, `done`), and
an attempt runs once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from ledger.server.relay.messages import dispatch_headers
from schemas import WORK_STREAM, Subjects, WorkItem, WorkPurpose, work_consumer, work_message_id

__all__ = ["Redispatcher", "WaitingSince"]

_log = logging.getLogger(__name__)

WaitingSince = Callable[[datetime], Sequence[tuple[str, str, str | None, int, str, str | None]]]
"""moment → the operations waiting for a work item and unchanged since before it: (ID,
tool, tool version, attempts, state, traceparent). The operations view answers it
(`OperationsProjector.waiting_since_before`)."""


class Redispatcher:
    """Publishes the work items of stranded ready operations again (see the module doc)."""

    def __init__(
        self,
        waiting_since_before: WaitingSince,
        js: JetStreamContext,
        *,
        after: timedelta,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if after <= timedelta(0):
            raise ValueError("after must be positive")
        self._waiting_since_before = waiting_since_before
        self._js = js
        self._after = after
        self._clock = clock

    async def sweep(self) -> list[str]:
        """Redispatch what is stranded now; the operation IDs it published again."""
        now = self._clock()
        stranded: dict[str, list[tuple[str, str | None, int, str, str | None]]] = {}
        waiting = self._waiting_since_before(now - self._after)
        for operation_id, tool, version, attempts, state, traced in waiting:
            stranded.setdefault(tool, []).append((operation_id, version, attempts, state, traced))
        # One ID per period: instances sweeping at once send one copy, not one each.
        period = int(now.timestamp() // self._after.total_seconds())
        published: list[str] = []
        for tool, operations in stranded.items():
            try:
                info = await self._js.consumer_info(WORK_STREAM, work_consumer(tool))
            except NotFoundError:
                continue  # a tool this deployment serves no executors for
            if info.num_pending or info.num_ack_pending:
                continue  # items are queued or in flight: executors are slow or down
            for operation_id, version, attempts, state, traced in operations:
                if version is None:
                    continue
                if state == "ready":
                    attempt = attempts + 1  # the attempt its next lease will be
                    item = WorkItem(
                        operation_id=operation_id,
                        tool=tool,
                        tool_version=version,
                        attempt=attempt,
                    )
                else:
                    # A lookup of the attempt whose outcome is unknown; the lease
                    # answers busy until it is due.
                    attempt = max(attempts, 1)
                    item = WorkItem(
                        operation_id=operation_id,
                        tool=tool,
                        tool_version=version,
                        attempt=attempt,
                        purpose=WorkPurpose.RECONCILE,
                    )
                # Not the relay's ID: that one may still be in the duplicate window.
                again = f"{work_message_id(operation_id, attempt)}:again-{state}-{period}"
                await self._js.publish(
                    Subjects.work(tool),
                    item.model_dump_json().encode(),
                    headers={**(dispatch_headers(item, traced) or {}), "Nats-Msg-Id": again},
                )
                published.append(operation_id)
        if published:
            _log.warning(
                "work items of %d ready operation(s) were missing; published again: %s",
                len(published),
                ", ".join(published[:10]),
            )
        return published
