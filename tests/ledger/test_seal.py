"""The seal is signed by the ledger service's key; readers never seal; verify names what
nobody sealed, and signatures it cannot trust. On SQLite and PostgreSQL, through the CLI."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from ledger import Ledger, StorageConfig, build_ledger
from ledger.audit.seal import SealKey, SignedHead
from ledger.domain.hashing import stored_event_hash
from tests.ledger.helpers import (
    ALICE,
    SEAL_KEY,
    cli,
    cli_json,
    email,
    make_ledger,
    search,
    use_storage,
)

TRUST = ("--public-key", SEAL_KEY.public_key)


@pytest.fixture
def sealed(storage: StorageConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    """Three operations, sealed by the service's key in two batches; the CLI points here."""
    ledger = make_ledger(storage)
    ledger.submit(search("op-1"), ALICE)
    ledger.refresh()
    ledger.submit(search("op-2"), ALICE)
    ledger.submit(email("op-3"), ALICE)
    ledger.refresh()
    use_storage(monkeypatch, tmp_path, storage)
    return ledger


def _position_column(ledger: Ledger) -> str:
    return "notification_id" if ledger.db.is_postgres else "rowid"


def _append_forged(ledger: Ledger, operation_id: str, age: timedelta) -> int:
    """An event appended at the tail with a correct prev_hash, dated `age` ago."""
    column = _position_column(ledger)
    rows = ledger.db.query(
        f"SELECT {column}, originator_version, topic, state FROM {ledger.events_table}"
        f" WHERE originator_id = ? ORDER BY originator_version DESC LIMIT 1",
        (operation_id,),
    )
    _, version, topic, state = rows[0]
    forged: dict[str, Any] = orjson.loads(state)
    forged |= {
        "originator_version": version + 1,
        "prev_hash": stored_event_hash(topic, bytes(state)),
        "timestamp": (datetime.now(UTC) - age).isoformat(),
    }
    ((top,),) = ledger.db.query(f"SELECT MAX({column}) FROM {ledger.events_table}")
    ledger.db.execute(
        f"INSERT INTO {ledger.events_table}"
        f" (originator_id, originator_version, topic, state, {column}) VALUES (?, ?, ?, ?, ?)",
        (operation_id, version + 1, topic, orjson.dumps(forged), top + 1),
    )
    return int(top) + 1


def _seal_tables(ledger: Ledger) -> tuple[list[Any], list[Any]]:
    return (
        ledger.db.query("SELECT * FROM opledger_digest ORDER BY notification_id"),
        ledger.db.query("SELECT * FROM opledger_seal_signatures ORDER BY position"),
    )


def test_a_sealed_ledger_verifies_with_the_service_key(sealed: Ledger, capsys: Any) -> None:
    report = cli_json(capsys, "audit", "verify", *TRUST)

    assert report["ok"] is True
    assert report["signed_head"]["public_key"] == SEAL_KEY.public_key
    assert report["signed_head"]["position"] == report["events_checked"]
    assert report["events_past_signed_head"] == 0
    signatures = _seal_tables(sealed)[1]
    assert len(signatures) == 2  # one per sealed batch, not one per event


def test_a_forged_tail_event_is_named_and_no_read_command_seals_it(
    sealed: Ledger, capsys: Any
) -> None:
    position = _append_forged(sealed, "op-1", age=timedelta(minutes=10))
    seal_before = _seal_tables(sealed)

    code, out, _ = cli(capsys, "audit", "verify", *TRUST)
    assert code == 1
    assert (
        f"unsealed: #{position} op-1 v4: not sealed by a trusted key,"
        " though older than the seal grace"
    ) in out

    for command in (
        ["ops", "list"],
        ["ops", "show", "op-1"],
        ["approvals", "list"],
        ["audit", "export", "--output", os.devnull],
        ["audit", "head", *TRUST],
    ):
        code, _, err = cli(capsys, *command)
        assert code == 0, (command, err)
    assert _seal_tables(sealed) == seal_before  # nobody but the key holder seals

    report = cli_json(capsys, "audit", "verify", *TRUST, expect=1)
    assert [(f["kind"], f["notification_id"]) for f in report["findings"]] == [
        ("unsealed", position)
    ]


