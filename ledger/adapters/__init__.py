"""Adapters: the event store, SQL read models and other infrastructure."""
