"""The NATS topology every process agrees on: subjects, streams and consumer names.

Part of the wire format: a host or executor in another language needs exactly
these names. Identifiers used as subject tokens (hosts, tools, operation IDs)
are restricted to `[A-Za-z0-9_-]`, so no token can contain `.`, `*` or `>`.
"""

from __future__ import annotations

import re
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schemas._result import ResultEnvelope

__all__ = [
    "FEED_AUDITOR_CONSUMER",
    "FEED_STREAM",
    "OPERATION_ID_PATTERN",
    "RESULTS_CONSUMER",
    "RESULTS_STREAM",
    "TOKEN_PATTERN",
    "WORK_STREAM",
    "Subjects",
    "check_token",
    "feed_message_id",
    "host_operation_id",
    "inbox_prefix",
    "ledger_operation_id",
    "new_operation_id",
    "preview_message_id",
    "result_message_id",
    "work_consumer",
    "work_message_id",
]

TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
"""What a host name, tool name or operation ID must look like to be a subject token."""
_TOKEN = re.compile(TOKEN_PATTERN)

OPERATION_ID_PATTERN = r"^(?:[A-Za-z0-9_-]{1,128}/)?[A-Za-z0-9_-]{1,128}$"
"""What the ledger calls an operation: `<host>/<id>` for one an agent host proposed
as `<id>`, a bare `<id>` for one submitted without a host (the Python API).

Operation IDs are scoped per host, so that no host can learn, by proposing
under an ID, that another host used it: each host has a namespace of its own.
Hosts only ever see and send their own `<id>`; executors, auditors and the
command line see the ledger's `<host>/<id>`."""
_OPERATION_ID = re.compile(OPERATION_ID_PATTERN)
_SCOPE = "/"

WORK_STREAM = "OPS_WORK"
"""Work-queue stream over `ops.exec.*`: one durable pull consumer per tool."""
RESULTS_STREAM = "OPS_RESULTS"
"""Results published by executors, `ops.result.*`, consumed by the ledger service."""
FEED_STREAM = "OPS_FEED"
"""Every ledger event, `ops.feed.<tool>.<event>`; only the ledger service writes it."""
RESULTS_CONSUMER = "ledger_results"
"""The ledger service's durable consumer on the results stream."""
FEED_AUDITOR_CONSUMER = "feed_auditor"
"""A durable consumer on the feed for auditors, created by the ledger service."""


def check_token(value: str) -> str:
    """`value`, if it is a safe subject token; ValueError otherwise."""
    if not _TOKEN.match(value):
        raise ValueError(f"not a valid subject token: {value!r}")
    return value


def ledger_operation_id(host: str, operation_id: str) -> str:
    """The ledger's ID for operation `operation_id` of agent host `host` ("" for none)."""
    if not host:
        return check_token(operation_id)
    return f"{check_token(host)}{_SCOPE}{check_token(operation_id)}"


def host_operation_id(ledger_id: str) -> str:
    """The ID the proposing host knows a ledger operation by (the part after `<host>/`)."""
    return ledger_id.rpartition(_SCOPE)[2]


def work_consumer(tool: str) -> str:
    """The durable pull consumer of one tool's work."""
    return f"exec_{check_token(tool)}"


def work_message_id(operation_id: str, attempt: int, lookup: int = 0) -> str:
    """The `Nats-Msg-Id` of one attempt's work item: one item per attempt, deduplicated;
    with `lookup`, of the item for that lookup of the attempt's unknown outcome."""
    if lookup:
        return f"{operation_id}:attempt-{attempt}:lookup-{lookup}"
    return f"{operation_id}:attempt-{attempt}"


def preview_message_id(operation_id: str) -> str:
    """The `Nats-Msg-Id` of the work item asking for a call's preview: one per call."""
    return f"{operation_id}:preview"


def feed_message_id(operation_id: str, version: int) -> str:
    """The `Nats-Msg-Id` of one event on the feed: one feed message per event, deduplicated."""
    return f"{operation_id}:{version}"


def result_message_id(envelope: ResultEnvelope, nonce: str) -> str:
    """`<tool>:<operation_id>:<attempt>:<fencing_token>:<nonce>`: one result, deduplicated.

    A republish of the same result after a lost PubAck carries the same ID,
    so JetStream drops it within its duplicate window; the ledger makes any
    later duplicate converge by the fencing token. The nonce (random, one
    per result, kept across its retries) is what makes the ID unguessable:
    deduplication spans the whole results stream, every tool's subject, so
    an executor of another tool that published first under a predictable ID
    would have had this result dropped as its duplicate.
    """
    return (
        f"{envelope.provenance.tool}:{envelope.operation_id}:{envelope.provenance.attempt}"
        f":{envelope.fencing_token}:{nonce}"
    )


def new_operation_id() -> str:
    """A fresh operation ID, `op-<uuid4>`: what the SDK and the ledger mint when none is given.

    One format for both, so an ID in a log or on the feed reads the same
    whoever minted it (36 hex digits and dashes, well within a token's 128).
    """
    return f"op-{uuid.uuid4()}"


