"""Least-privilege NATS identities: one NKey per role instance, and their permissions.

Four roles talk over NATS, and each gets exactly the subjects its job needs
(allow lists only: the server denies everything a user's list does not name):

- the ledger service (`ledger`): owns streams and consumers, answers requests;
- an agent host (`host`): proposes and asks for status under its own name only;
- the executors of one tool (`exec`): fetch and acknowledge that tool's work,
  ask for leases and publish results for that tool only;
- an auditor (`auditor`): reads the feed through its consumer and by sequence
  (direct gets), publishes nothing else;
- an operator (`operator`) and an approver (`approver`): a person's tool, each
  with one request subject of its own (`ops.operate.<name>`,
  `ops.approve.<name>`), so the ledger knows who acts from the subject the
  broker let them publish to, never from what they say.

Nobody may subscribe to `_INBOX.>` (it would receive everyone's replies): every
identity has a private inbox prefix (`schemas.inbox_prefix`) that its client
must use, which `connect_options` sets. Nobody but the ledger may create
consumers: a consumer's creator picks its filter, and could read any subject
through it (nats-server issue #3295).

Permissions alone are not enough for the roles that talk to JetStream. The
server never checks the reply subject of a request against the requester's
rights, and JetStream answers a pull request by delivering messages to that
reply subject, inside the account. An executor could pull its own work item
with reply `ops.feed.x` and have the feed stream store it, or publish a
result with reply `ops.exec.<other tool>` and have the PubAck land in another
tool's work queue. So the streams live in their own account (`LEDGER`, with
the ledger service and the agent hosts, who use no JetStream subject), and
each tool's executors in an account of their own (`EXEC_<tool>`), the
auditors in `AUDIT`. Those accounts import from `LEDGER` exactly the subjects
their users may publish, as services: the server then replaces every reply
subject by a private one that leads back into the importing account, where
no stream listens. JetStream is enabled in `LEDGER` only.

Acknowledgement subjects need pinning to the last token. A consumer listens
for acks on two patterns (nats-server `consumer.go`, where it sets `ackSubjOld`
and `ackSubj`), in the streams' account:

- v1: `$JS.ACK.<stream>.<consumer>.*.*.*.*.*`, exactly 9 tokens;
- v2: `$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.*.*.*.*.>`, 11 or
  more, where the domain is `_` without a JetStream domain (we configure none)
  and the hash is `getHash(<account>)` (`account_hash`).

The five free tokens are the delivery count, stream and consumer sequence,
timestamp and pending count. The server sends v1 ack replies unless the
feature flag `js_ack_fc_v2` is on; v2 replies have exactly 11 tokens (the
reply template has five numbers; the trailing `>` of the subscription is only
room for a later extension). An ack subject that reaches a consumer is a
command to it: `+NXT` on it is a pull request served to the reply subject, so
a grant that matched another consumer's route would let a role read, hold and
redeliver that consumer's messages. The old grant `$JS.ACK.*.*.OPS_WORK.exec_<tool>.>`
did exactly that: `$JS.ACK.OPS_FEED.feed_auditor.OPS_WORK.exec_<tool>.1.1.1` is
a v1 route of `feed_auditor`.

So each role gets exactly two ack subjects, for its own consumer, with every
token literal but the five numbers (`_ack_subjects`):

- `$JS.ACK.<stream>.<consumer>.*.*.*.*.*`: exactly 9 tokens, so it matches no
  v2 route (at least 11); a v1 route has the stream in token 3 and the consumer
  in token 4, both literal here, so the only v1 route it matches is our own.
- `$JS.ACK._.<hash of LEDGER>.<stream>.<consumer>.*.*.*.*.*`: exactly 11 tokens,
  so it matches no v1 route (exactly 9); a v2 route has domain, account hash,
  stream and consumer in tokens 3 to 6, all literal here, so the only v2 route
  it matches is our own. No 12-token form is granted: the server sends none.

Stream and consumer names cannot contain `.`, `*` or `>`, so no name can shift
a token into another position, and a published subject is literal: a `*` in
it is an ordinary token, not a wildcard. The accounts import exactly these
subjects, so an import cannot widen them either. Should a server one day send
acks in a form not granted (a JetStream domain, a 12th token), acks are
refused with a permissions violation and redelivered: it fails closed, and
`tests/nats/test_ack_routes.py` checks the forms against the bundled server.

No role may publish `$JS.FC.` (flow control, for push consumers; ours are
pull consumers), and every other JetStream subject granted, but the ledger's
administrator wildcards, is literal:
`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>` is the one subject that
consumer's pull subscription listens on, and the auditor's
`$JS.API.DIRECT.GET.OPS_FEED` is the one subject the feed stream's direct
get listens on (the per-subject form, `$JS.API.DIRECT.GET.OPS_FEED.<subject>`,
is another subject and not granted).

The server stores only the public keys (`U...`); each process keeps its seed
file (mode 0600) and signs the server's nonce with it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import nkeys  # type: ignore[import-untyped]  # nkeys ships no type information

from ledger.nats._conf import ClusterOptions, ServerSettings, quote, render_server_config
from ledger.nats.errors import CredentialsError, UnknownIdentity
from schemas import (
    FEED_AUDITOR_CONSUMER,
    FEED_STREAM,
    WORK_STREAM,
    Subjects,
    check_token,
    inbox_prefix,
    work_consumer,
)

__all__ = [
    "AUDIT_ACCOUNT",
    "JS_DOMAIN_TOKEN",
    "LEDGER_ACCOUNT",
    "LEDGER_USERS_END",
    "MANIFEST_NAME",
    "CredentialSet",
    "Identity",
    "Permissions",
    "ResponsePermission",
    "Role",
    "account_hash",
    "account_of",
    "authorization_config",
    "connect_options",
    "generate_credentials",
    "load_credentials",
    "new_user_seed",
    "nonce_signature",
    "permissions_for",
    "reply_allowed",
    "user_entry",
    "write_server_config",
]

MANIFEST_NAME = "identities.json"
"""The file, next to the seeds, listing every identity (no secrets in it)."""


class Role(StrEnum):
    """What a NATS identity is for. The value is the role token of its inbox prefix."""

    LEDGER = "ledger"
    HOST = "host"
    EXECUTOR = "exec"
    AUDITOR = "auditor"
    OPERATOR = "operator"
    """A person's tool (`OperatorClient`): settles unknown outcomes and cancels."""
    APPROVER = "approver"
    """A person's tool (`ApproverClient`): approves or denies calls. Which approver
    roles the person holds is the ledger service's configuration, not theirs."""


