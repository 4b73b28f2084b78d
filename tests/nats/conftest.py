"""A real nats-server with generated credentials and the declared topology, per test module.

The server is started once per module (it starts in well under a second, but a
permission matrix has dozens of rows); every test opens its own connections,
in its own event loop, through `NatsEnv.connect`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from ledger.nats import (
    CredentialSet,
    Identity,
    NatsServer,
    Role,
    connect_as,
    declare_topology,
    generate_credentials,
)
from ledger.nats.security import LEDGER_USERS_END, user_entry

TOOLS = ("search_documents", "send_customer_email")
HOSTS = ("h1", "other")
AUDITORS = ("auditor",)
OPERATORS = ("ops-lead", "other-op")
APPROVERS = ("lead", "other-ap")
ACK_WAIT_S = 5.0
MAX_DELIVER = 3
CALL_TIMEOUT_S = 1.0
"""Every single NATS call in these tests is bounded by this (the brief allows 2 s)."""


@pytest.fixture
def anyio_backend() -> str:
    """nats-py is asyncio-only: run the anyio-marked tests on asyncio."""
    return "asyncio"


@dataclass
class Probe:
    """One connection as one identity, with every asynchronous error it was sent."""

    identity: Identity
    nc: Client
    errors: list[Exception] = field(default_factory=list)

    @property
    def js(self) -> nats.js.JetStreamContext:
        """A JetStream context with short timeouts (creating it sends nothing)."""
        return self.nc.jetstream(timeout=CALL_TIMEOUT_S)

    @property
    def violations(self) -> list[str]:
        """The permission violations the server reported, as nats-py words them.

        nats-py lowercases the server's `-ERR` text (subjects included) and hands it
        to the error callback as `nats.errors.Error`; the connection stays open.
        """
        return [str(e) for e in self.errors if "permissions violation" in str(e)]


@dataclass(frozen=True)
class NatsEnv:
    """The running server, the credentials, and a way to connect as anyone."""

    server: NatsServer
    credentials: CredentialSet
    legacy: CredentialSet
    """Test-only twins of an executor and an auditor, with the same permissions, in
    `LEDGER`: the single-account layout, kept to show what the accounts prevent."""

    def identity(self, role: Role, name: str) -> Identity:
        """The identity `name` of `role`."""
        return self.credentials.get(role, name)

    @asynccontextmanager
    async def connect(
        self, role: Role, name: str, *, legacy: bool = False
    ) -> AsyncIterator[Probe]:
        """A connection as `role`/`name`, exactly as production code connects."""
        identity = (self.legacy if legacy else self.credentials).get(role, name)
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        nc = await connect_as(
            self.server.url,
            identity,
            error_cb=on_error,
            allow_reconnect=False,
            connect_timeout=2,
        )
        try:
            yield Probe(identity, nc, errors)
        finally:
            await nc.close()


async def declare_as_ledger(url: str, ledger: Identity) -> None:
    """Declare the test topology (`TOOLS`, short ack wait) as the ledger identity."""
    nc = await connect_as(url, ledger, allow_reconnect=False, connect_timeout=2)
    try:
        await declare_topology(
            nc.jetstream(timeout=CALL_TIMEOUT_S),
            TOOLS,
            ack_wait_s=ACK_WAIT_S,
            max_deliver=MAX_DELIVER,
        )
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def nats_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsEnv]:
    """A server on a free port with least-privilege users and the topology declared."""
    base: Path = tmp_path_factory.mktemp("nats")
    credentials = generate_credentials(
        base / "creds", hosts=HOSTS, tools=TOOLS, auditors=AUDITORS, operators=OPERATORS,
        approvers=APPROVERS,
    )
    legacy = generate_credentials(base / "legacy", hosts=(), tools=TOOLS[:1], auditors=AUDITORS)
    twins = "".join(user_entry(i) for i in legacy.identities if i.role is not Role.LEDGER)
    head, end, tail = credentials.authorization_config.partition(LEDGER_USERS_END)
    with NatsServer(base / "server", authorization=head + twins + end + tail) as server:
        # Declared as the ledger identity: this also proves the ledger may do it.
        asyncio.run(declare_as_ledger(server.url, credentials.ledger))
        yield NatsEnv(server, credentials, legacy)