def inbox_prefix(role: str, name: str) -> str:
    """A private inbox prefix per identity: nobody subscribes to `_INBOX.>`."""
    return f"_INBOX_{check_token(role)}_{check_token(name)}"


class Subjects:
    """Subject names, built from checked tokens, and the wildcards that cover them.

    The wildcards are written here only: streams, consumers, subscriptions
    and permissions take them from these methods, so a family of subjects
    is spelt once.
    """

    @staticmethod
    def all_proposals() -> str:
        """Every host's proposal subject (`ops.propose.*`), served by the ledger."""
        return "ops.propose.*"

    @staticmethod
    def all_status_requests() -> str:
        """Every host's status subject (`ops.status.*`), served by the ledger."""
        return "ops.status.*"

    @staticmethod
    def all_cancel_requests() -> str:
        """Every host's cancel subject (`ops.cancel.*`), served by the ledger."""
        return "ops.cancel.*"

    @staticmethod
    def all_tool_requests() -> str:
        """Every host's tool catalog subject (`ops.tools.*`), served by the ledger."""
        return "ops.tools.*"

    @staticmethod
    def all_plan_requests() -> str:
        """Every host's plan subject (`ops.plan.*`), served by the ledger."""
        return "ops.plan.*"

    @staticmethod
    def all_operator_requests() -> str:
        """Every operator's subject (`ops.operate.*`), served by the ledger."""
        return "ops.operate.*"

    @staticmethod
    def all_approver_requests() -> str:
        """Every approver's subject (`ops.approve.*`), served by the ledger."""
        return "ops.approve.*"

    @staticmethod
    def all_lease_requests() -> str:
        """Every tool's lease subject (`ops.lease.*`), served by the ledger."""
        return "ops.lease.*"

    @staticmethod
    def all_work(*, any_depth: bool = False) -> str:
        """Every tool's work queue: `ops.exec.*` (the work stream's subjects), or
        `ops.exec.>` with `any_depth` (the ledger's publish grant)."""
        return "ops.exec.>" if any_depth else "ops.exec.*"

    @staticmethod
    def all_results() -> str:
        """Every tool's result subject (`ops.result.*`, the results stream's subjects)."""
        return "ops.result.*"

    @staticmethod
    def all_feed(tool: str | None = None) -> str:
        """Every feed event (`ops.feed.>`), or every one of `tool`'s (`ops.feed.<tool>.>`)."""
        return "ops.feed.>" if tool is None else f"ops.feed.{check_token(tool)}.>"

    @staticmethod
    def all_outcomes(host: str | None = None) -> str:
        """Every outcome notice (`ops.outcome.>`), or every one of `host`'s
        (`ops.outcome.<host>.>`)."""
        return "ops.outcome.>" if host is None else f"ops.outcome.{check_token(host)}.>"

    @staticmethod
    def propose(host: str) -> str:
        """Where host `host` sends proposals (request/reply)."""
        return f"ops.propose.{check_token(host)}"

    @staticmethod
    def status(host: str) -> str:
        """Where host `host` asks for an operation's status (request/reply)."""
        return f"ops.status.{check_token(host)}"

    @staticmethod
    def cancel(host: str) -> str:
        """Where host `host` asks to cancel one of its own operations (request/reply)."""
        return f"ops.cancel.{check_token(host)}"

    @staticmethod
    def tools(host: str) -> str:
        """Where host `host` asks for the tools it may offer its model (request/reply)."""
        return f"ops.tools.{check_token(host)}"

    @staticmethod
    def plan(host: str) -> str:
        """Where host `host` proposes plans, asks where they stand and cancels them
        (request/reply, `PlanRequest`)."""
        return f"ops.plan.{check_token(host)}"

    @staticmethod
    def operate(operator: str) -> str:
        """Where operator `operator` settles or cancels operations (request/reply)."""
        return f"ops.operate.{check_token(operator)}"

    @staticmethod
    def approve(approver: str) -> str:
        """Where approver `approver` approves or denies calls (request/reply); the
        ledger records the decision as that approver's, with the roles it configured."""
        return f"ops.approve.{check_token(approver)}"

    @staticmethod
    def outcome(host: str, operation_id: str) -> str:
        """Where the final outcome of one of `host`'s operations is announced."""
        return f"ops.outcome.{check_token(host)}.{check_token(operation_id)}"

    @staticmethod
    def work(tool: str) -> str:
        """Where ready operations of `tool` are queued for its executors."""
        return f"ops.exec.{check_token(tool)}"

    @staticmethod
    def lease(tool: str) -> str:
        """Where executors of `tool` ask the ledger for a lease (request/reply)."""
        return f"ops.lease.{check_token(tool)}"

    @staticmethod
    def result(tool: str) -> str:
        """Where executors of `tool` publish result envelopes (JetStream)."""
        return f"ops.result.{check_token(tool)}"

    @staticmethod
    def feed(tool: str, event_type: str) -> str:
        """Where the ledger mirrors one event of an operation of `tool`."""
        return f"ops.feed.{check_token(tool)}.{check_token(event_type)}"