def test_a_fresh_unsealed_event_waits_for_the_seal_grace(sealed: Ledger, capsys: Any) -> None:
    sealed.submit(search("op-4"), ALICE)  # not sealed yet: the service would, within seconds

    report = cli_json(capsys, "audit", "verify", *TRUST)
    assert report["ok"] is True
    assert report["events_past_signed_head"] == 3

    code, out, _ = cli(capsys, "audit", "verify", *TRUST, "--seal-grace", "0")
    assert code == 1
    assert out.count("unsealed: #") == 3


def test_a_ledger_without_the_key_seals_nothing_and_verify_says_so(
    storage: StorageConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    ledger = make_ledger(storage, seal_key=None)
    ledger.submit(search("op-1"), ALICE)
    ledger.refresh()
    assert _seal_tables(ledger) == ([], [])
    use_storage(monkeypatch, tmp_path, storage)

    report = cli_json(capsys, "audit", "verify", *TRUST, "--seal-grace", "0", expect=1)
    assert report["signed_head"] is None
    assert [f["kind"] for f in report["findings"]] == ["unsealed"] * 3

    code, _, err = cli(capsys, "audit", "head", *TRUST)
    assert (code, err) == (
        2,
        "error: NO_SIGNED_HEAD: the ledger has no head signed by a trusted key\n",
    )


def test_a_head_signed_again_with_a_key_stored_beside_it_is_not_trusted(
    sealed: Ledger, capsys: Any
) -> None:
    _, signatures = _seal_tables(sealed)
    last = SignedHead.from_row(signatures[-1])
    forger = SealKey.generate()
    forged = forger.sign(last.position, last.digest, last.sealed_at)
    sealed.db.execute(
        "UPDATE opledger_seal_signatures SET public_key = ?, signature = ? WHERE position = ?",
        (forged.public_key, forged.signature, last.position),
    )

    report = cli_json(capsys, "audit", "verify", *TRUST, "--seal-grace", "0", expect=1)
    kinds = [f["kind"] for f in report["findings"]]
    assert "untrusted_key" in kinds
    assert any(forger.public_key in f["detail"] for f in report["findings"])
    assert report["signed_head"]["position"] == SignedHead.from_row(signatures[0]).position

    # Without a key from the auditor, none is taken from the database either.
    report = cli_json(capsys, "audit", "verify", expect=1)
    assert report["signed_head"] is None
    assert report["findings"][0]["detail"] == (
        "no trusted public key was given: no seal signature could be checked"
    )


def test_a_signature_changed_by_a_byte_does_not_verify(sealed: Ledger, capsys: Any) -> None:
    _, signatures = _seal_tables(sealed)
    first = SignedHead.from_row(signatures[0])
    flipped = ("A" if first.signature[0] != "A" else "B") + first.signature[1:]
    sealed.db.execute(
        "UPDATE opledger_seal_signatures SET signature = ? WHERE position = ?",
        (flipped, first.position),
    )

    code, out, _ = cli(capsys, "audit", "verify", *TRUST)
    assert code == 1
    assert f"signature_invalid: #{first.position}: the seal signature does not verify" in out


def test_a_kept_head_catches_a_ledger_cut_back_with_its_seal(sealed: Ledger, capsys: Any) -> None:
    anchor = cli_json(capsys, "audit", "head", *TRUST)["anchor"]
    assert SignedHead.from_anchor(anchor).self_signed()
    code, out, _ = cli(capsys, "audit", "head", *TRUST)
    assert (code, out.splitlines()[-1]) == (0, anchor)

    # Delete the newest events, their seal rows and their signatures.
    column = _position_column(sealed)
    ((cut,),) = sealed.db.query("SELECT MIN(position) FROM opledger_seal_signatures")
    sealed.db.execute(f"DELETE FROM {sealed.events_table} WHERE {column} > ?", (cut,))
    sealed.db.execute("DELETE FROM opledger_digest WHERE notification_id > ?", (cut,))
    sealed.db.execute("DELETE FROM opledger_seal_signatures WHERE position > ?", (cut,))
    sealed.db.execute("DELETE FROM opledger_operations WHERE operation_id <> 'op-1'")

    assert cli_json(capsys, "audit", "verify", *TRUST)["ok"] is True  # cannot tell alone
    code, out, _ = cli(capsys, "audit", "verify", *TRUST, "--expect-head", anchor)
    assert code == 1
    assert "is not in the seal any more (sealed events were removed)" in out
    head = SignedHead.from_anchor(anchor)
    positioned = f"{head.position}:{head.digest}"
    assert cli(capsys, "audit", "verify", *TRUST, "--expect-head", positioned)[0] == 1


def test_verify_trusts_the_ledger_identity_of_the_credentials_manifest(
    storage: StorageConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from ledger.nats import generate_credentials

    credentials = generate_credentials(tmp_path / "creds", hosts=["h1"], tools=["t"])
    key = SealKey.from_seed_file(credentials.ledger.seed_path)
    ledger = make_ledger(storage, seal_key=key)
    ledger.submit(search("op-1"), ALICE)
    ledger.refresh()
    use_storage(monkeypatch, tmp_path, storage)

    report = cli_json(capsys, "audit", "verify")
    assert report["ok"] is True
    assert report["signed_head"]["public_key"] == credentials.ledger.public_key
    # Another key given by hand replaces the manifest's.
    other = SealKey.generate().public_key
    assert cli_json(capsys, "audit", "verify", "--public-key", other, expect=1)["ok"] is False
    code, _, err = cli(capsys, "audit", "verify", "--public-key", "Unot-a-key")
    assert code == 2
    assert err.startswith("error: INVALID_ARGUMENT: --public-key: not an NKey public key")


def test_the_service_resumes_from_its_own_head_and_reseals_unsigned_rows(
    storage: StorageConfig,
) -> None:
    ledger = make_ledger(storage)
    ledger.submit(search("op-1"), ALICE)
    ledger.refresh()
    ledger.submit(search("op-2"), ALICE)
    # Someone who can write the database adds a seal row of their own past the head.
    ledger.db.execute(
        "INSERT INTO opledger_digest VALUES (?, 'op-x', 1, ?, ?)", (999, "e" * 64, "f" * 64)
    )
    ledger.refresh()
    report = ledger.verify(workers=1)
    assert report.ok, [f.describe() for f in report.findings]
    assert ledger.db.query("SELECT COUNT(*) FROM opledger_digest WHERE notification_id = 999") == [
        (0,)
    ]
    # A ledger built without the key (a reader) does not seal at all.
    reader = build_ledger(storage)
    reader.submit(search("op-3"), ALICE)
    reader.refresh()
    assert reader.verify(workers=1, trusted_keys=[SEAL_KEY.public_key]).unsigned_events == 3


def _rewrite_history(ledger: Ledger) -> None:
    """An attacker of the database: op-1's query changed, its seal cleared."""
    column = _position_column(ledger)
    rows = ledger.db.query(
        f"SELECT {column}, state FROM {ledger.events_table}"
        " WHERE originator_id = 'op-1' AND originator_version = 1"
    )
    position, state = rows[0]
    changed = bytes(state).replace(b"refund policy", b"salary tables")
    ledger.db.execute(
        f"UPDATE {ledger.events_table} SET state = ? WHERE {column} = ?", (changed, position)
    )


def test_the_service_never_seals_over_a_seal_whose_signatures_are_gone(
    sealed: Ledger, capsys: Any
) -> None:
    """Before: the sealer found no head, sealed everything again from the start with
    the service's key, and the rewritten history then verified."""
    _rewrite_history(sealed)
    sealed.db.execute("DELETE FROM opledger_seal_signatures")
    sealed.db.execute("DELETE FROM opledger_digest")
    sealed.refresh()  # the running service's next seal: refused, logged, not raised
    assert _seal_tables(sealed) == ([], [])
    report = cli_json(capsys, "audit", "verify", *TRUST, "--seal-grace", "0", expect=1)
    assert report["signed_head"] is None
    assert report["findings"]


def test_the_service_never_seals_over_a_seal_signed_by_another_key(
    sealed: Ledger, capsys: Any
) -> None:
    """Before: the sealer continued from the newest head whose signature verified with
    any key, the attacker's own included, and signed the rewrite over."""
    _rewrite_history(sealed)
    _, signatures = _seal_tables(sealed)
    forger = SealKey.generate()
    sealed.db.execute("DELETE FROM opledger_seal_signatures")
    for row in signatures:
        head = SignedHead.from_row(row)
        forged = forger.sign(head.position, head.digest, head.sealed_at)
        sealed.db.execute(
            "INSERT INTO opledger_seal_signatures VALUES (?, ?, ?, ?, ?)",
            (forged.position, forged.digest, forged.sealed_at, forged.public_key,
             forged.signature),
        )
    sealed.submit(search("op-4"), ALICE)
    sealed.refresh()
    assert all(SignedHead.from_row(r).public_key == forger.public_key
               for r in _seal_tables(sealed)[1])
    report = cli_json(capsys, "audit", "verify", *TRUST, "--seal-grace", "0", expect=1)
    assert report["signed_head"] is None


def test_a_rotated_key_continues_the_seal_given_the_previous_one(
    storage: StorageConfig, sealed: Ledger, capsys: Any
) -> None:
    """A rotation is not an attack: the new key continues from the old key's heads when
    the service is told the old public key, and refuses without it."""
    new_key = SealKey.generate()
    sealed.submit(search("op-5"), ALICE)
    unaware = make_ledger(storage, seal_key=new_key)
    unaware.refresh()
    before = _seal_tables(sealed)[1]
    assert all(SignedHead.from_row(r).public_key == SEAL_KEY.public_key for r in before)
    told = make_ledger(storage, seal_key=new_key, previous_seal_keys=[SEAL_KEY.public_key])
    told.refresh()
    after = _seal_tables(sealed)[1]
    assert SignedHead.from_row(after[-1]).public_key == new_key.public_key
    assert len(after) == len(before) + 1
    report = cli_json(capsys, "audit", "verify", *TRUST, "--public-key", new_key.public_key)
    assert report["ok"], report["findings"]
    unaware.close()
    told.close()


def test_an_erased_seal_is_not_signed_again_by_a_restarted_service_either(
    storage: StorageConfig, sealed: Ledger, capsys: Any
) -> None:
    """Before: with the signatures, the digest rows and the seal's position row reset,
    the ledger looked never sealed, and the service sealed the rewrite from the first
    event with its own key; plain verify then said OK. A service started on a ledger
    with events but no signed head now refuses, unless told (--seal-existing)."""
    _rewrite_history(sealed)
    for statement in ("DELETE FROM opledger_seal_signatures", "DELETE FROM opledger_digest",
                      "UPDATE opledger_positions SET position = 0 WHERE name = 'seal'"):
        sealed.db.execute(statement)
    sealed.refresh()  # the service that was running
    restarted = make_ledger(storage)  # a service started afresh on the same database
    restarted.refresh()
    assert _seal_tables(sealed) == ([], [])
    report = cli_json(capsys, "audit", "verify", *TRUST, "--seal-grace", "0", expect=1)
    assert report["signed_head"] is None
    told = make_ledger(storage, seal_existing=True)  # the operator decides, knowingly
    told.refresh()
    assert len(_seal_tables(sealed)[1]) == 1
    for ledger in (restarted, told):
        ledger.close()


def test_heads_this_service_signed_are_not_given_up_for_older_ones(
    sealed: Ledger,
) -> None:
    """While it runs, the service knows how far it signed: signatures cut back to an
    older head (with the events after it rewritten) are not sealed over."""
    _, signatures = _seal_tables(sealed)
    newest = SignedHead.from_row(signatures[-1]).position
    sealed.db.execute("DELETE FROM opledger_seal_signatures WHERE position = ?", (newest,))
    sealed.db.execute("DELETE FROM opledger_digest WHERE notification_id > ?",
                      (SignedHead.from_row(signatures[0]).position,))
    sealed.submit(search("op-9"), ALICE)
    sealed.refresh()
    assert [SignedHead.from_row(r).position for r in _seal_tables(sealed)[1]] == [
        SignedHead.from_row(signatures[0]).position
    ]


def test_a_throttled_sealer_seals_at_most_once_per_interval_and_when_told(
    storage: StorageConfig,
) -> None:
    """The service seals at most every quarter second (a seal per 20 ms refresh cost it
    a millisecond each), and everything when it stops (`Ledger.seal_now`)."""
    ledger = make_ledger(storage, seal_every=timedelta(hours=1))
    try:
        ledger.submit(search("t-1"), ALICE)
        ledger.refresh()
        first = len(_seal_tables(ledger)[1])
        ledger.submit(search("t-2"), ALICE)
        ledger.refresh()
        assert len(_seal_tables(ledger)[1]) == first == 1
        ledger.seal_now()
        _, signatures = _seal_tables(ledger)
        last = max(row[0] for row in ledger.stored_rows())
        assert len(signatures) == 2 and SignedHead.from_row(signatures[-1]).position == last
    finally:
        ledger.close()
