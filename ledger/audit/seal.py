"""The seal: the global digest chain, signed by the ledger service's own key.

The digest chain (`opledger_digest`) binds every event, in the global order,
to every event before it: row N holds the hash of the event at position N
and the running digest over all of them. On its own it proves nothing, since
anyone who can read the events can compute it, and so could anyone who
changes them. So only the holder of the seal key writes it: the `Sealer`,
run by the ledger service, extends the chain one batch at a time and signs
the batch's head (its last position, the running digest there, and the time)
with the service's Ed25519 NKey, one signature per batch. The signatures live
in a table of their own (`opledger_seal_signatures`).

An auditor checks the signatures with public keys they trust (the ledger
identity's `U...` key, from the credentials manifest or given by hand), never
with a key found in the database: whoever can write the database could sign
with a key of their own and store it next to the signatures. Verification
(`ledger.audit.verify`) then knows the last head the service signed; events
after it are not vouched for by anyone, and are findings once older than the
seal grace.

A signed head printed by `opledger audit head` can be kept elsewhere (an
anchor) and given back to `opledger audit verify --expect-head`: a ledger cut
back to before it, seal rows and signatures included, no longer contains it.
"""

from __future__ import annotations

import base64
import binascii
import copy
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nacl.exceptions
import nacl.signing
import nkeys  # type: ignore[import-untyped]  # nkeys ships no type information
from eventsourcing.persistence import ApplicationRecorder, Notification

from ledger.adapters.sql import SqlDatabase
from ledger.domain.hashing import GENESIS_HASH, chain_digest, stored_event_hash
from schemas import ErrorCategory, OpledgerError

__all__ = [
    "DIGEST_TABLE",
    "SIGNATURES_TABLE",
    "SealKey",
    "SealKeyError",
    "SealRefused",
    "Sealer",
    "SignedHead",
    "TrustedKeys",
    "digest_rows",
    "head_message",
    "seal_time",
]

DIGEST_TABLE = "opledger_digest"
"""The digest chain: (notification ID, operation, version, event hash, running digest)."""

SIGNATURES_TABLE = "opledger_seal_signatures"
"""One signed head per sealed batch."""

_FORMAT = "opledger-seal/1"
_ANCHOR = "opledger-head/1"
_POSITION_NAME = "seal"

SCHEMA = [
    f"""CREATE TABLE IF NOT EXISTS {DIGEST_TABLE} (
        notification_id BIGINT PRIMARY KEY,
        operation_id TEXT NOT NULL,
        version INTEGER NOT NULL,
        event_hash TEXT NOT NULL,
        running_digest TEXT NOT NULL
    )""",
    f"""CREATE TABLE IF NOT EXISTS {SIGNATURES_TABLE} (
        position BIGINT PRIMARY KEY,
        running_digest TEXT NOT NULL,
        sealed_at TEXT NOT NULL,
        public_key TEXT NOT NULL,
        signature TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS opledger_positions (
        name TEXT PRIMARY KEY,
        position BIGINT NOT NULL
    )""",
]


def digest_rows(db: SqlDatabase) -> Sequence[tuple[int, str, int, str, str]]:
    """The digest chain as stored: (notification ID, operation, version, event hash,
    running digest), in the global order."""
    # Both drivers already return these types: no per-row conversion.
    return db.query(
        "SELECT notification_id, operation_id, version, event_hash, running_digest"
        f" FROM {DIGEST_TABLE} ORDER BY notification_id"
    )


class SealRefused(OpledgerError):
    """The sealer will not extend a chain it cannot vouch for (see `Sealer.head`)."""

    category = ErrorCategory.INTERNAL
    code = "SEAL_REFUSED"


class SealKeyError(OpledgerError):
    """A seal key or public key cannot be used (not an NKey, unreadable, wrong kind)."""

    category = ErrorCategory.INVALID_INPUT
    code = "INVALID_SEAL_KEY"


