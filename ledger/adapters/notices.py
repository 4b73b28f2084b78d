"""What an append's NOTIFY says: whose events, from which process, about which operations.

Every append sends a NOTIFY on the events table's channel (the library's, kept by
`ledger.adapters.recorders`), and other service instances listen
(`ledger.adapters.append_notices`). A payload names three things, separated by
spaces (no part holds one):

- the **store**: the PostgreSQL schema of the events table. The channel is named
  after the table alone, and notifications are per database, so ledgers in
  different schemas of one database hear each other's appends; the store tells
  them apart.
- the **writer**: a random token of the appending process's recorder, so that a
  process knows its own appends (a backend's ID cannot do that: backends are
  reused, and a connection pooler hides them).
- the **operation IDs** appended, each in one payload only, as many payloads as
  PostgreSQL's limit (8,000 bytes) needs.

A payload in no such form (the empty NOTIFY of the library's own statements, or of
a release before this one) still says that someone appended, not what.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["AppendNotice", "new_writer", "notice_head", "notice_payloads", "read_notice"]

_SEPARATOR = " "
_PAYLOAD_BYTES = 7_000  # PostgreSQL refuses 8,000 bytes or more (with 8 KiB pages)
# Operation and plan IDs (`schemas.OPERATION_ID_PATTERN`, plans' `~plan`); a token of
# anything else in a notice is dropped, as is a notice of more of them than any
# append could name in one payload.
_ID = re.compile(r"[A-Za-z0-9_~/-]{1,300}")
_IDS_AT_MOST = _PAYLOAD_BYTES // 2


@dataclass(frozen=True, slots=True)
class AppendNotice:
    """One notice of an append: whose events table, which process, which operations."""

    store: str
    writer: str
    operation_ids: tuple[str, ...]


def new_writer() -> str:
    """A token for one process's appends (48 random bits: never two alike in practice)."""
    return secrets.token_hex(6)


def notice_payloads(store: str, writer: str, operation_ids: Iterable[str]) -> list[str]:
    """The payloads of one append's notices: every operation ID once, each payload under
    PostgreSQL's limit and headed by `store` and `writer`."""
    head = f"{store}{_SEPARATOR}{writer}"
    payloads: list[str] = []
    current: list[str] = []
    size = len(head.encode())
    for operation_id in dict.fromkeys(operation_ids):
        length = 1 + len(operation_id.encode())
        if current and size + length > _PAYLOAD_BYTES:
            payloads.append(_SEPARATOR.join([head, *current]))
            current, size = [], len(head.encode())
        current.append(operation_id)
        size += length
    if current:
        payloads.append(_SEPARATOR.join([head, *current]))
    return payloads


def notice_head(payload: str) -> tuple[str, str] | None:
    """The store and the writer a payload names, without reading its IDs (a listener
    passes over most notices: its own process's); None if it is in no such form."""
    parts = _parts(payload)
    return None if parts is None else (parts[0], parts[1])


def read_notice(payload: str) -> AppendNotice | None:
    """The notice a payload carries; None if it is in no such form (it says only that
    someone appended)."""
    parts = _parts(payload)
    if parts is None:
        return None
    store, writer, names = parts
    ids = names.split(_SEPARATOR, _IDS_AT_MOST)
    if len(ids) > _IDS_AT_MOST:
        return None
    return AppendNotice(store, writer, tuple(i for i in ids if _ID.fullmatch(i) is not None))


def _parts(payload: str) -> tuple[str, str, str] | None:
    """(store, writer, the IDs' text) of a payload in the form, else None."""
    parts = payload.split(_SEPARATOR, 2)
    # A store is `schema.table`; no operation ID holds a dot, so a payload of IDs
    # alone (the release before the store was named) is not read as one.
    if len(parts) < 3 or "." not in parts[0] or not parts[1]:
        return None
    return parts[0], parts[1], parts[2]
