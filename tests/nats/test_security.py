"""Identities and their files: seeds, modes, the manifest, the server config they produce."""

from __future__ import annotations

import base64
import stat
import subprocess
from pathlib import Path

import nkeys  # type: ignore[import-untyped]  # no type information
import pytest

from ledger.nats import (
    ClusterOptions,
    CredentialsError,
    Permissions,
    ResponsePermission,
    Role,
    connect_options,
    find_nats_server,
    generate_credentials,
    load_credentials,
    permissions_for,
    write_server_config,
)
from ledger.nats.security import account_hash, new_user_seed, nonce_signature

TOOLS = ["search_documents", "send_customer_email"]


def test_permissions_are_exactly_the_documented_ones() -> None:
    """Any widening must show up here, in review, not only in the matrix."""
    assert permissions_for(Role.LEDGER, "ledger") == Permissions(
        publish=("$JS.API.>", "ops.exec.>", "ops.feed.>", "ops.outcome.>", "$JS.ACK.>"),
        subscribe=(
            "ops.propose.*", "ops.status.*", "ops.cancel.*", "ops.plan.*", "ops.tools.*",
            "ops.operate.*", "ops.approve.*", "ops.lease.*",
            "_INBOX_ledger_ledger.>",
        ),
        allow_responses=ResponsePermission(max=1, expires="2m"),
    )
    assert permissions_for(Role.APPROVER, "lead") == Permissions(
        publish=("ops.approve.lead",), subscribe=("_INBOX_approver_lead.>",),
    )
    assert permissions_for(Role.OPERATOR, "ops-lead") == Permissions(
        publish=("ops.operate.ops-lead",), subscribe=("_INBOX_operator_ops-lead.>",),
    )
    assert permissions_for(Role.HOST, "h1") == Permissions(
        publish=(
            "ops.propose.h1", "ops.status.h1", "ops.cancel.h1", "ops.plan.h1", "ops.tools.h1"
        ),
        subscribe=("ops.outcome.h1.>", "_INBOX_host_h1.>"),
    )
    # Acks: exactly 9 (v1) and exactly 11 (v2) tokens, every one but the five
    # numbers literal; `UhSCgwsR` is nats-server's getHash("LEDGER").
    assert permissions_for(Role.EXECUTOR, "search_documents") == Permissions(
        publish=(
            "$JS.API.CONSUMER.MSG.NEXT.OPS_WORK.exec_search_documents",
            "$JS.ACK.OPS_WORK.exec_search_documents.*.*.*.*.*",
            "$JS.ACK._.UhSCgwsR.OPS_WORK.exec_search_documents.*.*.*.*.*",
            "ops.result.search_documents",
            "ops.lease.search_documents",
        ),
        subscribe=("_INBOX_exec_search_documents.>",),
    )
    assert permissions_for(Role.AUDITOR, "auditor") == Permissions(
        publish=(
            "$JS.API.CONSUMER.MSG.NEXT.OPS_FEED.feed_auditor",
            "$JS.ACK.OPS_FEED.feed_auditor.*.*.*.*.*",
            "$JS.ACK._.UhSCgwsR.OPS_FEED.feed_auditor.*.*.*.*.*",
            "$JS.API.DIRECT.GET.OPS_FEED",
        ),
        subscribe=("_INBOX_auditor_auditor.>",),
    )


@pytest.mark.parametrize(
    ("account", "expected"),
    [
        # From getHashSize (server/events.go): SHA-256 of the name, its first 8
        # bytes each mapped to digits[b % 62] (server/accounts.go). LEDGER's and
        # $G's are also checked against what the server itself puts into v2 ack
        # replies (tests/nats/test_ack_routes.py).
        ("LEDGER", "UhSCgwsR"),
        ("$G", "szMpdrwD"),
        ("AUDIT", "1OJ1WW31"),
    ],
)
def test_account_hash_is_the_servers_get_hash(account: str, expected: str) -> None:
    assert account_hash(account) == expected


def test_exports_and_imports_follow_the_pinned_grants(tmp_path: Path) -> None:
    """The accounts import exactly the subjects their users may publish; streamed
    answers (pulls, batched direct gets) are exported as streams, acks are not."""
    creds = generate_credentials(tmp_path, hosts=["h1"], tools=TOOLS[:1])
    config = creds.authorization_config
    audit_exports = [line.strip() for line in config.splitlines() if '"AUDIT"]' in line]
    assert audit_exports == [
        '{ service: "$JS.API.CONSUMER.MSG.NEXT.OPS_FEED.feed_auditor", accounts: ["AUDIT"],'
        " response_type: stream }",
        '{ service: "$JS.ACK.OPS_FEED.feed_auditor.*.*.*.*.*", accounts: ["AUDIT"] }',
        '{ service: "$JS.ACK._.UhSCgwsR.OPS_FEED.feed_auditor.*.*.*.*.*", accounts: ["AUDIT"] }',
        '{ service: "$JS.API.DIRECT.GET.OPS_FEED", accounts: ["AUDIT"], response_type: stream }',
    ]
    ack_services = [
        line for line in config.splitlines() if "service:" in line and "$JS.ACK" in line
    ]
    assert len(ack_services) == 2 * 2 * 2  # (exec + audit) x (v1 + v2) x (export + import)
    assert not [line for line in ack_services if ">" in line.split("$JS.ACK", 1)[1].split('"')[0]]