def seal_time(moment: datetime) -> str:
    """A moment as the fixed-width UTC text that heads are signed with."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def head_message(position: int, digest: str, sealed_at: str) -> bytes:
    """The exact bytes a head's signature covers."""
    return f"{_FORMAT}\n{position}\n{digest}\n{sealed_at}\n".encode()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _verify_key(public_key: str) -> nacl.signing.VerifyKey:
    """The Ed25519 key inside an NKey user public key (`U...`), checksum checked."""
    try:
        raw = base64.b32decode(public_key.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise SealKeyError(f"not an NKey public key: {public_key[:12]!r}...") from None
    if len(raw) != 35 or raw[0] != nkeys.PREFIX_BYTE_USER:
        raise SealKeyError(f"not an NKey user public key (U...): {public_key[:12]!r}...")
    if int.from_bytes(raw[33:], "little") != nkeys.crc16(bytearray(raw[:33])):
        raise SealKeyError(f"the public key's checksum is wrong: {public_key[:12]!r}...")
    return nacl.signing.VerifyKey(raw[1:33])


class TrustedKeys:
    """The public keys an auditor trusts, and a check of signatures against them."""

    def __init__(self, public_keys: Iterable[str] = ()) -> None:
        self._keys = {key: _verify_key(key) for key in dict.fromkeys(public_keys)}

    @property
    def public_keys(self) -> tuple[str, ...]:
        """The trusted keys, in the order given."""
        return tuple(self._keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def trusts(self, public_key: str) -> bool:
        """Whether `public_key` is one of the trusted keys."""
        return public_key in self._keys

    def valid(self, head: SignedHead) -> bool:
        """Whether `head` is signed by the trusted key it names."""
        key = self._keys.get(head.public_key)
        return key is not None and _signature_ok(key, head)


def _signature_ok(key: nacl.signing.VerifyKey, head: SignedHead) -> bool:
    try:
        key.verify(head.message(), _unb64(head.signature))
    except (nacl.exceptions.BadSignatureError, binascii.Error, ValueError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class SignedHead:
    """A signed head of the digest chain: position, running digest, time, key, signature."""

    position: int
    digest: str
    sealed_at: str
    public_key: str
    signature: str

    def message(self) -> bytes:
        """The bytes the signature covers."""
        return head_message(self.position, self.digest, self.sealed_at)

    def self_signed(self) -> bool:
        """Whether the signature verifies with the key the head names (trust it not for that)."""
        try:
            return _signature_ok(_verify_key(self.public_key), self)
        except SealKeyError:
            return False

    def anchor(self) -> str:
        """One line to keep elsewhere and give back to `audit verify --expect-head`."""
        return ":".join(
            (
                _ANCHOR,
                str(self.position),
                self.digest,
                self.sealed_at,
                self.public_key,
                self.signature,
            )
        )

    @classmethod
    def from_anchor(cls, text: str) -> SignedHead:
        """Parse what `anchor` printed; ValueError if it is not one."""
        parts = text.strip().split(":")
        # The time holds colons of its own: prefix, position, digest, time (3 parts), key, sig.
        if len(parts) != 8 or parts[0] != _ANCHOR:
            raise ValueError("not a signed head printed by `opledger audit head`")
        position, digest = int(parts[1]), parts[2]
        sealed_at, public_key, signature = ":".join(parts[3:6]), parts[6], parts[7]
        return cls(position, digest, sealed_at, public_key, signature)

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> SignedHead:
        """From a row of the signatures table (position, digest, time, key, signature)."""
        return cls(int(row[0]), str(row[1]), str(row[2]), str(row[3]), str(row[4]))


class SealKey:
    """The ledger service's seal key: its NKey (an Ed25519 key), which only it holds."""

    def __init__(self, seed: bytes) -> None:
        try:
            self._keypair = nkeys.from_seed(bytearray(seed.strip()))
            self.public_key: str = self._keypair.public_key.decode()
        except (nkeys.NkeysError, ValueError, binascii.Error) as exc:
            raise SealKeyError(f"not a valid NKey seed ({type(exc).__name__})") from None
        if not self.public_key.startswith("U"):
            raise SealKeyError("the seal key must be an NKey user seed (SU...)")

    @classmethod
    def from_seed_file(cls, path: Path | str) -> SealKey:
        """The key whose seed is in `path` (the service's `--creds` file)."""
        try:
            seed = Path(path).read_bytes()
        except OSError as exc:
            raise SealKeyError(f"cannot read seed file {path}: {exc.strerror}") from None
        return cls(seed)

    @classmethod
    def generate(cls) -> SealKey:
        """A fresh random key (for tests and benchmarks)."""
        return cls(bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)))

    def sign(self, position: int, digest: str, sealed_at: str) -> SignedHead:
        """The signed head at `position`."""
        signature = self._keypair.sign(head_message(position, digest, sealed_at))
        return SignedHead(position, digest, sealed_at, self.public_key, _b64(bytes(signature)))

    def signed(self, head: SignedHead) -> bool:
        """Whether `head` carries this key's valid signature."""
        return head.public_key == self.public_key and head.self_signed()


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Sealer:
    """Extends the digest chain and signs its head, batch by batch: the seal's only writer.

    It continues from the last head signed with its own key or with one of
    `previous_keys` (the keys it had before a rotation), and recomputes any
    seal rows stored after that head: they are nobody's it can vouch for.

    It never continues from a head it cannot vouch for: signature rows that
    none of its keys made, none left although there are events it did not
    watch arrive, or fewer than it signed itself, mean that someone rewrote
    the seal, and sealing on top would sign their version. It refuses
    (`SealRefused`) until an operator decides: a rotated key is given as a
    previous key, or `seal_existing` says to seal a ledger that was never
    sealed (one from before signed heads, or after a deliberate reset), from
    its first event, once.
    """

    def __init__(
        self,
        db: SqlDatabase,
        recorder: ApplicationRecorder,
        key: SealKey,
        *,
        previous_keys: Iterable[str] = (),
        seal_existing: bool = False,
        every: timedelta = timedelta(0),
        batch_size: int = 500,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self._db = db
        self._recorder = recorder
        self.key = key
        self._trusted = TrustedKeys([key.public_key, *previous_keys])
        self._batch_size = batch_size
        self._clock = clock
        self._every = every.total_seconds()
        self._sealed_at = float("-inf")
        self._head: SignedHead | None = None  # the last head known good, cached
        self._signed_up_to = 0  # the last position this process signed itself
        with db.creating():
            for statement in SCHEMA:
                db.execute(statement)
            db.execute(
                "INSERT INTO opledger_positions (name, position) VALUES (?, 0)"
                " ON CONFLICT (name) DO NOTHING",
                (_POSITION_NAME,),
            )
        # A ledger without a signed head may be sealed from its first event
        # only if it had no events when this sealer started (it sees every
        # one arrive), or when the operator says so: the database alone can
        # not tell a ledger never sealed from one whose seal was erased.
        self._may_start = seal_existing or not recorder.select_notifications(start=0, limit=1)

    def on(self, db: SqlDatabase) -> Sealer:
        """This sealer (key, previous keys, pace, and its memory of what it signed),
        writing over another connection from now on, for a thread of its own. The
        original must seal no more (`ReadModels.moved_to` sees to it): two copies
        would each remember only part of what was signed, and that memory is what
        refuses a seal cut back or erased (`head`)."""
        twin = copy.copy(self)
        twin._db = db
        return twin

    def seal(
        self, known: tuple[int, Sequence[Notification]] = (0, ()), *, now: bool = False
    ) -> int:
        """Seal every event not yet sealed; returns how many.

        `known`: notifications just read after a position (the view's), in
        order; used instead of reading the log again where the seal starts at
        that same position. Unless `now`, at most once per `every`: the
        service refreshes its view every 20 ms under load, and a seal (its
        own transaction and signature) each time cost it about a millisecond
        per refresh; the seal grace is a minute.
        """
        moment = time.monotonic()
        if not now and moment - self._sealed_at < self._every:
            return 0
        self._sealed_at = moment
        total = 0
        after, notifications = known
        while True:
            count = self._seal_batch(after, notifications)
            total += count
            if count < self._batch_size:
                return total

    def head(self) -> SignedHead | None:
        """The head the next batch continues from (None: the chain starts afresh)."""
        rows = self._db.query(
            "SELECT position, running_digest, sealed_at, public_key, signature"
            f" FROM {SIGNATURES_TABLE} ORDER BY position DESC LIMIT 1"
        )
        if rows and self._head is not None and SignedHead.from_row(rows[0]) == self._head:
            return self._head  # what this process signed or checked last: no new check
        if not rows:
            if self._signed_up_to or not self._may_start:
                raise SealRefused(
                    "events are stored that no signed head covers, and no head is left:"
                    " not sealing them as they are (after a deliberate reset, or for a"
                    " ledger never sealed, start the service once with --seal-existing)"
                )
            self._head = None
            return None  # a ledger this sealer watched from its start: from the first event
        for row in self._db.query(
            "SELECT position, running_digest, sealed_at, public_key, signature"
            f" FROM {SIGNATURES_TABLE} ORDER BY position DESC"
        ):
            head = SignedHead.from_row(row)
            if self._trusted.valid(head):
                if head.position < self._signed_up_to:
                    raise SealRefused(
                        f"heads this service signed up to position {self._signed_up_to} are"
                        f" gone (the newest left is at {head.position}): not sealing over it"
                    )
                self._head = head
                return head
        raise SealRefused(
            "no seal signature is this service's (its key, or a --previous-seal-key):"
            " not sealing over a seal someone else signed"
        )

    def _seal_batch(self, after: int, known: Sequence[Notification]) -> int:
        db = self._db
        with db.transaction():
            lock = " FOR UPDATE" if db.is_postgres else ""
            # One sealer at a time, across service instances.
            db.query(f"SELECT position FROM opledger_positions WHERE name = ?{lock}", ("seal",))
            head = self.head()
            position, digest = (head.position, head.digest) if head else (0, GENESIS_HASH)
            db.execute(f"DELETE FROM {DIGEST_TABLE} WHERE notification_id > ?", (position,))
            notifications: Sequence[Notification]
            if known and position >= after and known[-1].id > position:
                # The view read these from `after` on: the ones after our head.
                notifications = [n for n in known if n.id > position][: self._batch_size]
            else:
                notifications = self._recorder.select_notifications(
                    start=position, limit=self._batch_size, inclusive_of_start=False
                )
            if not notifications:
                return 0
            rows: list[tuple[Any, ...]] = []
            for notification in notifications:
                event_hash = stored_event_hash(notification.topic, notification.state)
                digest = chain_digest(digest, event_hash)
                rows.append(
                    (
                        notification.id,
                        notification.originator_id,
                        notification.originator_version,
                        event_hash,
                        digest,
                    )
                )
            db.insert_rows(
                f"INSERT INTO {DIGEST_TABLE}"
                " (notification_id, operation_id, version, event_hash, running_digest)",
                rows,
            )
            signed = self.key.sign(notifications[-1].id, digest, seal_time(self._clock()))
            db.execute(
                f"INSERT INTO {SIGNATURES_TABLE}"
                " (position, running_digest, sealed_at, public_key, signature)"
                " VALUES (?, ?, ?, ?, ?)",
                (
                    signed.position,
                    signed.digest,
                    signed.sealed_at,
                    signed.public_key,
                    signed.signature,
                ),
            )
            db.execute(
                "UPDATE opledger_positions SET position = ? WHERE name = ?",
                (signed.position, _POSITION_NAME),
            )
        self._head = signed
        self._signed_up_to = signed.position
        return len(notifications)
