"""The ledger service: the ledger on NATS JetStream (request handlers, gateway, relay, sweeps)."""
