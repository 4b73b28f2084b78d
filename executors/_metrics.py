"""Executor metrics (seed 001, "audit log and metrics"), in their own Prometheus registry.

Labels are low-cardinality by design: tool names, outcomes and fixed reason
words. Operation IDs, users and argument values never become labels; they
belong in logs and the ledger's audit trail.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["ExecutorMetrics"]

_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class ExecutorMetrics:
    """The counters and histograms one executor process exports.

    Each instance has its own `CollectorRegistry` (unless one is given), so
    several runners in one test process never collide on metric names.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.executions = Counter(
            "tool_executions_total",
            "Attempts that produced a result, by outcome (succeeded, failed, unknown).",
            ["tool", "outcome"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "tool_execution_duration_seconds",
            "Time from lease to result for executed attempts.",
            ["tool"],
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "tool_execution_retries_total",
            "Work items put back for later, or seen again, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.unknown = Counter(
            "tool_operations_unknown_total",
            "Attempts whose side effect may or may not have happened.",
            ["tool"],
            registry=self.registry,
        )
        self.reconciliation_duration = Histogram(
            "tool_reconciliation_duration_seconds",
            "Time spent looking up the outcome of an earlier attempt.",
            ["tool"],
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.items = Counter(
            "tool_work_items_total",
            "Work items handled, by what the executor did with them.",
            ["tool", "action"],
            registry=self.registry,
        )
        self.redactions = Counter(
            "tool_result_redactions_total",
            "Values redacted or truncated in published results.",
            ["tool"],
            registry=self.registry,
        )
