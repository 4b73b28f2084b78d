"""opledger on NATS: a supervised nats-server, least-privilege identities, the JetStream topology.

Public surface:

- `NatsServer`, `ClusterOptions`, `find_nats_server`, `free_port`: run a private server.
- `generate_credentials`, `load_credentials`, `CredentialSet`, `Identity`, `Role`,
  `permissions_for`, `connect_options`, `reply_allowed`, `write_server_config`:
  one NKey per identity, and exactly the subjects each role may use.
- `ServerSettings`, `render_server_config`, `quote`: write a server's configuration file.
- `connect_as`, `flush_all`: connect as an identity; a flush that orders after prior commands.
- `declare_topology`: the streams and durable pull consumers (ledger identity only).
- `read_feed`, `FeedMessage`: read the whole feed by sequence (auditor identity).
- The errors, all `schemas.OpledgerError`s.
"""

from ledger.nats._conf import ClusterOptions, ServerSettings, quote, render_server_config
from ledger.nats.client import connect_as, flush_all
from ledger.nats.errors import (
    CredentialsError,
    FeedAccessDenied,
    FeedReadError,
    FeedReadTimeout,
    NatsServerNotFound,
    NatsServerStartError,
    NatsSetupError,
    TopologyError,
    UnknownIdentity,
)
from ledger.nats.feed_reader import FeedMessage, read_feed
from ledger.nats.security import (
    CredentialSet,
    Identity,
    Permissions,
    ResponsePermission,
    Role,
    authorization_config,
    connect_options,
    generate_credentials,
    load_credentials,
    permissions_for,
    reply_allowed,
    write_server_config,
)
from ledger.nats.supervisor import NatsServer, find_nats_server, free_port
from ledger.nats.topology import DeclaredTopology, declare_topology

__all__ = [
    "ClusterOptions",
    "CredentialSet",
    "CredentialsError",
    "DeclaredTopology",
    "FeedAccessDenied",
    "FeedMessage",
    "FeedReadError",
    "FeedReadTimeout",
    "Identity",
    "NatsServer",
    "NatsServerNotFound",
    "NatsServerStartError",
    "NatsSetupError",
    "Permissions",
    "ResponsePermission",
    "Role",
    "ServerSettings",
    "TopologyError",
    "UnknownIdentity",
    "authorization_config",
    "connect_as",
    "connect_options",
    "declare_topology",
    "find_nats_server",
    "flush_all",
    "free_port",
    "generate_credentials",
    "load_credentials",
    "permissions_for",
    "quote",
    "read_feed",
    "render_server_config",
    "reply_allowed",
    "write_server_config",
]
