"""The operator's console: `opledger status` and `opledger ops watch`.

`status` answers "is it working, and does anything need me?" in one screen:
the embedded stack's processes (when one runs from the home), the work in each
state with what needs a person (approvals, unknown outcomes, `needs_resolution`),
how far the relay is behind the newest event, what it set aside, and, when the
ledger identity's seed is at hand, each consumer's backlog on NATS. `ops watch`
follows the events as they are stored, one line each.

Both only read: the database read-only, NATS as the ledger identity, which may
read stream and consumer state (no other identity may).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eventsourcing.persistence import StoredEvent

from ledger.config import Settings
from ledger.domain.event_kinds import EVENT_KINDS, when_text
from ledger.domain.states import OperationState
from ledger.server.relay import read_set_aside
from ledger.service import Ledger

__all__ = ["EventLines", "render_status", "status_view", "watch"]

S = OperationState

NEEDS_A_PERSON = (
    S.AWAITING_APPROVAL.value,
    S.OUTCOME_UNKNOWN.value,
    S.NEEDS_RESOLUTION.value,
)
"""States in which nothing moves until a person (or a lookup) acts."""


def status_view(ledger: Ledger, settings: Settings) -> dict[str, Any]:
    """Everything `opledger status` shows, JSON-able."""
    counts: dict[str, int] = {}
    for state, count in ledger.db.query(
        "SELECT state, COUNT(*) FROM opledger_operations GROUP BY state"
    ):
        counts[str(state)] = int(count)
    # What the view has not taken in yet counts as it is now (no service may be
    # projecting): an operation the view holds at an older state moves, not doubles.
    pending = ledger.projector.unprojected()
    for _, state in ledger.db.query_in(
        "SELECT operation_id, state FROM opledger_operations WHERE operation_id IN ({marks})",
        list(pending),
    ):
        counts[str(state)] -= 1
    for row in pending.values():
        counts[row["state"]] = counts.get(row["state"], 0) + 1
    counts = {state: n for state, n in counts.items() if n}
    last = ledger.event_reader.last_position()
    relay = _relay_position(ledger)
    set_aside = read_set_aside(ledger.db)
    return {
        "home": str(Path(settings.home).resolve()),
        "database": settings.storage().describe(),
        "operations": dict(sorted(counts.items())),
        "needs_a_person": {state: counts.get(state, 0) for state in NEEDS_A_PERSON},
        "events": last,
        "relay": {"position": relay, "behind": None if relay is None else max(0, last - relay)},
        "set_aside": [
            {"operation_id": op, "version": version, "reason": reason}
            for (op, version), reason in sorted(set_aside.items())
        ],
        "stack": _stack_view(Path(settings.home)),
        "consumers": _consumers(settings),
    }


def _relay_position(ledger: Ledger) -> int | None:
    if "opledger_relay" not in ledger.db.tables():
        return None
    rows = ledger.db.query("SELECT MAX(position) FROM opledger_relay")
    return int(rows[0][0]) if rows and rows[0][0] is not None else None


def _stack_view(home: Path) -> dict[str, Any] | None:
    from ledger.embedded import process_alive, running_stack

    info = running_stack(home)
    if info is None:
        return None
    return {
        "nats_url": info.nats_url,
        "supervisor_pid": info.supervisor_pid,
        "processes": {
            name: {"pid": pid, "alive": process_alive(pid)} for name, pid in info.pids.items()
        },
        "logs": dict(info.logs),
    }


def _consumers(settings: Settings) -> dict[str, Any] | None:
    """Each consumer's backlog, read as the ledger identity; None without its seed."""
    from ledger.embedded import running_stack

    stack = running_stack(Path(settings.home))
    url = settings.nats_url or (stack.nats_url if stack else None)
    seed = Path(settings.creds_dir or Path(settings.home) / "creds") / "ledger-ledger.nk"
    if url is None or not seed.exists():
        return None
    try:
        return asyncio.run(_read_consumers(url, seed, within_s=5))
    except Exception as error:  # NATS down, refused, slow: say so, never a traceback
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}


async def _read_consumers(url: str, seed: Path, *, within_s: float) -> dict[str, Any]:
    from ledger.nats import Identity, Role, connect_as

    async with asyncio.timeout(within_s):
        identity = Identity.from_seed_file(Role.LEDGER, "ledger", seed)
        nc = await connect_as(url, identity, allow_reconnect=False, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=2)
            found: dict[str, Any] = {}
            for stream in await js.streams_info():
                name = stream.config.name or ""
                for consumer in await js.consumers_info(name):
                    found[f"{name}/{consumer.name}"] = {
                        "waiting": consumer.num_pending,
                        "unacknowledged": consumer.num_ack_pending,
                        "redelivered": consumer.num_redelivered,
                    }
            return found
        finally:
            await nc.close()