@dataclass(frozen=True)
class ResponsePermission:
    """`allow_responses`: publish to the reply subject of a request this user received.

    `max` replies per request, within `expires`. The server's own default for
    `allow_responses: true` is one reply within two minutes; we write it out
    explicitly so the config says what it grants.
    """

    max: int = 1
    expires: str = "2m"


@dataclass(frozen=True)
class Permissions:
    """The subjects one user may publish and subscribe to; everything else is denied."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: ResponsePermission | None = None


LEDGER_ACCOUNT = "LEDGER"
"""The account of the streams, the ledger service and the agent hosts."""
AUDIT_ACCOUNT = "AUDIT"
"""The account of the auditors."""

JS_DOMAIN_TOKEN = "_"
"""The domain token of v2 ack subjects on a server without a JetStream domain (ours)."""

# nats-server's `digits` and `base` (accounts.go), which `getHashSize` maps bytes to.
_HASH_DIGITS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_HASH_LEN = 8  # `sysHashLen` (events.go)
# One `*` per number of an ack subject: delivery count, stream sequence,
# consumer sequence, timestamp, pending count.
_ACK_NUMBERS = ".*.*.*.*.*"


def account_hash(account: str) -> str:
    """nats-server's `getHash(account)`: the account token of v2 ack subjects.

    The first 8 bytes of SHA-256 of the name, each mapped to one of 62
    alphanumerics by its value modulo 62 (`getHashSize` in server/events.go).
    """
    digest = hashlib.sha256(account.encode()).digest()
    return "".join(_HASH_DIGITS[byte % len(_HASH_DIGITS)] for byte in digest[:_HASH_LEN])


def _ack_subjects(stream: str, consumer: str) -> tuple[str, str]:
    """Both forms of one consumer's ack subjects, every token but the numbers literal.

    v1: `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`, 9 tokens;
    v2: `$JS.ACK._.<hash of LEDGER>.<stream>.<consumer>.` and the same five, 11 tokens.
    A server sends one of them (v1 unless `js_ack_fc_v2` is on); both are granted so
    that switching the flag does not stop acknowledgements. Why neither can reach
    another consumer: see the module docstring.
    """
    return (
        f"$JS.ACK.{stream}.{consumer}{_ACK_NUMBERS}",
        f"$JS.ACK.{JS_DOMAIN_TOKEN}.{account_hash(LEDGER_ACCOUNT)}.{stream}.{consumer}"
        f"{_ACK_NUMBERS}",
    )


def _next_subject(stream: str, consumer: str) -> str:
    """The subject a pull client publishes to, to fetch from one existing consumer."""
    return f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"


def _direct_get_subject(stream: str) -> str:
    """Where a stream with `allow_direct` answers reads by sequence (one message or a batch)."""
    return f"$JS.API.DIRECT.GET.{stream}"


def permissions_for(role: Role, name: str) -> Permissions:
    """Exactly what identity `name` of `role` may do (see the module docstring)."""
    name = check_token(name)
    inbox = f"{inbox_prefix(role.value, name)}.>"
    if role is Role.LEDGER:
        return Permissions(
            publish=(
                # The ledger is the JetStream administrator: it creates and updates
                # the streams and consumers, fetches its results, reads stream state.
                "$JS.API.>",
                Subjects.all_work(any_depth=True),
                Subjects.all_feed(),
                Subjects.all_outcomes(),
                # Acks for its results consumer. It already holds `$JS.API.>`, so a
                # narrower ack grant would protect nothing.
                "$JS.ACK.>",
            ),
            subscribe=(
                Subjects.all_proposals(),
                Subjects.all_status_requests(),
                Subjects.all_cancel_requests(),
                Subjects.all_plan_requests(),
                Subjects.all_tool_requests(),
                Subjects.all_operator_requests(),
                Subjects.all_approver_requests(),
                Subjects.all_lease_requests(),
                inbox,
            ),
            # Replies to proposals and status requests go to the host's private
            # inbox, replies to lease requests to the `_R_.` subject of the
            # executor's import; the ledger may otherwise publish to neither.
            allow_responses=ResponsePermission(),
        )
    if role is Role.OPERATOR:
        # One request subject of its own (the ledger records who settled what by
        # it) and its inbox: no JetStream, no host's or executor's subject.
        return Permissions(publish=(Subjects.operate(name),), subscribe=(inbox,))
    if role is Role.APPROVER:
        # The same shape: the subject is the approver's name, so no approver can
        # speak for another (the server refuses the publish).
        return Permissions(publish=(Subjects.approve(name),), subscribe=(inbox,))
    if role is Role.HOST:
        return Permissions(
            publish=(
                Subjects.propose(name),
                Subjects.status(name),
                Subjects.cancel(name),
                Subjects.plan(name),
                Subjects.tools(name),
            ),
            subscribe=(Subjects.all_outcomes(name), inbox),
        )
    if role is Role.EXECUTOR:
        consumer = work_consumer(name)
        return Permissions(
            publish=(
                # Fetch from the tool's existing consumer only; never create one
                # (no `$JS.API.CONSUMER.CREATE`), never look at streams.
                _next_subject(WORK_STREAM, consumer),
                *_ack_subjects(WORK_STREAM, consumer),
                # A JetStream publish is an ordinary publish with a reply inbox: the
                # PubAck arrives on the executor's own inbox, nothing more is needed.
                Subjects.result(name),
                Subjects.lease(name),
            ),
            subscribe=(inbox,),
        )
    if role is Role.AUDITOR:
        return Permissions(
            publish=(
                _next_subject(FEED_STREAM, FEED_AUDITOR_CONSUMER),
                *_ack_subjects(FEED_STREAM, FEED_AUDITOR_CONSUMER),
                # Reading the whole feed by sequence (`ledger.nats.feed_reader`):
                # the durable consumer cannot go back to what was acked. No
                # `$JS.API.STREAM.INFO.OPS_FEED`: through an import, the JetStream
                # API answers for the requester's own account, which has none; a
                # direct get of the last message gives the last sequence instead.
                _direct_get_subject(FEED_STREAM),
            ),
            subscribe=(inbox,),
        )
    raise ValueError(f"unknown role {role!r}")  # pragma: no cover - exhaustive enum


@dataclass(frozen=True)
class Identity:
    """One NATS user: its role, its name, where its seed lives, and its public key."""

    role: Role
    name: str
    seed_path: Path
    public_key: str

    @property
    def inbox_prefix(self) -> str:
        """The private inbox prefix this identity's client must use."""
        return inbox_prefix(self.role.value, self.name)

    @property
    def permissions(self) -> Permissions:
        """What this identity may publish and subscribe to."""
        return permissions_for(self.role, self.name)

    @classmethod
    def from_seed_file(cls, role: Role, name: str, seed_path: Path) -> Identity:
        """The identity whose user seed is in `seed_path`; its public key is derived."""
        return cls(role, check_token(name), seed_path, _public_key(_read_seed(seed_path)))


