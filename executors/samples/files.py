"""Sample executors of the file-sharing tools (plans, seed 001), over a fake drive in SQLite.

`create_folder`, `write_file`, `grant_access`, `notify_user` and the
compensations `delete_file`, `remove_folder`, `revoke_access`, with contracts in
`policy/catalog/files`. The drive behaves like a real one with idempotency keys:
every call is recorded as a request (`count_requests`: what shows whether an
executor called it twice), each effect is applied at most once per key, and a
second call under a key answers the first one's result. A folder must exist
before a file is written into it (`FOLDER_NOT_FOUND`): run in parallel, seed
001's "folder, then the file in it" fails, which is why a plan orders them.

It lives in the SQLite file named by the executor's secret `files_db`
(`OPLEDGER_SECRET_FILES_DB`), shared by every executor process and by the
test that counts effects. Test hook: `set_chat_down(path, True)` makes
`notify_user` fail with `CHAT_UNAVAILABLE` until it is set back; `CRASH_AFTER_ENV`
kills the executor right after an effect.
"""

from __future__ import annotations

import json
import os
import sqlite3
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from executors._api import Reconciliation, Tool, ToolContext, ToolError, tool
from schemas import ErrorCategory

__all__ = [
    "CRASH_AFTER_ENV",
    "FILES_DB_SECRET",
    "FakeDrive",
    "count_requests",
    "create_folder",
    "delete_file",
    "grant_access",
    "notify_user",
    "remove_folder",
    "revoke_access",
    "set_chat_down",
    "write_file",
]

FILES_DB_SECRET = "files_db"
"""The secret naming the fake drive's SQLite file."""
CRASH_AFTER_ENV = "OPLEDGER_TEST_FILES_CRASH_AFTER"
"""Test hook: with a tool's name in it, that tool's process exits hard (status 137, like
SIGKILL) right after the drive applied a new effect, before any result is published."""

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS requests (key TEXT, tool TEXT, at INTEGER PRIMARY KEY)",
    "CREATE TABLE IF NOT EXISTS done (key TEXT PRIMARY KEY, tool TEXT, result TEXT)",
    "CREATE TABLE IF NOT EXISTS folders (path TEXT PRIMARY KEY)",
    "CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, file_id TEXT, content TEXT)",
    "CREATE TABLE IF NOT EXISTS grants (grant_id TEXT PRIMARY KEY, file_id TEXT, person TEXT)",
    "CREATE TABLE IF NOT EXISTS notices (key TEXT, person TEXT, message TEXT)",
    "CREATE TABLE IF NOT EXISTS switches (name TEXT PRIMARY KEY, value INTEGER)",
    # The team's shared folder exists from the start: a file can go there at once.
    "INSERT OR IGNORE INTO folders VALUES ('/shared')",
)

Effect = Callable[[sqlite3.Connection, Mapping[str, Any]], dict[str, Any]]


class FakeDrive:
    """A shared drive with idempotency keys, in one SQLite file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self._connection() as db:
            for statement in _SCHEMA:
                db.execute(statement)

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.path, timeout=30, isolation_level=None)) as db:
            yield db

    def apply(self, key: str, tool_name: str, arguments: Mapping[str, Any],
              effect: Effect) -> tuple[dict[str, Any], bool]:
        """Run `effect` once per idempotency key: (its result, True); a repeat answers
        (the first result, False)."""
        with self._connection() as db:
            db.execute("INSERT INTO requests (key, tool) VALUES (?, ?)", (key, tool_name))
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT result FROM done WHERE key = ?", (key,)).fetchone()
                if row is not None:
                    db.execute("COMMIT")
                    result: dict[str, Any] = json.loads(row[0])
                    return result, False
                result = effect(db, arguments)
                done = (key, tool_name, json.dumps(result))
                db.execute("INSERT INTO done VALUES (?, ?, ?)", done)
                db.execute("COMMIT")
                return result, True
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def lookup(self, key: str) -> dict[str, Any] | None:
        """The result of the effect applied under `key`, or None if there is none."""
        with self._connection() as db:
            row = db.execute("SELECT result FROM done WHERE key = ?", (key,)).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def folders(self) -> list[str]:
        """Every folder, sorted."""
        with self._connection() as db:
            return [row[0] for row in db.execute("SELECT path FROM folders ORDER BY path")]

    def files(self) -> dict[str, str]:
        """Every file: path → content."""
        with self._connection() as db:
            return dict(db.execute("SELECT path, content FROM files"))

    def grants(self) -> list[tuple[str, str]]:
        """Every share: (file ID, person)."""
        with self._connection() as db:
            return [tuple(row) for row in db.execute("SELECT file_id, person FROM grants")]

    def notices(self) -> list[tuple[str, str]]:
        """Every notification sent: (person, message)."""
        with self._connection() as db:
            return [tuple(row) for row in db.execute("SELECT person, message FROM notices")]

    def switch(self, name: str) -> bool:
        """A test switch's value."""
        with self._connection() as db:
            row = db.execute("SELECT value FROM switches WHERE name = ?", (name,)).fetchone()
            return bool(row and row[0])


def count_requests(path: str | Path, tool_name: str | None = None) -> int:
    """How many calls reached the drive (of one tool, or of all)."""
    drive = FakeDrive(path)
    with drive._connection() as db:
        if tool_name is None:
            return int(db.execute("SELECT COUNT(*) FROM requests").fetchone()[0])
        query = "SELECT COUNT(*) FROM requests WHERE tool = ?"
        return int(db.execute(query, (tool_name,)).fetchone()[0])


