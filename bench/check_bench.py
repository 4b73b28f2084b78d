"""How much the layered check costs per proposal.

Measures the full `ProposalChecker.check` (parse, structure, semantics with
target resolution and cross-field rules, authorization, risk, approval,
budget) on four-field `search_documents` proposals, beside two baselines
measured in the same run: python-jsonschema validating the same arguments,
and jsonschema-rs doing so. Prints medians in microseconds and the ratios.

    python bench/check_bench.py [--rounds 7] [--n 5000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jsonschema_rs
from jsonschema import Draft202012Validator

from policy import ContractRegistry, InMemoryBudgetCounter, InMemoryTargetResolver, ProposalChecker
from policy.catalog import CATALOG_DIR, SAMPLE_RULES, sample_targets
from schemas import DecisionOutcome, RuntimeContext, ToolProposal

ARGUMENTS = {
    "query": "refund policy effective date",
    "source_types": ["policy", "manual"],
    "date_from": "2026-01-01",
    "top_k": 8,
}


def _median_us(fn: Callable[[], Any], n: int, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(samples)


def main() -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--n", type=int, default=5000)
    args = parser.parse_args()

    catalog = ContractRegistry.from_directory(CATALOG_DIR).pin_latest()
    contract = catalog["search_documents"]
    checker = ProposalChecker(
        catalog,
        resolver=InMemoryTargetResolver(sample_targets()),
        rules=SAMPLE_RULES,
        budget=InMemoryBudgetCounter(),
    )
    context = RuntimeContext(
        principal="alice", tenant="acme", capabilities=frozenset({"documents:search"})
    )
    proposal = ToolProposal(
        proposal_id="p-1",
        conversation_id="c-1",
        requested_by_user_id="alice",
        tool_name="search_documents",
        arguments=ARGUMENTS,
    )
    assert checker.check(proposal, context).outcome is DecisionOutcome.READY
    as_text = proposal.model_copy(update={"arguments": __import__("orjson").dumps(ARGUMENTS)})
    invalid = proposal.model_copy(update={"arguments": {**ARGUMENTS, "top_k": 50, "x": 1}})

    python_validator = Draft202012Validator(
        contract.input_schema, format_checker=Draft202012Validator.FORMAT_CHECKER
    )
    rust_validator = jsonschema_rs.validator_for(contract.input_schema, validate_formats=True)

    figures = {
        "baseline: python-jsonschema is_valid": _median_us(
            lambda: python_validator.is_valid(ARGUMENTS), args.n, args.rounds
        ),
        "baseline: jsonschema-rs is_valid": _median_us(
            lambda: rust_validator.is_valid(ARGUMENTS), args.n, args.rounds
        ),
        "check: valid proposal (object arguments)": _median_us(
            lambda: checker.check(proposal, context), args.n, args.rounds
        ),
        "check: valid proposal (JSON text arguments)": _median_us(
            lambda: checker.check(as_text, context), args.n, args.rounds
        ),
        "check: invalid proposal (two findings)": _median_us(
            lambda: checker.check(invalid, context), args.n // 5, args.rounds
        ),
    }
    width = max(map(len, figures))
    baseline = figures["baseline: python-jsonschema is_valid"]
    print(f"layered check, four-field search_documents, median of {args.rounds} rounds")
    for name, value in figures.items():
        print(f"  {name:<{width}}  {value:8.1f} µs   {value / baseline:5.2f}x python-jsonschema")
    target = figures["check: valid proposal (object arguments)"]
    print(f"  target < 100 µs for a valid proposal: {'met' if target < 100 else 'MISSED'}")


if __name__ == "__main__":
    main()
