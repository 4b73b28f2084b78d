"""Prometheus metrics of the ledger service, named as in seed 001 ("감사 로그와 관측 지표").

They are derived from the ledger's own events as the relay publishes them, so
every instance counts what it relays and nothing is counted twice. Labels are
tools, risk levels, reasons and outcomes only: never an operation, user or
argument value (those belong in the ledger and traces, not in label sets).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    start_http_server,
)

from ledger._recent import Recent

__all__ = ["LedgerMetrics"]

_OPEN_LIMIT = 100_000  # pending start times kept for durations; oldest dropped first


class LedgerMetrics:
    """Counters and histograms, fed one feed record at a time."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, instance: str = "ledger"
    ) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # Which service instance this is (its --name): the scrape target's address
        # changes with a restart or a move, the name does not.
        self.instance = Info(
            "opledger_ledger_instance", "This ledger service instance", registry=r
        )
        self.instance.info({"instance_name": instance})
        self.relay_lag = Gauge(
            "opledger_relay_lag_events",
            "Events stored but not yet published by the relay, as the instance holding"
            " the relay last saw it (0 on the instances that do not hold it)",
            registry=r,
        )
        self.proposals = Counter(
            "tool_proposals_total", "Proposals checked", ["tool", "risk"], registry=r
        )
        self.rejections = Counter(
            "tool_proposal_rejections_total", "Rejected proposals", ["reason"], registry=r
        )
        self.approval_wait = Histogram(
            "tool_approval_wait_seconds",
            "From approval request to decision",
            registry=r,
            buckets=(1, 5, 30, 60, 300, 900, 3600, 14400),
        )
        self.approval_decisions = Counter(
            "tool_approval_decisions_total", "Approval decisions", ["decision"], registry=r
        )
        self.executions = Counter(
            "tool_executions_total", "Finished executions", ["tool", "outcome"], registry=r
        )
        self.duration = Histogram(
            "tool_execution_duration_seconds", "From lease to result", ["tool"], registry=r
        )
        self.retries = Counter(
            "tool_execution_retries_total", "Retries scheduled", ["reason"], registry=r
        )
        self.unknown = Counter(
            "tool_operations_unknown_total", "Outcomes that became unknown", ["tool"], registry=r
        )
        self.reconciliation = Histogram(
            "tool_reconciliation_duration_seconds",
            "From reconciliation start to its end",
            registry=r,
        )
        self.lookups = Counter(
            "tool_reconciliation_lookups_total",
            "Lookups of unknown outcomes that could not tell (settled ones are in"
            " tool_executions_total as reconciled_*)",
            ["tool"],
            registry=r,
        )
        self.needs_resolution = Counter(
            "tool_operations_needing_resolution_total",
            "Unknown outcomes reconciliation gave up on: a person must settle each"
            " (`opledger ops list --state needs_resolution`)",
            ["tool"],
            registry=r,
        )
        self.relay_set_aside = Counter(
            "opledger_relay_events_set_aside_total",
            "Events the relay could not publish and went on without"
            " (each is in opledger_relay_set_aside and noted on its operation)",
            registry=r,
        )
        self._started: Recent[tuple[str, str], datetime] = Recent(_OPEN_LIMIT)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Expose `/metrics` over HTTP."""
        start_http_server(port, addr=addr, registry=self.registry)

    def _start(self, kind: str, operation_id: str, at: datetime) -> None:
        self._started.remember((kind, operation_id), at)

    def _since(self, kind: str, operation_id: str, at: datetime) -> float | None:
        started = self._started.pop((kind, operation_id), None)
        return None if started is None else max((at - started).total_seconds(), 0.0)

    def observe(self, record: dict[str, Any], tool: str) -> None:
        """Count one feed record (see `ledger.audit.export.feed_record`)."""
        kind, event = record["type"], record["event"]
        operation_id = record["operation_id"]
        at = datetime.fromisoformat(event["timestamp"])
        if kind == "Validated":
            self.proposals.labels(tool, event["risk"]).inc()
        elif kind == "Rejected":
            self.proposals.labels(tool, "none").inc()
            codes = event.get("reason_codes") or ["unknown"]
            self.rejections.labels(str(codes[0])).inc()
        elif kind == "ApprovalRequested":
            self._start("approval", operation_id, at)
        elif kind in ("ApprovalGranted", "ApprovalDenied", "ApprovalExpired", "ApprovalRefused"):
            decision = {
                "ApprovalGranted": "granted",
                "ApprovalDenied": "denied",
                "ApprovalExpired": "expired",
                "ApprovalRefused": "refused",
            }[kind]
            self.approval_decisions.labels(decision).inc()
            if kind != "ApprovalRefused":
                waited = self._since("approval", operation_id, at)
                if waited is not None:
                    self.approval_wait.observe(waited)
        elif kind == "LeaseClaimed":
            self._start("lease", operation_id, at)
        elif kind in ("Succeeded", "Failed"):
            self.executions.labels(tool, kind.lower()).inc()
            took = self._since("lease", operation_id, at)
            if took is not None:
                self.duration.labels(tool).observe(took)
        elif kind in ("OutcomeUnknown", "LeaseExpired"):
            self.unknown.labels(tool).inc()
            self._since("lease", operation_id, at)
        elif kind == "RetryScheduled":
            # A person's retry names who; the retry policy's does not.
            self.retries.labels("operator" if event.get("by") else "retryable_failure").inc()
        elif kind == "ReconciliationStarted":
            self._start("reconcile", operation_id, at)
        elif kind == "ReconciliationInconclusive":
            self.lookups.labels(tool).inc()
        elif kind == "ResolutionNeeded":
            self.lookups.labels(tool).inc()  # it stands for the last lookup too
            self.needs_resolution.labels(tool).inc()
        elif kind == "Reconciled":
            self.executions.labels(tool, f"reconciled_{event['outcome']}").inc()
            took = self._since("reconcile", operation_id, at)
            if took is not None:
                self.reconciliation.observe(took)
