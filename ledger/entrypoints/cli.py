"""The `opledger` command line: run the stack, inspect operations, audit, decide approvals.

    opledger [--home DIR] [--database DB] [--postgres-schema S] [--json] COMMAND ...

    opledger up [--monitor] [--seal-existing]
    opledger demo
    opledger serve --nats-url URL [--creds FILE] [--tools T,...] ...
    opledger executor run MODULE:TOOL [--nats-url URL] [--contracts DIR] ...
    opledger creds [--out DIR] [--hosts H,...] [--tools T,...]
    opledger ops list [--state S] [--tool T] [--tenant X] [--limit N]
    opledger ops show OP_ID [--as-of VERSION]
    opledger ops rebuild
    opledger ops watch [--from-start] [--count N] [--seconds S]
    opledger ops cancel OP_ID --operator NAME [--reason TEXT]
    opledger ops resolve OP_ID (--applied | --not-applied) --operator NAME --reason TEXT
    opledger ops retry OP_ID --operator NAME --reason TEXT
    opledger ops cancel|resolve|retry OP_ID ... --break-glass --as USER
    opledger audit verify [--expect-head HEAD] [--public-key KEY]... [--seal-grace SECONDS]
                          [--against-feed [--nats-url URL] [--creds FILE]]
    opledger audit head [--public-key KEY]...
    opledger audit export [--output FILE]
    opledger approvals list
    opledger approvals show OP_ID
    opledger approvals approve OP_ID --approver NAME --proposal-hash HASH [--preview-hash HASH]
    opledger approvals deny OP_ID --approver NAME [--reason TEXT]
    opledger approvals approve OP_ID --break-glass --as USER --role ROLE --proposal-hash HASH
    opledger plans show PLAN_ID
    opledger plans approve PLAN_ID --approver NAME --plan-hash HASH
    opledger plans deny PLAN_ID --approver NAME [--reason TEXT]
    opledger plans retry|compensate PLAN_ID --break-glass --as USER --reason TEXT
        [--preview-hash HASH]

Every command is a subcommand of one parser, and takes the global options
(`--home`, `--database`, `--postgres-schema`, `--json`) before or after its
name; its settings are `parsing.settings_from` those flags, `OPLEDGER_*` and
`<home>/opledger.toml`. The process commands are in `processes`. Each
inspection command returns an `Output` (data, a renderer for people, an exit
code); `main` prints the data as JSON or renders it. Exit codes (see
`parsing`): 0 done, 1 verification found faults, 2 a refusal or an error
(printed as one line, never a traceback), 64 a usage error.

No command creates a ledger: a missing path, or a database without
opledger's tables, is refused (`NO_LEDGER`, exit 2) with nothing written.
The commands that only look (ops list/show, audit verify/head/export,
approvals list/show) open the database read-only; `ops rebuild` and the
`--break-glass` forms of `approvals approve|deny` and `ops cancel|resolve|retry`
write, and only there. An approver's own decision goes over NATS as their
identity (`approving`), and so does an operator's action (`operating`). None of them seals: the seal
is written by the ledger service alone, with its key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sqlite3
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import psycopg
from eventsourcing.persistence import PersistenceError

from ledger.audit.feed import FeedRecord, compare_feed, feed_records
from ledger.audit.parallel import trusted_head
from ledger.audit.seal import SealKeyError, SignedHead, TrustedKeys
from ledger.audit.verify import DEFAULT_SEAL_GRACE, Finding
from ledger.bootstrap import open_ledger
from ledger.config import ConfigError, Settings, seconds_argument
from ledger.domain.errors import OperationNotFound, ResultIntegrityError
from ledger.domain.operation import Operation
from ledger.domain.states import OperationState
from ledger.entrypoints.approving import add_decision_arguments
from ledger.entrypoints.console import render_status, status_view, watch
from ledger.entrypoints.operating import add_operator_arguments, break_glass_user
from ledger.entrypoints.parsing import (
    EXIT_BROKEN_PIPE,
    EXIT_FINDINGS,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    CommandParser,
    global_options,
    settings_from,
)
from ledger.entrypoints.plans import add_plan_decision_arguments, plan_view, render_plan
from ledger.entrypoints.processes import add_process_commands
from ledger.entrypoints.progress import Progress
from ledger.entrypoints.render import (
    render_approval,
    render_decision,
    render_export,
    render_head,
    render_json,
    render_operation,
    render_operations,
    render_pending,
    render_rebuild,
    render_report,
    render_table,
)
from ledger.entrypoints.tools import add_tools_command
from ledger.entrypoints.views import (
    approval_view,
    decision_view,
    operation_view,
    pending_view,
    report_view,
    timeline_entry,
)
from ledger.entrypoints.webpage import add_web_command
from ledger.mcp.cli import add_mcp_command
from ledger.server.relay import read_set_aside
from ledger.service import Ledger
from schemas import DIGEST_PATTERN, ErrorCategory, OpledgerError

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_ERROR",
    "EXIT_FINDINGS",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_USAGE",
    "CommandError",
    "NoApprovalRequest",
    "Output",
    "StorageUnavailable",
    "build_parser",
    "main",
    "render_json",
    "render_table",
]

EXIT_ERROR = EXIT_REFUSED
"""The old name of `EXIT_REFUSED` (2); usage errors are `EXIT_USAGE` (64) now."""


class CommandError(OpledgerError):
    """A command-line argument cannot be acted on (e.g. an unwritable output file)."""

    category = ErrorCategory.INVALID_INPUT
    code = "INVALID_ARGUMENT"


class StorageUnavailable(OpledgerError):
    """The ledger's database cannot be opened or read."""

    category = ErrorCategory.TRANSIENT
    code = "STORAGE_UNAVAILABLE"