def render_status(data: dict[str, Any]) -> str:
    """`opledger status` for people."""
    lines = [f"home      {data['home']}", f"database  {data['database']}", ""]
    stack = data["stack"]
    if stack is None:
        lines.append("stack     none runs from this home (`opledger up` starts one)")
    else:
        lines.append(
            f"stack     NATS {stack['nats_url']}, supervisor pid {stack['supervisor_pid']}"
        )
        for name, process in sorted(stack["processes"].items()):
            state = "running" if process["alive"] else "EXITED (see its log)"
            lines.append(f"  {name:<34} pid {process['pid']:<8} {state}")
    lines.append("")
    needs = {state: n for state, n in data["needs_a_person"].items() if n}
    if needs:
        lines.append("needs a person: " + ", ".join(f"{n} {state}" for state, n in needs.items()))
        hints = {
            S.AWAITING_APPROVAL.value: "opledger approvals list",
            S.NEEDS_RESOLUTION.value: "opledger ops list --state needs_resolution, then"
            " opledger ops resolve",
            S.OUTCOME_UNKNOWN.value: "lookups run on their own; opledger ops list --state"
            " outcome_unknown",
        }
        lines += [f"  {hints[state]}" for state in needs]
    else:
        lines.append("needs a person: nothing")
    operations = data["operations"]
    total = sum(operations.values())
    lines.append(
        f"operations {total}: "
        + (", ".join(f"{n} {state}" for state, n in operations.items()) or "none")
    )
    relay = data["relay"]
    if relay["position"] is None:
        lines.append(f"relay     has not run (events: {data['events']})")
    else:
        behind = relay["behind"]
        lines.append(
            f"relay     at event {relay['position']} of {data['events']}"
            + (f", {behind} behind" if behind else ", caught up")
        )
    if data["set_aside"]:
        lines.append(f"set aside {len(data['set_aside'])} event(s) the relay could not publish:")
        lines += [
            f"  {item['operation_id']} v{item['version']}: {item['reason']}"
            for item in data["set_aside"][:10]
        ]
    consumers = data["consumers"]
    if consumers is None:
        lines.append("consumers unknown (no NATS URL or no ledger seed here)")
    elif "error" in consumers:
        lines.append(f"consumers unreadable: {consumers['error']}")
    else:
        lines.append("consumers (waiting / unacknowledged / redelivered):")
        lines += [
            f"  {name:<40} {c['waiting']:>6} {c['unacknowledged']:>6} {c['redelivered']:>6}"
            for name, c in sorted(consumers.items())
        ]
    return "\n".join(lines)


class EventLines:
    """Turns the events stored after a position into one line each, as they come."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        from_start: bool = False,
        after: int | None = None,
        as_json: bool = False,
    ) -> None:
        """Lines of the events after `after` (a position), else from the first event if
        `from_start`, else from the ones stored from now on."""
        self._reader = ledger.event_reader
        self._mapper = ledger.events.mapper
        self._as_json = as_json
        if after is not None:
            self.position = after
        else:
            self.position = -(2**63) if from_start else self._reader.last_position()

    def next_lines(self, limit: int = 500) -> list[str]:
        """The lines of up to `limit` events stored since the last call (none: nothing new)."""
        lines: list[str] = []
        for row_position, operation_id, version, topic, state in self._reader.rows_after(
            self.position, limit
        ):
            self.position = row_position
            event: Any = self._mapper.to_domain_event(
                StoredEvent(operation_id, version, topic, state)
            )
            kind = EVENT_KINDS.get(type(event))
            summary = kind.summary(event) if kind else ""
            if self._as_json:
                lines.append(json.dumps({
                    "position": row_position, "operation_id": operation_id,
                    "version": version, "type": type(event).__name__,
                    "timestamp": when_text(event.timestamp), "summary": summary,
                }))
            else:
                lines.append(f"{when_text(event.timestamp)}  {operation_id}  v{version}"
                             f"  {type(event).__name__}: {summary}")
        return lines


def watch(
    ledger: Ledger,
    *,
    from_start: bool,
    count: int | None,
    seconds: float | None,
    as_json: bool,
    emit: Callable[[str], None],
    poll_s: float = 0.3,
) -> int:
    """Print each event as it is stored, one line each, until `count` events or
    `seconds` have passed (or Ctrl-C); returns how many were printed."""
    lines = EventLines(ledger, from_start=from_start, as_json=as_json)
    deadline = None if seconds is None else time.monotonic() + seconds
    shown = 0
    while (count is None or shown < count) and (deadline is None or time.monotonic() < deadline):
        batch = lines.next_lines(500 if count is None else min(500, count - shown))
        if not batch:
            time.sleep(poll_s)
            continue
        for line in batch:
            emit(line)
            shown += 1
    return shown
