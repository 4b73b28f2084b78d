"""The lease carries the trusted runtime context from the ledger's own record, and the
lease re-checks the caller's capabilities against the contract in force. Both backends.

Before: executors never received the principal, tenant or capabilities (a tool could
not scope its work), and capabilities were checked once, at the proposal.
"""

from __future__ import annotations

from ledger import StorageConfig
from policy import ContractRegistry
from policy.catalog import CATALOG_DIR
from schemas import LeaseDecision, RuntimeContext
from tests.ledger.helpers import ALICE, event_types, make_ledger, search


def test_the_lease_names_who_the_call_runs_for_as_recorded(storage: StorageConfig) -> None:
    ledger = make_ledger(storage)
    ledger.submit(search("op-ctx"), ALICE)
    reply = ledger.lease("op-ctx", executor="exec-1")
    assert reply.decision is LeaseDecision.EXECUTE
    assert reply.context == RuntimeContext(
        principal=ALICE.principal, tenant=ALICE.tenant, capabilities=ALICE.capabilities,
        environment=ALICE.environment,
    )
    # Recorded with the proposal, so a replay (another instance) says the same.
    other = make_ledger(storage)
    assert other.get("op-ctx").capabilities == tuple(sorted(ALICE.capabilities))


def test_a_capability_the_contract_now_requires_refuses_the_call_at_the_lease(
    storage: StorageConfig,
) -> None:
    make_ledger(storage).submit(search("op-caps"), ALICE)
    # The catalog reloaded with the same version, now requiring one more capability.
    registry = ContractRegistry()
    for contract in ContractRegistry.from_directory(CATALOG_DIR).pin_latest().values():
        if contract.name == "search_documents":
            contract = contract.model_copy(update={
                "required_capabilities": contract.required_capabilities | {"documents:admin"}
            })
        registry.register(contract)
    ledger = make_ledger(storage, registry=registry)
    reply = ledger.lease("op-caps", executor="exec-1")
    assert reply.decision is LeaseDecision.DONE
    refused = ledger.history("op-caps")[-1]
    assert (type(refused).__name__, refused.code) == ("ExecutionRefused", "permission_changed")
    assert "documents:admin" in refused.reason
    assert "LeaseClaimed" not in event_types(ledger, "op-caps")