def new_user_seed() -> bytes:
    """A fresh NKey user seed (`SU...`), from 32 random bytes, encoded by the nkeys library."""
    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))


def _public_key(seed: bytes) -> str:
    try:
        keypair = nkeys.from_seed(bytearray(seed))
    except nkeys.NkeysError as exc:
        raise CredentialsError(f"not a valid NKey seed ({type(exc).__name__})") from exc
    try:
        return str(keypair.public_key.decode())
    finally:
        # Best effort, as nats-py does: do not leave the private key around.
        keypair.wipe()


def nonce_signature(identity: Identity, nonce: bytes) -> str:
    """The `sig` of a NATS `CONNECT` as `identity`: the server's nonce signed with its seed.

    Base64 (URL-safe, unpadded), as nats-server decodes it. For clients that speak
    the protocol themselves (the supervisor's readiness probe); nats-py signs on
    its own from `connect_options`.
    """
    try:
        keypair = nkeys.from_seed(bytearray(_read_seed(identity.seed_path)))
    except nkeys.NkeysError as exc:
        raise CredentialsError(f"not a valid NKey seed ({type(exc).__name__})") from exc
    try:
        signed = bytes(keypair.sign(nonce))
    finally:
        keypair.wipe()
    return base64.urlsafe_b64encode(signed).decode().rstrip("=")


