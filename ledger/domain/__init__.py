"""The ledger's domain model: the Operation aggregate, its states, events and errors."""