def test_nonce_signature_verifies_with_the_public_key(tmp_path: Path) -> None:
    creds = generate_credentials(tmp_path, hosts=[], tools=TOOLS[:1])
    identity = creds.ledger
    signature = nonce_signature(identity, b"server-nonce")
    raw = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
    keypair = nkeys.from_seed(bytearray(identity.seed_path.read_bytes().strip()))
    try:
        assert keypair.public_key.decode() == identity.public_key
        assert keypair.verify(b"server-nonce", raw)
        with pytest.raises(nkeys.ErrInvalidSignature):
            keypair.verify(b"another-nonce", raw)
    finally:
        keypair.wipe()


@pytest.mark.parametrize("name", ["", "a.b", "a*", "a>", "a b"])
def test_names_must_be_subject_tokens(name: str) -> None:
    with pytest.raises(ValueError, match="token"):
        permissions_for(Role.HOST, name)


def test_generated_seeds_are_private_user_keys(tmp_path: Path) -> None:
    creds = generate_credentials(tmp_path / "creds", hosts=["h1"], tools=TOOLS)
    assert [(i.role, i.name) for i in creds.identities] == [
        (Role.LEDGER, "ledger"),
        (Role.HOST, "h1"),
        (Role.EXECUTOR, "search_documents"),
        (Role.EXECUTOR, "send_customer_email"),
        (Role.AUDITOR, "auditor"),
    ]
    assert stat.S_IMODE((tmp_path / "creds").stat().st_mode) == 0o700
    keys = set()
    for identity in creds.identities:
        assert stat.S_IMODE(identity.seed_path.stat().st_mode) == 0o600
        seed = identity.seed_path.read_bytes().strip()
        assert seed.startswith(b"SU")
        keypair = nkeys.from_seed(bytearray(seed))
        assert keypair.public_key.decode() == identity.public_key
        assert identity.public_key.startswith("U")
        assert identity.public_key in creds.authorization_config
        assert seed.decode() not in creds.authorization_config  # public keys only
        keys.add(identity.public_key)
    assert len(keys) == len(creds.identities)
    assert no_leftover_temporaries(tmp_path / "creds")


def no_leftover_temporaries(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.startswith(".")]


def test_load_credentials_round_trips_and_rotation_changes_keys(tmp_path: Path) -> None:
    first = generate_credentials(tmp_path, hosts=["h1"], tools=TOOLS)
    assert load_credentials(tmp_path) == first
    second = generate_credentials(tmp_path, hosts=["h1"], tools=TOOLS)
    assert second.ledger.public_key != first.ledger.public_key
    assert load_credentials(tmp_path) == second


def test_a_swapped_seed_is_detected(tmp_path: Path) -> None:
    creds = generate_credentials(tmp_path, hosts=["h1"], tools=TOOLS)
    creds.host("h1").seed_path.write_bytes(new_user_seed())
    with pytest.raises(CredentialsError, match="does not match"):
        load_credentials(tmp_path)


def test_duplicate_identities_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match="duplicate"):
        generate_credentials(tmp_path, hosts=["h1", "h1"], tools=TOOLS)


def test_connect_options_use_the_seed_and_the_private_inbox(tmp_path: Path) -> None:
    creds = generate_credentials(tmp_path, hosts=["h1"], tools=TOOLS)
    options = connect_options(creds.executor("search_documents"))
    assert options == {
        "nkeys_seed": str(tmp_path / "exec-search_documents.nk"),
        "inbox_prefix": "_INBOX_exec_search_documents",
        "name": "opledger-exec-search_documents",
    }


@pytest.mark.nats
def test_written_server_config_is_accepted_by_nats_server(tmp_path: Path) -> None:
    """`nats-server -t` parses the file: quoting of `$JS...`, nkeys, allow_responses, cluster."""
    creds = generate_credentials(tmp_path / "creds", hosts=["h1"], tools=TOOLS)
    path = write_server_config(
        tmp_path / "conf" / "nats.conf",
        creds,
        port=4333,
        store_dir=tmp_path / "js",
        server_name="n1",
        monitor_port=8333,
        cluster=ClusterOptions(name="c", port=6333, routes=("nats-route://127.0.0.1:6334",)),
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    checked = subprocess.run(
        [str(find_nats_server()), "-t", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