def set_chat_down(path: str | Path, down: bool) -> None:
    """Make `notify_user` fail (or work again): the test's switch."""
    drive = FakeDrive(path)
    with drive._connection() as db:
        db.execute("INSERT OR REPLACE INTO switches VALUES ('chat_down', ?)", (int(down),))


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


def _drive(context: ToolContext) -> FakeDrive:
    try:
        return FakeDrive(context.secret(FILES_DB_SECRET))
    except sqlite3.Error:
        raise ToolError(ErrorCategory.TRANSIENT, "DRIVE_UNAVAILABLE",
                        "the drive is unavailable") from None


def _run(context: ToolContext, name: str, arguments: Mapping[str, Any],
         effect: Effect) -> dict[str, Any]:
    drive = _drive(context)
    try:
        result, created = drive.apply(context.idempotency_key, name, arguments, effect)
    except sqlite3.Error:
        raise ToolError(ErrorCategory.TRANSIENT, "DRIVE_UNAVAILABLE",
                        "the drive did not confirm the change", outcome_unknown=True) from None
    if created and os.environ.get(CRASH_AFTER_ENV) == name:
        # The effect exists; nothing about it has been published or acked.
        os._exit(137)
    return result


def _create_folder(db: sqlite3.Connection, arguments: Mapping[str, Any]) -> dict[str, Any]:
    path = str(arguments["path"])
    parent = _parent(path)
    if parent != "/" and db.execute("SELECT 1 FROM folders WHERE path = ?",
                                    (parent,)).fetchone() is None:
        # Top-level folders need no parent; deeper ones do, as on a real drive.
        db.execute("INSERT OR IGNORE INTO folders VALUES (?)", (parent,))
    created = db.execute("INSERT OR IGNORE INTO folders VALUES (?)", (path,)).rowcount == 1
    return {"path": path, "created": created}


def _write_file(db: sqlite3.Connection, arguments: Mapping[str, Any]) -> dict[str, Any]:
    path, content = str(arguments["path"]), str(arguments["content"])
    if db.execute("SELECT 1 FROM folders WHERE path = ?", (_parent(path),)).fetchone() is None:
        raise ToolError(ErrorCategory.NOT_FOUND, "FOLDER_NOT_FOUND",
                        f"no folder {_parent(path)}: create it first")
    file_id = f"file-{uuid.uuid4().hex[:12]}"
    db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?)", (path, file_id, content))
    return {"path": path, "file_id": file_id, "bytes": len(content.encode())}


def _grant_access(db: sqlite3.Connection, arguments: Mapping[str, Any]) -> dict[str, Any]:
    file_id = str(arguments["file_id"])
    if db.execute("SELECT 1 FROM files WHERE file_id = ?", (file_id,)).fetchone() is None:
        raise ToolError(ErrorCategory.NOT_FOUND, "FILE_NOT_FOUND", "no such file")
    grant_id = f"grant-{uuid.uuid4().hex[:12]}"
    db.execute("INSERT INTO grants VALUES (?, ?, ?)", (grant_id, file_id, arguments["person"]))
    return {"grant_id": grant_id}


def _notify(db: sqlite3.Connection, arguments: Mapping[str, Any]) -> dict[str, Any]:
    row = db.execute("SELECT value FROM switches WHERE name = 'chat_down'").fetchone()
    if row and row[0]:
        raise ToolError(ErrorCategory.TRANSIENT, "CHAT_UNAVAILABLE", "the chat service is down")
    db.execute("INSERT INTO notices VALUES ('', ?, ?)", (arguments["person"],
                                                         arguments["message"]))
    return {"notified": True}


def _delete_file(db: sqlite3.Connection, arguments: Mapping[str, Any]) -> dict[str, Any]:
    undone = db.execute("DELETE FROM files WHERE path = ?", (arguments["path"],)).rowcount
    return {"undone": undone == 1}


def _remove_folder(db: sqlite3.Connection, arguments: Mapping[str, Any]) -> dict[str, Any]:
    undone = db.execute("DELETE FROM folders WHERE path = ?", (arguments["path"],)).rowcount
    return {"undone": undone == 1}


def _revoke_access(db: sqlite3.Connection, arguments: Mapping[str, Any]) -> dict[str, Any]:
    undone = db.execute("DELETE FROM grants WHERE grant_id = ?",
                        (arguments["grant_id"],)).rowcount
    return {"undone": undone == 1}


def _lookup(operation_id: str, context: ToolContext) -> Reconciliation:
    """What became of an attempt whose outcome is unknown: the drive knows by its key."""
    try:
        done = _drive(context).lookup(operation_id)
    except sqlite3.Error:
        return Reconciliation.unknown("the drive is unavailable")
    if done is None:
        return Reconciliation.not_applied("the drive applied nothing under this key")
    return Reconciliation.applied(done)


def _sample(name: str, effect: Effect) -> Tool:
    def run(arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
        return _run(context, name, arguments, effect)

    run.__name__ = name
    run.__doc__ = f"`{name}` on the fake drive, once per operation ID."
    sample = tool(name, version="1.0.0", required_secrets=(FILES_DB_SECRET,))(run)
    sample.reconciler(_lookup)
    return sample


create_folder = _sample("create_folder", _create_folder)
write_file = _sample("write_file", _write_file)
grant_access = _sample("grant_access", _grant_access)
notify_user = _sample("notify_user", _notify)
delete_file = _sample("delete_file", _delete_file)
remove_folder = _sample("remove_folder", _remove_folder)
revoke_access = _sample("revoke_access", _revoke_access)
