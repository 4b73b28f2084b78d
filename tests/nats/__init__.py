"""Tests of the NATS layer against a real nats-server (marker `nats`)."""
