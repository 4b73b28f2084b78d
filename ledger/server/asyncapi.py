"""The wire as an AsyncAPI 3.0 document, declared with FastStream and generated from it.

FastStream's place in opledger: the ledger service's connection (a
`NatsBroker` connects, reconnects and drains it) and this description of the
wire. Its subscribers are not on the hot path: per request they run
middleware and dependency machinery and hop to worker threads, and the whole
stack reached 223 operations/s with FastStream handlers against 667 with the
plain nats-py subscriptions `ledger.server.requests` uses, everything else
equal (`bench/e2e_bench.py`, this project's 2-core machine; measured again
without the ledger, still about 3 to 1: see `ledger.server.requests`). So the broker
here is never connected: it only declares every subject with its `schemas`
model, for FastStream to describe.

    python -m ledger.server.asyncapi > docs/asyncapi.yaml

regenerates the published document; a test checks it is current and that
every channel's payload is its model's JSON Schema.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import yaml
from faststream.nats import NatsBroker
from faststream.specification import AsyncAPI
from pydantic import BaseModel

from schemas import (
    ApproverRequest,
    CancelRequest,
    ErrorEnvelope,
    FeedEvent,
    LeaseReply,
    LeaseRequest,
    OperationStatus,
    OperatorRequest,
    PlanRequest,
    PlanStatus,
    ProposalEnvelope,
    ProposeReply,
    ResultEnvelope,
    StatusRequest,
    Subjects,
    ToolsReply,
    ToolsRequest,
    WorkItem,
)

__all__ = ["CHANNELS", "Channel", "asyncapi_yaml", "wire_broker"]


def _address(build: Callable[..., str], *names: str) -> str:
    """The subject `build` makes, each of its tokens an AsyncAPI `{name}` parameter."""
    subject = build(*(f"__{n}__" for n in range(len(names))))
    for n, name in enumerate(names):
        subject = subject.replace(f"__{n}__", "{" + name + "}")
    return subject


_REPLY = "{reply}"
"""A reply goes to the request's reply subject: the requester's private inbox
(`_INBOX_<role>_<name>.…`), or for a lease the `_R_.…` subject of its import."""


@dataclass(frozen=True, slots=True)
class Channel:
    """One channel of the document: a subject, its message model, and who sends it."""

    title: str
    address: str
    model: type[BaseModel]
    received: bool
    """True: the ledger receives it (a subscriber); False: the ledger sends it."""
    description: str


CHANNELS: tuple[Channel, ...] = (
    Channel("propose", _address(Subjects.propose, "host"), ProposalEnvelope, received=True,
            description="A host proposes a tool call (request/reply, core NATS)."),
    Channel("propose_reply", _REPLY, ProposeReply, received=False,
            description="The answer to a proposal: the operation and the check's decision, or"
            " its `error` when the proposal itself is refused."),
    Channel("status", _address(Subjects.status, "host"), StatusRequest, received=True,
            description="A host asks where one of its operations stands (request/reply)."),
    Channel("status_reply", _REPLY, OperationStatus, received=False,
            description="The answer to a status request."),
    Channel("cancel", _address(Subjects.cancel, "host"), CancelRequest, received=True,
            description="A host cancels one of its own operations (request/reply); the"
            " answer is its status after the cancel (`status_reply`) or `request_refused`."),
    Channel("plan", _address(Subjects.plan, "host"), PlanRequest, received=True,
            description="A host proposes a plan of tool calls (checked, approved and run as"
            " one unit), asks where one stands, or cancels one (request/reply); answered"
            " with `plan_reply` or `request_refused`."),
    Channel("plan_reply", _REPLY, PlanStatus, received=False,
            description="Where a plan stands, with its step table (each step an operation"
            " of the host, announced on `outcome` like any other)."),
    Channel("tools", _address(Subjects.tools, "host"), ToolsRequest, received=True,
            description="A host asks for the tools a caller with the given capabilities may"
            " call, as OpenAI, Anthropic or MCP definitions (request/reply)."),
    Channel("tools_reply", _REPLY, ToolsReply, received=False,
            description="The tool definitions: the contracts' own schemas, forbidden tools"
            " never listed."),
    Channel("operate", _address(Subjects.operate, "operator"), OperatorRequest, received=True,
            description="An operator resolves an unknown outcome or cancels, by the ledger's"
            " operation ID (request/reply); answered with its status or `request_refused`."),
    Channel("approve", _address(Subjects.approve, "approver"), ApproverRequest, received=True,
            description="An approver approves (naming the proposal hash shown) or denies a"
            " call, by the ledger's operation ID, or a whole plan, by its `plan_id` (the"
            " hash shown is then the plan's) (request/reply). Who decides is the"
            " approver whose subject it is, with the roles the ledger's configuration gives"
            " them; answered with the operation's status or `request_refused`."),
    Channel("lease", _address(Subjects.lease, "tool"), LeaseRequest, received=True,
            description="An executor asks for the lease on one operation, or checks in"
            " while it runs one (`holding`: the answer may be `cancel`) (request/reply)."),
    Channel("lease_reply", _REPLY, LeaseReply, received=False,
            description="The answer to a lease request."),
    Channel("request_refused", _REPLY, ErrorEnvelope, received=False,
            description="The answer to a status or lease request the ledger cannot serve"
            " (`ok` is false; `meta.operation_id` names the operation asked about)."),
    Channel("work", _address(Subjects.work, "tool"), WorkItem, received=False,
            description="A ready operation queued for its tool's executors (JetStream"
            " OPS_WORK, `Nats-Msg-Id` `<operation_id>:attempt-<n>`), or an unknown outcome"
            " to look up (`purpose: reconcile`, `<operation_id>:attempt-<n>:lookup-<k>`)."),
    Channel("result", _address(Subjects.result, "tool"), ResultEnvelope, received=True,
            description="One attempt's result, published by its executor (JetStream"
            " OPS_RESULTS)."),
    Channel("feed", _address(Subjects.feed, "tool", "event_type"), FeedEvent, received=False,
            description="Every ledger event, sensitive values hashed (JetStream OPS_FEED,"
            " `Nats-Msg-Id` `<operation_id>:<version>`)."),
    Channel("outcome", _address(Subjects.outcome, "host", "operation_id"), OperationStatus,
            received=False,
            description="The final outcome of one of a host's operations, or a notice,"
            " not final, that it needs a person (`needs_resolution`) (core NATS, best"
            " effort: the host asks for the status when none comes)."),
)
"""Every subject of the wire, with the `schemas` model of its messages."""


def wire_broker() -> NatsBroker:
    """A broker (never connected) declaring every channel of `CHANNELS`."""
    broker = NatsBroker()
    for channel in CHANNELS:
        if channel.received:
            broker.subscriber(
                channel.address, title=channel.title, description=channel.description
            )(_handler(channel.model))
        else:
            broker.publisher(
                channel.address,
                title=channel.title,
                description=channel.description,
                schema=channel.model,
            )
    return broker


def _handler(model: type[BaseModel]) -> Callable[..., Any]:
    """A subscriber body whose one argument FastStream describes as `model`."""

    async def handle(message: Any) -> None:  # pragma: no cover - never called
        del message  # described, never read

    handle.__annotations__ = {"message": model, "return": None}
    return handle


def asyncapi_yaml() -> str:
    """The AsyncAPI 3.0 document of the wire, as YAML."""
    spec = AsyncAPI(
        wire_broker(),
        title="opledger wire",
        version=version("opledger"),
        description="Every message opledger's processes exchange over NATS. The payload"
        " schemas are `schemas/json/`'s, generated from the same pydantic models.",
        schema_version="3.0.0",
    )
    document: dict[str, Any] = spec.to_specification().to_jsonable()
    # FastStream lists channels in an order of its own that varies from run to
    # run: sorted by name, the document is the same bytes every time.
    for section in (document, document["components"]):
        for key in ("channels", "operations", "messages", "schemas"):
            if key in section:
                section[key] = dict(sorted(section[key].items()))
    out = io.StringIO()
    yaml.safe_dump(document, out, sort_keys=False, allow_unicode=True, width=100)
    return out.getvalue()


if __name__ == "__main__":
    sys.stdout.write(asyncapi_yaml())