class NoApprovalRequest(OpledgerError):
    """The operation exists but never asked for approval."""

    category = ErrorCategory.NOT_FOUND
    code = "NO_APPROVAL_REQUEST"


@dataclass(frozen=True, slots=True)
class Output:
    """What a command produced: JSON-able data, how to show it to people, the exit code."""

    data: Any
    render: Callable[[Any], str]
    exit_code: int = EXIT_OK
    to_stderr: bool = False
    """Print on stderr (when stdout carries the command's payload, as in `audit export`)."""
    quiet: bool = False
    """Nothing left to print (the command printed as it went, as `ops watch` does)."""


Command = Callable[[Ledger, argparse.Namespace], Output]

READ, WRITE = "read", "write"
"""How a command opens the ledger: read-only, or for writing (never creating it)."""

# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run one `opledger` command; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, or a usage error argparse already printed
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    as_json = bool(getattr(args, "json", False))
    try:
        settings = settings_from(args)
        args.settings = settings
        run: Callable[[argparse.Namespace, Settings], int] | None = getattr(args, "run", None)
        if getattr(args, "break_glass", False):
            run = None  # a person's decision or action written to the database directly
            check = getattr(args, "break_glass_check", None)
            if check is not None:
                check(args)  # before the database is opened: a refusal writes nothing
        if run is not None:  # a process or NATS command: it prints what it has to say
            return run(args, settings)
        with _open_ledger(settings, read_only=args.access == READ) as ledger:
            output = _run(args.command, ledger, args)
        if not output.quiet:
            text = render_json(output.data) if as_json else output.render(output.data)
            print(text, file=sys.stderr if output.to_stderr else sys.stdout)
    except OpledgerError as error:
        print(_error_text(error, as_json), file=sys.stderr)
        return EXIT_REFUSED
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as other Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return output.exit_code


@contextmanager
def _open_ledger(settings: Settings, *, read_only: bool) -> Iterator[Ledger]:
    """The ledger these settings name, closed afterwards; storage faults become errors.

    There must be a ledger there already (`NO_LEDGER` otherwise, nothing created).
    """
    storage = settings.storage()
    with _storage_errors(storage.describe(), opening=True):
        ledger = open_ledger(storage, read_only=read_only, contracts_dir=settings.contracts_dir)
    try:
        yield ledger
    finally:
        ledger.close()


_DATABASE_ERRORS = (sqlite3.Error, psycopg.Error, PersistenceError)


@contextmanager
def _storage_errors(where: str, *, opening: bool = False) -> Iterator[None]:
    """Database faults (and, while opening, file system faults) as `StorageUnavailable`."""
    caught: tuple[type[Exception], ...] = _DATABASE_ERRORS
    if opening:
        caught = (*caught, OSError)
    try:
        yield
    except caught as error:
        reason = _os_reason(error) if isinstance(error, OSError) else str(error).strip()
        first_line = (str(reason or "").splitlines() or [type(error).__name__])[0]
        raise StorageUnavailable(f"cannot use the ledger at {where}: {first_line}") from None


