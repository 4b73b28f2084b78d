"""The relay: the ledger's outbox, published to NATS in event order.

Every appended event is mirrored on the feed; an operation that became ready
gets a work item on its tool's work queue; an operation that reached a final
state gets its outcome announced to the host that proposed it. The relay
saves its position only over what JetStream is known to have stored, so a
crash between commit and publish means a republish (deduplicated by message
ID), never a lost work item or feed event. One relay runs at a time per
database: instances take turns through a lease row, so two services do not
dispatch twice.

Its parts, each in its own module:

- `position`: the lease and position row and the set-aside table
  (`RelayPositions`), and why they are not `eventsourcing.projection`
  tracking records;
- `messages`: the pure builder, a stored event → the messages it means
  (`messages_for`), tested without NATS;
- `publisher`: the JetStream side, with its proof of what was stored and the
  republish when something was not (`RelayPublisher`);
- `appended`: the rows this process just appended, handed to the relay instead
  of read back when they provably follow its position (`AppendedRows`);
- the `Relay` itself, which reads the ledger only through `RelayPorts`.
"""

from ledger.server.relay._relay import Relay, RelayPorts
from ledger.server.relay.appended import AppendedRows
from ledger.server.relay.messages import (
    RelayMessage,
    Route,
    learn_routes,
    messages_for,
    plan_route,
)
from ledger.server.relay.position import (
    SET_ASIDE_TABLE,
    RelayPositions,
    SetAsideRecord,
    read_set_aside,
)
from ledger.server.relay.publisher import Proof, RelayPublisher

__all__ = [
    "SET_ASIDE_TABLE",
    "AppendedRows",
    "Proof",
    "Relay",
    "RelayMessage",
    "RelayPorts",
    "RelayPositions",
    "RelayPublisher",
    "Route",
    "SetAsideRecord",
    "learn_routes",
    "messages_for",
    "plan_route",
    "read_set_aside",
]