def _read_seed(path: Path) -> bytes:
    try:
        seed = path.read_bytes().strip()
    except OSError as exc:
        raise CredentialsError(f"cannot read seed file {path}: {exc.strerror}") from exc
    if not seed.startswith(b"SU"):
        raise CredentialsError(f"{path} does not hold an NKey user seed (SU...)")
    return seed


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` with mode 0600 from the start, replacing it atomically.

    The temporary file is created 0600 by `mkstemp`, so the seed is never
    readable by others, not even between creation and a chmod.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class CredentialSet:
    """Every identity of one deployment, and the server's `accounts` block for them."""

    directory: Path
    identities: tuple[Identity, ...]

    @property
    def authorization_config(self) -> str:
        """The `accounts { ... }` block for the server's config file (`authorization_config`).

        Named for what it is for: since executors and auditors got accounts of
        their own, the users are no longer a plain `authorization` block.
        """
        return authorization_config(self.identities)

    def get(self, role: Role, name: str) -> Identity:
        """The identity `name` of `role`; `UnknownIdentity` (a `KeyError`) if there is none."""
        for identity in self.identities:
            if identity.role is role and identity.name == name:
                return identity
        raise UnknownIdentity(f"no {role.value} identity named {name!r}")

    @property
    def ledger(self) -> Identity:
        """The ledger service's identity."""
        return next(i for i in self.identities if i.role is Role.LEDGER)

    def host(self, name: str) -> Identity:
        """Agent host `name`'s identity."""
        return self.get(Role.HOST, name)

    def executor(self, tool: str) -> Identity:
        """The identity shared by the executors of `tool`."""
        return self.get(Role.EXECUTOR, tool)

    def auditor(self, name: str = "auditor") -> Identity:
        """Auditor `name`'s identity."""
        return self.get(Role.AUDITOR, name)

    def operator(self, name: str) -> Identity:
        """Operator `name`'s identity."""
        return self.get(Role.OPERATOR, name)

    def approver(self, name: str) -> Identity:
        """Approver `name`'s identity."""
        return self.get(Role.APPROVER, name)


def _manifest(identities: Iterable[Identity]) -> str:
    entries = [
        {
            "role": i.role.value,
            "name": i.name,
            "seed_file": i.seed_path.name,
            "public_key": i.public_key,
        }
        for i in identities
    ]
    return json.dumps({"version": 1, "identities": entries}, indent=2) + "\n"


def generate_credentials(
    directory: Path | str,
    *,
    hosts: Sequence[str],
    tools: Sequence[str],
    auditors: Sequence[str] = ("auditor",),
    ledger: str = "ledger",
    operators: Sequence[str] = (),
    approvers: Sequence[str] = (),
) -> CredentialSet:
    """Create a fresh seed per identity in `directory` (mode 0600) and a manifest.

    Existing seed files of the same names are replaced: generating again rotates
    every key, and the server config must then be rewritten and reloaded.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # The directory holds secrets: keep others out of it too (no-op if not ours).
    os.chmod(directory, 0o700)
    wanted: list[tuple[Role, str]] = [(Role.LEDGER, ledger)]
    wanted += [(Role.HOST, h) for h in hosts]
    wanted += [(Role.EXECUTOR, t) for t in tools]
    wanted += [(Role.AUDITOR, a) for a in auditors]
    wanted += [(Role.OPERATOR, o) for o in operators]
    wanted += [(Role.APPROVER, a) for a in approvers]
    seen: set[tuple[Role, str]] = set()
    identities: list[Identity] = []
    for role, name in wanted:
        check_token(name)
        if (role, name) in seen:
            raise CredentialsError(f"duplicate {role.value} identity {name!r}")
        seen.add((role, name))
        seed = new_user_seed()
        path = directory / f"{role.value}-{name}.nk"
        _write_private(path, seed + b"\n")
        identities.append(Identity(role, name, path, _public_key(seed)))
    (directory / MANIFEST_NAME).write_text(_manifest(identities), encoding="utf-8")
    return CredentialSet(directory, tuple(identities))


def load_credentials(directory: Path | str) -> CredentialSet:
    """The identities generated earlier in `directory`, checked against their seeds."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        entries = manifest["identities"]
        identities = []
        for entry in entries:
            identity = Identity.from_seed_file(
                Role(entry["role"]), entry["name"], directory / entry["seed_file"]
            )
            if identity.public_key != entry["public_key"]:
                raise CredentialsError(
                    f"{identity.seed_path} does not match the public key in {manifest_path}"
                )
            identities.append(identity)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CredentialsError(f"unusable credentials manifest {manifest_path}: {exc}") from exc
    return CredentialSet(directory, tuple(identities))


def _subject_list(subjects: Sequence[str]) -> str:
    return "[" + ", ".join(quote(s) for s in subjects) + "]"


def account_of(role: Role, name: str) -> str:
    """The NATS account identity `name` of `role` belongs to (see the module docstring)."""
    if role is Role.EXECUTOR:
        return f"EXEC_{check_token(name)}"
    if role is Role.AUDITOR:
        return AUDIT_ACCOUNT
    return LEDGER_ACCOUNT


def user_entry(identity: Identity) -> str:
    """One NKey user with its permissions, as an entry of an account's `users` list."""
    return "\n".join(_user_lines(identity)) + "\n"


def _user_lines(identity: Identity) -> list[str]:
    perms = identity.permissions
    lines = [
        "      {",
        f"        # {identity.role.value} {identity.name}",
        f"        nkey: {quote(identity.public_key)}",
        "        permissions: {",
        f"          publish: {{ allow: {_subject_list(perms.publish)} }}",
        f"          subscribe: {{ allow: {_subject_list(perms.subscribe)} }}",
    ]
    if perms.allow_responses is not None:
        rp = perms.allow_responses
        lines.append(
            f"          allow_responses: {{ max: {rp.max}, expires: {quote(rp.expires)} }}"
        )
    return [*lines, "        }", "      }"]


def _is_streamed(subject: str) -> bool:
    # A pull request is answered by many messages over its lifetime, and a batched
    # direct get by the batch and an end-of-batch status: not by one reply.
    return subject.startswith(("$JS.API.CONSUMER.MSG.NEXT.", "$JS.API.DIRECT.GET."))


LEDGER_USERS_END = "    ]  # end of LEDGER users"
"""The line that closes the `LEDGER` account's user list: where the bench and the
permission tests add a user of their own, so they need no second renderer."""


def authorization_config(identities: Iterable[Identity]) -> str:
    """The server's `accounts { ... }` block: accounts, NKey users, exports and imports.

    Every user has allow lists only. An executor's or auditor's account
    imports from `LEDGER` exactly the subjects its users may publish, and
    `LEDGER` exports each only to that account.
    """
    members: dict[str, list[Identity]] = {}
    for identity in identities:
        members.setdefault(account_of(identity.role, identity.name), []).append(identity)
    imports: dict[str, list[str]] = {}
    for account, users in members.items():
        if account != LEDGER_ACCOUNT:
            # All of an account's users share one role: the same subjects, by name.
            wanted = (subject for user in users for subject in user.permissions.publish)
            imports[account] = list(dict.fromkeys(wanted))
    lines = ["accounts {", f"  {LEDGER_ACCOUNT} {{", "    jetstream: enabled", "    users: ["]
    for identity in members.get(LEDGER_ACCOUNT, []):
        lines += _user_lines(identity)
    lines += [LEDGER_USERS_END, "    exports: ["]
    for account, subjects in imports.items():
        for subject in subjects:
            streamed = ", response_type: stream" if _is_streamed(subject) else ""
            lines.append(
                f"      {{ service: {quote(subject)}, accounts: [{quote(account)}]{streamed} }}"
            )
    lines += ["    ]", "  }"]
    for account, subjects in imports.items():
        lines += [f"  {quote(account)} {{", "    users: ["]
        for identity in members[account]:
            lines += _user_lines(identity)
        lines += ["    ]", "    imports: ["]
        lines += [
            f"      {{ service: {{ account: {LEDGER_ACCOUNT}, subject: {quote(subject)} }} }}"
            for subject in subjects
        ]
        lines += ["    ]", "  }"]
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_server_config(
    path: Path | str,
    credentials: CredentialSet,
    *,
    port: int,
    store_dir: Path | str,
    server_name: str,
    host: str = "127.0.0.1",
    monitor_port: int | None = None,
    cluster: ClusterOptions | None = None,
) -> Path:
    """Write a complete nats-server config (JetStream, listen address, users) to `path`.

    The file names public keys only, but it is still written 0600: it describes
    who may do what, which is nobody else's business.
    """
    path = Path(path)
    settings = ServerSettings(
        server_name=server_name,
        port=port,
        host=host,
        store_dir=Path(store_dir),
        monitor_port=monitor_port,
        cluster=cluster,
        authorization=credentials.authorization_config,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_private(path, render_server_config(settings).encode())
    return path


# Which requester may send a request on each request subject the ledger serves.
_REQUESTER_ROLE = {
    "propose": Role.HOST,
    "status": Role.HOST,
    "cancel": Role.HOST,
    "plan": Role.HOST,
    "tools": Role.HOST,
    "operate": Role.OPERATOR,
    "approve": Role.APPROVER,
    "lease": Role.EXECUTOR,
}
# The reply subject the server gives a request that came through a service import.
_IMPORTED_REPLY = "_R_"


def reply_allowed(request_subject: str, reply: str | None) -> bool:
    """Whether the ledger may answer a request on `request_subject` at `reply`.

    The server does not check the reply subject a client puts on a message, and
    `allow_responses` lets the ledger publish to whatever that subject is. So a
    host could send a proposal with reply `ops.exec.<tool>` or
    `ops.outcome.<other host>.<op>` and have the ledger publish its answer there,
    with the ledger's authority (verified against nats-server 2.15.1 in
    tests/nats/test_permissions.py). The ledger service must therefore answer only
    replies inside the private inbox of the identity the request subject belongs
    to: `ops.propose.H` / `ops.status.H` -> `_INBOX_host_H.`. A lease request
    `ops.lease.T` comes from T's own account through its import, and the server
    has already replaced its reply by a `_R_.` subject that leads back there
    and nowhere else; no identity in `LEDGER` but the ledger may publish lease
    requests. Anything else is dropped (and worth logging).
    """
    if not reply:
        return False
    parts = request_subject.split(".")
    if len(parts) != 3 or parts[0] != "ops" or parts[1] not in _REQUESTER_ROLE:
        return False
    role = _REQUESTER_ROLE[parts[1]]
    try:
        check_token(parts[2])
        prefix = _IMPORTED_REPLY if role is Role.EXECUTOR else inbox_prefix(role.value, parts[2])
    except ValueError:
        return False
    prefix += "."
    rest = reply[len(prefix) :]
    return (
        reply.startswith(prefix)
        and rest != ""
        and all(token not in ("", "*", ">") for token in rest.split("."))
    )


def connect_options(identity: Identity) -> dict[str, Any]:
    """Keyword arguments for `nats.connect(servers, **connect_options(identity))`.

    - `nkeys_seed`: the seed file's path; nats-py (2.16) reads it when signing the
      server's nonce, and wipes the key pair after each use.
    - `inbox_prefix`: the identity's private prefix; with the default `_INBOX`
      every request would fail, since nobody may subscribe to `_INBOX.>`.
    - `name`: shows the role and name in the server's connection list.

    A JetStream pull consumer must then be bound with `js.pull_subscribe_bind(...)`,
    which uses the connection's inbox prefix and looks nothing up.
    """
    return {
        "nkeys_seed": str(identity.seed_path),
        "inbox_prefix": identity.inbox_prefix,
        "name": f"opledger-{identity.role.value}-{identity.name}",
    }
