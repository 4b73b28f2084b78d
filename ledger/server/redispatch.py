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
backoff, and it gets a lookup item again. And a call awaiting approval of a
tool whose contract asks for a preview gets its preview item again, once per
service instance: without the preview nobody can approve it. The view does not
say whether the preview came, so the copy goes out either way; if the preview
is there, the lease answers `done` and nothing else happens.

While a tool's executors are down, its items wait in the stream: the
consumer is not empty, and nothing is republished. A copy that does go out
beside a live item is harmless: the lease answers it (`busy`, `done`), and
an attempt runs once.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from ledger._recent import Recent
from ledger.server.relay.messages import dispatch_headers
from schemas import WORK_STREAM, Subjects, WorkItem, WorkPurpose, work_consumer

__all__ = ["Redispatcher", "WaitingSince"]

_log = logging.getLogger(__name__)

Waiting = Sequence[tuple[str, str, str | None, int, str, str | None]]
WaitingSince = Callable[[datetime], Waiting | Awaitable[Waiting]]
"""moment → the operations waiting for a work item and unchanged since before it: (ID,
tool, tool version, attempts, state, traceparent). The operations view answers it
(`OperationsProjector.waiting_since_before`, or off the event loop
`ledger.server.sweep_reads.SweepReads.waiting_since_before`)."""


class Redispatcher:
    """Publishes the work items of stranded ready operations again (see the module doc)."""

    def __init__(
        self,
        waiting_since_before: WaitingSince,
        js: JetStreamContext,
        *,
        after: timedelta,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        previewed: Callable[[str], bool] = lambda _tool: False,
    ) -> None:
        if after <= timedelta(0):
            raise ValueError("after must be positive")
        self._previewed = previewed
        """tool → whether its contract asks for a preview before approval."""
        self._previews_sent: Recent[str, bool] = Recent(100_000)
        """Calls whose preview item this instance sent again (once each is enough)."""
        self._waiting_since_before = waiting_since_before
        self._js = js
        self._after = after
        self._clock = clock

    async def sweep(self) -> list[str]:
        """Redispatch what is stranded now; the operation IDs it published again (work and
        lookup items, then preview items)."""
        now = self._clock()
        stranded: dict[str, list[tuple[str, str | None, int, str, str | None]]] = {}
        answer = self._waiting_since_before(now - self._after)
        waiting = await answer if inspect.isawaitable(answer) else answer
        for operation_id, tool, version, attempts, state, traced in waiting:
            if state == "awaiting_approval" and (
                not self._previewed(tool) or operation_id in self._previews_sent
            ):
                continue  # waits for people only, or its preview item went out again
            stranded.setdefault(tool, []).append((operation_id, version, attempts, state, traced))
        # One ID per period: instances sweeping at once send one copy, not one each.
        period = int(now.timestamp() // self._after.total_seconds())
        published: list[str] = []
        previews: list[str] = []
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
                    # The attempt its next lease will be.
                    attempt, purpose = attempts + 1, WorkPurpose.EXECUTE
                elif state == "awaiting_approval":
                    attempt, purpose = 1, WorkPurpose.PREVIEW
                    self._previews_sent.remember(operation_id, True)
                else:
                    # A lookup of the attempt whose outcome is unknown; the lease
                    # answers busy until it is due.
                    attempt, purpose = max(attempts, 1), WorkPurpose.RECONCILE
                item = WorkItem(
                    operation_id=operation_id,
                    tool=tool,
                    tool_version=version,
                    attempt=attempt,
                    purpose=purpose,
                )
                # Not the relay's ID: that one may still be in the duplicate window.
                again = f"{item.message_id}:again-{state}-{period}"
                await self._js.publish(
                    Subjects.work(tool),
                    item.model_dump_json().encode(),
                    headers={**(dispatch_headers(item, traced) or {}), "Nats-Msg-Id": again},
                )
                (previews if state == "awaiting_approval" else published).append(operation_id)
        if previews:
            _log.info(
                "preview items of %d call(s) awaiting approval sent again (a lost one is"
                " replaced; where the preview is there, the lease answers done): %s",
                len(previews),
                ", ".join(previews[:10]),
            )
        if published:
            _log.warning(
                "work items of %d waiting operation(s) were missing; published again: %s",
                len(published),
                ", ".join(published[:10]),
            )
        return [*published, *previews]
