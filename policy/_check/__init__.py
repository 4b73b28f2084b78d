"""The layered proposal check: one module per stage, composed by `ProposalChecker`."""