def _os_reason(error: OSError) -> str:
    return f"{error.strerror}: {error.filename}" if error.filename else str(error.strerror)


def _run(command: Command, ledger: Ledger, args: argparse.Namespace) -> Output:
    with _storage_errors(ledger.tables.storage.describe()):
        return command(ledger, args)


def _error_text(error: OpledgerError, as_json: bool) -> str:
    """One line: the error envelope as JSON, or `error: CODE: message (details)`."""
    if as_json:
        return error.to_envelope().model_dump_json()
    message = " ".join(error.message.split())
    details = ", ".join(f"{key}={value}" for key, value in error.safe_details.items())
    return f"error: {error.code}: {message}" + (f" ({details})" if details else "")


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of `opledger`: every command, each accepting the global options."""
    common = global_options()
    parser = CommandParser(
        prog="opledger",
        description="The opledger operation ledger: run the stack, inspect and audit the"
        " ledger, decide approvals.",
        parents=[common],
        epilog="Each command has its own --help. Exit codes: 0 done, 1 findings,"
        " 2 refused or failed, 64 usage error (see docs/operations.md).",
    )
    groups = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")
    add_process_commands(groups, common)
    add_web_command(groups, common)
    add_tools_command(groups, common)
    add_mcp_command(groups, common)
    status = _leaf(
        groups,
        "status",
        "is it working, and does anything need a person: processes, work by state, the"
        " relay, consumers' backlog",
        common,
        status_command,
    )
    del status
    _add_ops(groups, common)
    _add_audit(groups, common)
    _add_approvals(groups, common)
    _add_plans(groups, common)
    return parser


def _group(groups: Any, name: str, help_: str, common: argparse.ArgumentParser) -> Any:
    parser = groups.add_parser(name, help=help_, description=help_, parents=[common])
    return parser.add_subparsers(dest="action", required=True, metavar="ACTION")


def _leaf(
    actions: Any,
    name: str,
    help_: str,
    common: argparse.ArgumentParser,
    command: Command,
    access: str = READ,
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = actions.add_parser(
        name, help=help_, description=help_, parents=[common]
    )
    parser.set_defaults(command=command, access=access)
    return parser


def _add_ops(groups: Any, common: argparse.ArgumentParser) -> None:
    actions = _group(groups, "ops", "operations in the ledger", common)
    listing = _leaf(actions, "list", "list operations, newest first", common, ops_list)
    listing.add_argument(
        "--state",
        choices=[state.value for state in OperationState],
        help="only operations in this state (default: any)",
    )
    listing.add_argument("--tool", help="only this tool's operations (default: any)")
    listing.add_argument("--tenant", help="only this tenant's operations (default: any)")
    listing.add_argument("--limit", type=_positive, default=100, help="at most N rows")
    show = _leaf(actions, "show", "one operation and its event timeline", common, ops_show)
    show.add_argument("operation_id", metavar="OP_ID")
    show.add_argument(
        "--as-of", type=_positive, metavar="VERSION", help="replay up to VERSION (default: now)"
    )
    _leaf(
        actions,
        "rebuild",
        "rebuild the operations view from the events (never the seal)",
        common,
        ops_rebuild,
        WRITE,
    )
    cancel = _leaf(
        actions,
        "cancel",
        "cancel an operation, as your operator identity (over NATS): at once if it has"
        " not started, by request if it runs",
        common,
        ops_cancel_break_glass,
        WRITE,
    )
    cancel.add_argument("operation_id", metavar="OP_ID")
    cancel.add_argument("--reason", default="", help="why (recorded; default: none given)")
    add_operator_arguments(cancel, "cancel")
    resolve = _leaf(
        actions,
        "resolve",
        "settle an operation whose outcome is unknown, as your operator identity (over"
        " NATS): say what happened, and why",
        common,
        ops_resolve_break_glass,
        WRITE,
    )
    retry = _leaf(
        actions,
        "retry",
        "run a failed operation again, as your operator identity (over NATS): a new"
        " attempt under the same operation ID, and why",
        common,
        ops_retry_break_glass,
        WRITE,
    )
    retry.add_argument("operation_id", metavar="OP_ID")
    retry.add_argument(
        "--reason", required=True, help="why (recorded), e.g. what changed since it failed"
    )
    add_operator_arguments(retry, "retry")
    watching = _leaf(actions, "watch", "follow events as they are stored", common, ops_watch)
    watching.add_argument(
        "--from-start", action="store_true", help="begin with the first event (default: new ones)"
    )
    watching.add_argument(
        "--count", type=_positive, help="stop after N events (default: until Ctrl-C)"
    )
    watching.add_argument(
        "--seconds", type=float, help="stop after this long (default: until Ctrl-C)"
    )
    resolve.add_argument("operation_id", metavar="OP_ID")
    happened = resolve.add_mutually_exclusive_group(required=True)
    happened.add_argument(
        "--applied", action="store_true", help="the side effect happened: it succeeded"
    )
    happened.add_argument(
        "--not-applied", action="store_true", help="it did not happen: it failed, final"
    )
    resolve.add_argument("--reason", required=True, help="why (recorded), e.g. what you checked")
    add_operator_arguments(resolve, "resolve")


def _public_key_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--public-key",
        dest="public_keys",
        action="append",
        metavar="KEY",
        help="a ledger service public key (U...) whose seal signatures you trust (repeatable;"
        " default: the ledger identity in <creds dir>/identities.json)",
    )


def _add_audit(groups: Any, common: argparse.ArgumentParser) -> None:
    actions = _group(groups, "audit", "verify and export the ledger", common)
    verify = _leaf(
        actions,
        "verify",
        "check hash chains, the signed seal, the view and kept results",
        common,
        audit_verify,
    )
    verify.add_argument(
        "--expect-head",
        metavar="HEAD",
        help="a head kept earlier: the line `audit head` printed, POSITION:DIGEST,"
        " or the final head digest (default: none, no comparison)",
    )
    _public_key_option(verify)
    verify.add_argument(
        "--seal-grace",
        type=seconds_argument,
        default=DEFAULT_SEAL_GRACE.total_seconds(),
        metavar="SECONDS",
        help="how long an event may stay unsealed before it is a finding",
    )
    verify.add_argument(
        "--against-feed",
        action="store_true",
        help="also compare every event with the feed on NATS (as the auditor identity)",
    )
    verify.add_argument(
        "--nats-url", help="default: OPLEDGER_NATS_URL, else the running stack's server"
    )
    verify.add_argument(
        "--creds",
        type=Path,
        metavar="FILE",
        help="the auditor identity's NKey seed file (default: <creds dir>/auditor-auditor.nk)",
    )
    head = _leaf(
        actions, "head", "print the last signed head, to keep elsewhere", common, audit_head
    )
    _public_key_option(head)
    export = _leaf(actions, "export", "write every event as JSON Lines", common, audit_export)
    export.add_argument("--output", "-o", type=Path, metavar="FILE", help="default: stdout")


def _add_approvals(groups: Any, common: argparse.ArgumentParser) -> None:
    actions = _group(groups, "approvals", "operations waiting for a human decision", common)
    _leaf(actions, "list", "operations awaiting approval", common, approvals_list)
    show = _leaf(actions, "show", "what approving would allow", common, approvals_show)
    show.add_argument("operation_id", metavar="OP_ID")
    approve = _leaf(
        actions,
        "approve",
        "approve exactly the call you reviewed, as your approver identity (over NATS)",
        common,
        approvals_approve_break_glass,
        WRITE,
    )
    add_decision_arguments(approve, "approve")
    deny = _leaf(
        actions,
        "deny",
        "deny the call, as your approver identity (over NATS); it will never run",
        common,
        approvals_deny_break_glass,
        WRITE,
    )
    add_decision_arguments(deny, "deny")


def _add_plans(groups: Any, common: argparse.ArgumentParser) -> None:
    actions = _group(groups, "plans", "plans of several tool calls, approved as one", common)
    show = _leaf(actions, "show", "a plan: every step's effect, its steps' states, its hash",
                 common, plans_show)
    show.add_argument("plan_id", metavar="PLAN_ID")
    approve = _leaf(actions, "approve", "approve exactly the plan you reviewed, every step of"
                    " it, as your approver identity (over NATS)", common, plans_show)
    add_plan_decision_arguments(approve, "approve")
    deny = _leaf(actions, "deny", "deny the plan, as your approver identity (over NATS): none"
                 " of it runs", common, plans_show)
    add_plan_decision_arguments(deny, "deny")
    for name, help_, command in (
        ("retry", "run a failed or partially succeeded plan's failed and skipped steps"
         " again (never a succeeded one)", plans_retry_break_glass),
        ("compensate", "propose undoing the plan's succeeded steps, as a plan of its own"
         " that needs its own approval", plans_compensate_break_glass),
    ):
        leaf = _leaf(actions, name, help_ + " (writes the database: --break-glass)", common,
                     command, WRITE)
        leaf.add_argument("plan_id", metavar="PLAN_ID")
        leaf.add_argument("--break-glass", action="store_true", required=True,
                          help="write the database directly, recorded as break-glass:USER")
        leaf.add_argument("--as", dest="user", required=True, metavar="USER", help="who")
        leaf.add_argument("--reason", required=True, help="why (recorded)")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


# ------------------------------------------------------------------------- commands


def ops_list(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`ops list`: the operations view, with the events it has not taken in yet folded in
    (read, not written: the command writes nothing)."""
    rows = ledger.projector.rows(
        state=args.state, tool=args.tool, tenant=args.tenant, limit=args.limit, current=True
    )
    return Output([asdict(row) for row in rows], render_operations)


