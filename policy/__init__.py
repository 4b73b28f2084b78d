"""Tool contracts and the layered check that decides whether a proposed call may run.

The public surface:

- `ToolContract` and its parts: the twelve fields a trusted registry holds per tool.
- `ContractRegistry` / `ToolCatalog`: load operator files, refuse bad ones, pin versions.
- `ProposalChecker`: parse → tool → structure → semantics → authorization → risk →
  approval → budget, returning a `schemas.Decision` and never raising.
- Errors, each an `OpledgerError`: `ContractError`, `ToolFormatError`, `ArgumentLimitsError`.
- Ports the host supplies (`TargetResolver`, `BudgetCounter`, `SemanticRule`) and
  in-memory adapters of them.
"""

from policy._check._checker import ProposalChecker
from policy._check._parse import DEFAULT_LIMITS, ArgumentLimits, json_value_issue
from policy._check._plan import (
    PlanShape,
    merge_approvals,
    parallel_writes,
    plan_shape,
    riskiest,
)
from policy._check._pointer import MISSING, replace_at_pointers, resolve_pointer
from policy._check._structure import CompiledSchema
from policy._contract import (
    ApprovalMode,
    ApprovalPolicy,
    Compensation,
    EffectClass,
    ErrorModelEntry,
    Idempotency,
    Limits,
    ReconcilePolicy,
    RetryPolicy,
    RiskCondition,
    RiskPolicy,
    RiskRule,
    TargetRule,
    ToolContract,
    ToolDescription,
    ToolVersion,
    WriteKey,
)
from policy._errors import ArgumentLimitsError, ContractError, ToolFormatError
from policy._export import (
    StrictModeProblem,
    StrictModeReport,
    ToolFormat,
    export_tool,
    offered_contracts,
    openai_strict_report,
    to_anthropic_tool,
    to_mcp_tool,
    to_openai_tool,
)
from policy._fakes import InMemoryBudgetCounter, InMemoryTargetResolver
from policy._ports import (
    AmbiguousTarget,
    BudgetCounter,
    SemanticInput,
    SemanticRule,
    Target,
    TargetResolver,
)
from policy._registry import ContractRegistry, ToolCatalog, json_pointer, parse_contract

__all__ = [
    "DEFAULT_LIMITS",
    "MISSING",
    "AmbiguousTarget",
    "ApprovalMode",
    "ApprovalPolicy",
    "ArgumentLimits",
    "ArgumentLimitsError",
    "BudgetCounter",
    "Compensation",
    "CompiledSchema",
    "ContractError",
    "ContractRegistry",
    "EffectClass",
    "ErrorModelEntry",
    "Idempotency",
    "InMemoryBudgetCounter",
    "InMemoryTargetResolver",
    "Limits",
    "PlanShape",
    "ProposalChecker",
    "ReconcilePolicy",
    "RetryPolicy",
    "RiskCondition",
    "RiskPolicy",
    "RiskRule",
    "SemanticInput",
    "SemanticRule",
    "StrictModeProblem",
    "StrictModeReport",
    "Target",
    "TargetResolver",
    "TargetRule",
    "ToolCatalog",
    "ToolContract",
    "ToolDescription",
    "ToolFormat",
    "ToolFormatError",
    "ToolVersion",
    "WriteKey",
    "export_tool",
    "json_pointer",
    "json_value_issue",
    "merge_approvals",
    "offered_contracts",
    "openai_strict_report",
    "parallel_writes",
    "parse_contract",
    "plan_shape",
    "replace_at_pointers",
    "resolve_pointer",
    "riskiest",
    "to_anthropic_tool",
    "to_mcp_tool",
    "to_openai_tool",
]
