"""Executors: the processes that run one tool each, under a lease from the ledger.

An executor never decides whether a call may run: the ledger did that. It
binds to its tool's durable pull consumer, asks the ledger for the lease on
every work item, re-checks the target, runs the tool with the operation ID as
idempotency key, validates and redacts the output, and publishes one result
envelope per attempt. Each executor holds only its own tool's secrets.

Public surface:

- Writing a tool: `tool` / `Tool`, `ToolContext`, `ToolError`, `Precondition`,
  `Reconciliation` and their verdict enums.
- Running one: `ExecutorRunner` (NATS) with its `RunnerOptions`, `ItemProcessor`
  (the NATS-free core) with its `ProcessorOptions`,
  `run_executor_main` (`python -m executors run MODULE:TOOL ...`), `serve_until_stopped`
  (run a runner until SIGTERM/SIGINT), and for the
  `opledger executor run` command `add_run_arguments` and `run_executor`.
- `redact` / `RedactionPolicy`: the output scrubbing, usable on its own.
- `load_secrets`: an executor's secrets from a file and `OPLEDGER_SECRET_*`.
- Errors (`executors._errors`), each an `OpledgerError`: `ExecutorConfigError`,
  `SecretsError`, `MissingSecretError` (also a `KeyError`), `LeaseError`.
"""

from executors._api import (
    CancelFn,
    CheckFn,
    CloseFn,
    PostconditionFn,
    Precondition,
    PreconditionVerdict,
    PreviewFn,
    ReconcileFn,
    ReconcileStatus,
    Reconciliation,
    RunFn,
    Tool,
    ToolContext,
    ToolError,
    tool,
)
from executors._errors import ExecutorConfigError, LeaseError, MissingSecretError, SecretsError
from executors._main import (
    add_run_arguments,
    build_connect_options,
    load_tool,
    run_executor,
    run_executor_main,
    serve_until_stopped,
)
from executors._metrics import ExecutorMetrics
from executors._process import (
    HeartbeatFn,
    ItemAction,
    ItemDisposition,
    ItemProcessor,
    LeaseFn,
    ProcessorOptions,
    result_msg_id,
)
from executors._redact import (
    DEFAULT_POLICY,
    REDACTED,
    Redacted,
    RedactionPolicy,
    redact,
    redact_text,
)
from executors._runner import ExecutorRunner, RunnerOptions, load_contract
from executors._secrets import SECRET_ENV_PREFIX, load_secrets

__all__ = [
    "DEFAULT_POLICY",
    "REDACTED",
    "SECRET_ENV_PREFIX",
    "CancelFn",
    "CheckFn",
    "CloseFn",
    "ExecutorConfigError",
    "ExecutorMetrics",
    "ExecutorRunner",
    "HeartbeatFn",
    "ItemAction",
    "ItemDisposition",
    "ItemProcessor",
    "LeaseError",
    "LeaseFn",
    "MissingSecretError",
    "PostconditionFn",
    "Precondition",
    "PreconditionVerdict",
    "PreviewFn",
    "ProcessorOptions",
    "ReconcileFn",
    "ReconcileStatus",
    "Reconciliation",
    "Redacted",
    "RedactionPolicy",
    "RunFn",
    "RunnerOptions",
    "SecretsError",
    "Tool",
    "ToolContext",
    "ToolError",
    "add_run_arguments",
    "build_connect_options",
    "load_contract",
    "load_secrets",
    "load_tool",
    "redact",
    "redact_text",
    "result_msg_id",
    "run_executor",
    "run_executor_main",
    "serve_until_stopped",
    "tool",
]