def ops_rebuild(ledger: Ledger, args: argparse.Namespace) -> Output:  # noqa: ARG001
    """`ops rebuild`: the operations view dropped and projected again from the events."""
    line = Progress("rebuilding the view", "events")
    try:
        count = ledger.projector.rebuild(line.update)
    finally:
        line.finish()
    return Output({"events_projected": count}, render_rebuild)


def ops_show(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`ops show`: one operation (now, or replayed to a version) and its timeline."""
    operation = ledger.get(args.operation_id, version=args.as_of)
    if args.as_of is not None and operation.version < args.as_of:
        raise OperationNotFound(
            f"the operation has no version {args.as_of}; its latest is {operation.version}",
            operation_id=args.operation_id,
        )
    events = [
        event
        for event in ledger.history(args.operation_id)
        if args.as_of is None or event.originator_version <= args.as_of
    ]
    data = operation_view(operation) | {
        "as_of": args.as_of,
        "timeline": [timeline_entry(event) for event in events],
        "result": None,
        "result_problem": None,
    }
    if args.as_of is None and operation.outcome is not None:
        # The kept result, as hosts get it (redacted by its executor), only if it
        # still hashes to what its event recorded.
        try:
            result = ledger.status(operation.id).result
        except ResultIntegrityError as error:
            data["result_problem"] = error.message
        else:
            data["result"] = result.model_dump(mode="json") if result else None
    return Output(data, render_operation)


def status_command(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`status`: the operator's one screen (see `console`)."""
    return Output(status_view(ledger, args.settings), render_status)


def ops_watch(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`ops watch`: one line per event as it is stored (JSON lines with `--json`)."""
    with suppress(KeyboardInterrupt):
        watch(
            ledger,
            from_start=args.from_start,
            count=args.count,
            seconds=args.seconds,
            as_json=bool(getattr(args, "json", False)),
            emit=lambda line: print(line, flush=True),
        )
    return Output(None, lambda _: "", quiet=True)


def ops_cancel_break_glass(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`ops cancel --break-glass`: cancelled if it has not run, cancel requested if it
    runs, and `CancelTooLate` recorded if it already has its outcome; written to the
    database directly, as `break-glass:USER`."""
    operation = ledger.cancel(args.operation_id, by=break_glass_user(args), reason=args.reason)
    return _shown(ledger, operation, args.operation_id)


def ops_resolve_break_glass(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`ops resolve --break-glass`: a person settles an unknown outcome (`Reconciled`,
    with who and why), written to the database directly."""
    operation = ledger.resolve(
        args.operation_id, by=break_glass_user(args), applied=args.applied, reason=args.reason
    )
    return _shown(ledger, operation, args.operation_id)


def ops_retry_break_glass(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`ops retry --break-glass`: a failed call runs again as a new operation, written
    to the database directly (the service dispatches it from its events)."""
    retried = ledger.retry(
        args.operation_id, by=break_glass_user(args), reason=args.reason, via="break_glass"
    )
    return _shown(ledger, ledger.get(retried.operation_id), retried.operation_id)


def _shown(ledger: Ledger, operation: Operation, operation_id: str) -> Output:
    """An operation a command just changed, shown as `ops show` shows it."""
    data = operation_view(operation) | {
        "as_of": None,
        "timeline": [timeline_entry(event) for event in ledger.history(operation_id)],
    }
    return Output(data, render_operation)


def audit_verify(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`audit verify`: exit 0 when every check passes, 1 with findings."""
    digest, anchor = _expected_head(args.expect_head)
    trusted = _trusted_keys(args)
    grace = timedelta(seconds=args.seal_grace)
    line = Progress("verifying", "chunks")
    try:
        report = ledger.verify(
            expected_head=digest,
            trusted_keys=trusted,
            seal_grace=grace,
            anchor=anchor,
            progress=line.update,
        )
    finally:
        line.finish()
    if args.against_feed:
        records = _read_feed(args)
        comparison = compare_feed(
            ledger.stored_rows(), records, set_aside=_set_aside(ledger), grace=grace
        )
        report.findings.extend(comparison.findings)
        report.notices.extend(comparison.notices)
        report.feed_events_checked = comparison.feed_messages
    return Output(report_view(report), render_report, EXIT_OK if report.ok else EXIT_FINDINGS)


def audit_head(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`audit head`: the last head a trusted key signed, as data and as one line to keep."""
    trusted = _trusted_keys(args)
    head = trusted_head(ledger.tables, trusted)
    if head is None:
        raise NoSignedHead(
            "the ledger has no head signed by a trusted key"
            + ("" if trusted else " (no public key given, and none in the credentials manifest)")
        )
    data = asdict(head) | {"anchor": head.anchor()}
    return Output(data, render_head)


class NoSignedHead(OpledgerError):
    """The ledger has no seal signature a trusted key made."""

    category = ErrorCategory.NOT_FOUND
    code = "NO_SIGNED_HEAD"


class FeedUnavailable(OpledgerError):
    """The feed cannot be read: no server given, or it cannot be reached."""

    category = ErrorCategory.TRANSIENT
    code = "FEED_UNAVAILABLE"


_DIGEST = re.compile(DIGEST_PATTERN)
_POSITIONED = re.compile(r"^(\d+):([0-9a-f]{64})$")


def _expected_head(text: str | None) -> tuple[str | None, SignedHead | None]:
    """`--expect-head` as (final digest, anchored head): one of them, or neither."""
    if text is None:
        return None, None
    text = text.strip()
    if _DIGEST.match(text):
        return text, None
    positioned = _POSITIONED.match(text)
    if positioned:
        return None, SignedHead(int(positioned.group(1)), positioned.group(2), "", "", "")
    try:
        return None, SignedHead.from_anchor(text)
    except ValueError:
        raise CommandError(
            "--expect-head takes the line `audit head` printed, POSITION:DIGEST,"
            " or a 64-digit head digest"
        ) from None


def _trusted_keys(args: argparse.Namespace) -> list[str]:
    """The public keys the auditor trusts: given, else the manifest's ledger identities."""
    keys: list[str] = list(args.public_keys or [])
    if not keys:
        keys = _manifest_ledger_keys(args.settings.creds_dir)
    try:
        TrustedKeys(keys)
    except SealKeyError as error:
        raise CommandError(f"--public-key: {error.message}") from None
    return keys


def _manifest_ledger_keys(creds_dir: Path | None) -> list[str]:
    """The ledger identities' public keys in `<creds_dir>/identities.json` (none if absent).

    Only the manifest is read, no seed: an auditor may have the public keys alone.
    """
    if creds_dir is None:
        return []
    try:
        manifest = json.loads((Path(creds_dir) / "identities.json").read_text(encoding="utf-8"))
        return [
            str(entry["public_key"])
            for entry in manifest["identities"]
            if entry.get("role") == "ledger"
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _set_aside(ledger: Ledger) -> dict[tuple[str, int], str]:
    """The events the relay set aside instead of publishing: (operation, version) → reason."""
    return read_set_aside(ledger.db)


def _read_feed(args: argparse.Namespace) -> list[FeedRecord | Finding]:
    """Every feed message, read with the auditor's credentials only."""
    from ledger.embedded import running_stack
    from ledger.nats import Identity, Role

    settings: Settings = args.settings
    stack = running_stack(settings.home)
    url = args.nats_url or settings.nats_url or (stack.nats_url if stack else None)
    if not url:
        raise FeedUnavailable(
            "no NATS server to read the feed from: give --nats-url or set OPLEDGER_NATS_URL"
        )
    seed = args.creds
    if seed is None:
        creds_dir = Path(stack.creds_dir) if stack else settings.creds_dir
        seed = Path(creds_dir or ".") / "auditor-auditor.nk"
    name = seed.stem.removeprefix("auditor-") if seed.stem.startswith("auditor-") else "auditor"
    identity = Identity.from_seed_file(Role.AUDITOR, name, seed)
    return asyncio.run(_feed_records(url, identity))


async def _feed_records(url: str, identity: Any) -> list[FeedRecord | Finding]:
    from ledger.nats import connect_as, read_feed

    try:
        nc = await connect_as(url, identity, allow_reconnect=False, connect_timeout=5)
    except Exception as error:  # nats-py raises several kinds; one line is what matters
        raise FeedUnavailable(f"cannot connect to {url}: {type(error).__name__}") from None
    records: list[FeedRecord | Finding] = []
    try:
        # Read to its end: the comparison needs the whole feed.
        async for message in read_feed(nc):
            records.extend(feed_records([(message.seq, message.data)]))
    finally:
        await nc.close()
    return records


def audit_export(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`audit export`: JSON Lines to a file or stdout; the count goes to stderr."""
    line = Progress("exporting", "events")
    try:
        if args.output is None:
            sys.stdout.flush()
            count = ledger.export(sys.stdout.buffer, line.update)
            sys.stdout.buffer.flush()
        else:
            with _open_output(args.output) as out:
                count = ledger.export(out, line.update)
    finally:
        line.finish()
    target = "-" if args.output is None else str(args.output)
    return Output({"exported": count, "output": target}, render_export, to_stderr=True)


@contextmanager
def _open_output(path: Path) -> Iterator[IO[bytes]]:
    try:
        out = path.open("wb")
    except OSError as error:
        raise CommandError(f"cannot write {path}: {error.strerror}") from None
    with out:
        yield out


def approvals_list(ledger: Ledger, args: argparse.Namespace) -> Output:  # noqa: ARG001
    """`approvals list`: operations waiting for a decision, newest first (writes nothing)."""
    rows = ledger.projector.rows(state=OperationState.AWAITING_APPROVAL.value, current=True)
    return Output([pending_view(asdict(row)) for row in rows], render_pending)


def approvals_show(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`approvals show`: the effect preview an approver decides on."""
    operation = ledger.get(args.operation_id)
    if operation.approval is None:
        raise NoApprovalRequest(
            f"the operation never asked for approval (it is {operation.state.value})",
            operation_id=operation.id,
        )
    return Output(approval_view(operation), render_approval)


def approvals_approve_break_glass(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`approvals approve --break-glass`: written to the database directly, as `--as`
    with the `--role`s given, and recorded as break glass."""
    _check_break_glass(args)
    operation = ledger.approve(
        args.operation_id,
        approver=args.user,
        approver_roles=args.roles,
        proposal_hash=args.proposal_hash,
        preview_hash=args.preview_hash,
        via="break_glass",
    )
    return Output(decision_view(operation, "approved", args.user, "break_glass"), render_decision)


def approvals_deny_break_glass(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`approvals deny --break-glass`: as for approving, the call will never run."""
    _check_break_glass(args)
    operation = ledger.deny(
        args.operation_id,
        approver=args.user,
        approver_roles=args.roles,
        reason=args.reason,
        via="break_glass",
    )
    return Output(decision_view(operation, "denied", args.user, "break_glass"), render_decision)


def plans_show(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`plans show`: the plan as its approvers and operators see it (writes nothing)."""
    return Output(plan_view(ledger, args.plan_id), render_plan)


def plans_retry_break_glass(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`plans retry --break-glass`: the failed and skipped steps run again."""
    ledger.retry_plan(args.plan_id, by=_plan_person(args), reason=args.reason)
    return Output(plan_view(ledger, args.plan_id), render_plan)


def plans_compensate_break_glass(ledger: Ledger, args: argparse.Namespace) -> Output:
    """`plans compensate --break-glass`: a plan of its own that undoes the succeeded steps."""
    undo = ledger.compensate_plan(args.plan_id, by=_plan_person(args), reason=args.reason)
    return Output(plan_view(ledger, undo.plan_id), render_plan)


def _plan_person(args: argparse.Namespace) -> str:
    if not args.user.strip() or len(args.reason) > 500:
        raise ConfigError("--as names who you are; --reason has at most 500 characters")
    return f"break-glass:{' '.join(args.user.split())}"


def _check_break_glass(args: argparse.Namespace) -> None:
    if not args.user or not args.roles:
        raise ConfigError("--break-glass needs --as USER and at least one --role ROLE")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
