"""The ledger service: the ledger on NATS JetStream (a FastStream application)."""
