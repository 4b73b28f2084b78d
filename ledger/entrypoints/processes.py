"""`opledger up | demo | serve | executor run | creds`: the commands that run processes.

They are separate from the inspection commands (`ops`, `audit`, `approvals`),
which only open the ledger: these start servers and supervise children. Each
is a subcommand of the one `opledger` parser (`ledger.entrypoints.cli`), and
its runner gets the parsed options and the `Settings` built from them.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from executors import add_run_arguments, run_executor
from ledger import StorageConfig
from ledger.config import ConfigError, Settings
from ledger.entrypoints.parsing import EXIT_OK, EXIT_REFUSED
from ledger.mcp.cli import add_executor_mcp
from ledger.server.main import add_serve_arguments, run_service

if TYPE_CHECKING:
    from ledger.entrypoints.console import EventLines

__all__ = ["ProcessCommand", "add_process_commands"]

ProcessCommand = Callable[[argparse.Namespace, Settings], int]
"""A process command's runner: parsed options and settings → the exit code."""


def add_process_commands(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add `up`, `demo`, `serve`, `executor run` and `creds` to the subcommands `commands`."""
    _add_up(commands, common)
    _add_demo(commands, common)
    _add_serve(commands, common)
    _add_executor(commands, common)
    _add_creds(commands, common)


def _command(
    commands: Any, name: str, help_: str, description: str, common: argparse.ArgumentParser
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=help_, description=description, parents=[common]
    )
    return parser


# ------------------------------------------------------------------------------ up


def _add_up(commands: Any, common: argparse.ArgumentParser) -> None:
    up = _command(
        commands,
        "up",
        "run the embedded stack in the foreground until Ctrl-C",
        "Run the embedded default in the foreground until Ctrl-C: nats-server, the SQLite"
        " ledger service and one executor process per sample tool, all under <home>.",
        common,
    )
    up.add_argument(
        "--monitor",
        action="store_true",
        help="also run nats-server's HTTP monitoring endpoints, on 127.0.0.1 (they need no"
        " credentials and list every connection's key and subscriptions)",
    )
    up.add_argument(
        "--seal-existing",
        action="store_true",
        help="let the ledger service seal events no signed head covers yet (a home written"
        " by a version before signed heads); see docs/operations.md",
    )
    up.add_argument(
        "--quiet",
        action="store_true",
        help="print no line per stored event (default: one line each, as `ops watch`)",
    )
    up.set_defaults(run=_up)


def _up(args: argparse.Namespace, settings: Settings) -> int:
    from ledger.embedded import EmbeddedStack, running_stack

    home = settings.home
    if running_stack(home) is not None:
        print(f"error: a stack is already running from {home}", file=sys.stderr)
        return EXIT_REFUSED
    stack = EmbeddedStack(home, monitor=args.monitor, seal_existing=args.seal_existing)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # Where the events stood before the stack started: what anyone proposes as soon as
    # it runs is printed too (a home used before has its history; a new one none).
    after = None if args.quiet else _last_position(stack.database)
    # A failure to start is an `OpledgerError`: the command line prints it (exit 2).
    stack.start()
    follow = None if after is None else _follow(stack.database, after)
    print(stack.describe(), flush=True)
    print("Ctrl-C stops everything.", flush=True)
    try:
        while not stop.wait(0.5):
            if follow is not None:
                # What the stack does, as it happens: one line per stored event.
                for line in follow.next_lines():
                    print(line, flush=True)
            for name, process in stack.processes.items():
                if process.poll() is not None:
                    print(
                        f"warning: {name} exited with {process.returncode};"
                        f" see {stack.log_path(name)}",
                        file=sys.stderr,
                    )
                    stop.set()
    finally:
        print("stopping…", flush=True)
        stack.stop()
    return EXIT_OK


def _last_position(database: Path) -> int | None:
    """The last stored event's position (0 for a ledger not made yet); None if it cannot
    be read (then `up` runs without following)."""
    if not database.exists():
        return 0
    from ledger.bootstrap import open_ledger

    try:
        ledger = open_ledger(StorageConfig.sqlite(database), read_only=True)
    except Exception as error:  # a home without a ledger yet, or one being written
        print(f"warning: not following events: {error}", file=sys.stderr)
        return None
    try:
        return ledger.event_reader.last_position()
    finally:
        ledger.close()


def _follow(database: Path, after: int) -> EventLines | None:
    """The stack's events after `after` as lines, read from its ledger (read-only), or
    None if the ledger cannot be read (the stack runs on; only the lines are missing)."""
    from ledger.bootstrap import open_ledger
    from ledger.entrypoints.console import EventLines

    try:
        ledger = open_ledger(StorageConfig.sqlite(database), read_only=True)
    except Exception as error:  # the stack's own service holds it; say why, run on
        print(f"warning: not following events: {error}", file=sys.stderr)
        return None
    return EventLines(ledger, after=after)


# ---------------------------------------------------------------------------- demo


def _add_demo(commands: Any, common: argparse.ArgumentParser) -> None:
    demo = _command(
        commands,
        "demo",
        "run the scripted demo against a running or a fresh embedded stack",
        "Run the whole job step by step against the stack running from <home>, or a fresh"
        " one; exits 1 if any step did not behave as stated.",
        common,
    )
    demo.set_defaults(run=_demo)


def _demo(args: argparse.Namespace, settings: Settings) -> int:  # noqa: ARG001
    from ledger.demo import run_demo

    return run_demo(settings.home)


# --------------------------------------------------------------------------- serve


def _add_serve(commands: Any, common: argparse.ArgumentParser) -> None:
    serve = _command(
        commands,
        "serve",
        "run the ledger service until a signal",
        "Run the ledger service until SIGTERM or SIGINT: the gateway, the relay, the seal"
        " and the redispatcher, on NATS.",
        common,
    )
    add_serve_arguments(serve)
    serve.set_defaults(run=_serve)


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    return run_service(args, settings)


# ------------------------------------------------------------------------ executor


def _add_executor(commands: Any, common: argparse.ArgumentParser) -> None:
    executor = _command(
        commands,
        "executor",
        "run one tool's executor process",
        "Executor processes: each runs one tool, under a lease from the ledger.",
        common,
    )
    actions = executor.add_subparsers(dest="action", required=True, metavar="ACTION")
    run: argparse.ArgumentParser = actions.add_parser(
        "run",
        help="run one tool's executor until SIGTERM/SIGINT",
        description="Run one tool's executor until SIGTERM/SIGINT: the first finishes the"
        " current item, a second abandons it (it is redelivered).",
        parents=[common],
    )
    add_run_arguments(run)
    run.add_argument(
        "--nats-url",
        help="NATS server URL(s), comma-separated (default: $OPLEDGER_NATS_URL)",
    )
    run.add_argument(
        "--contracts",
        type=Path,
        help="contract directory (default: $OPLEDGER_CONTRACTS_DIR, else the samples)",
    )
    run.set_defaults(run=_executor)
    add_executor_mcp(actions, common)


def _executor(args: argparse.Namespace, settings: Settings) -> int:
    if not settings.nats_url:
        raise ConfigError("no NATS URL: give --nats-url or set OPLEDGER_NATS_URL")
    args.nats_url = settings.nats_url
    args.contracts = settings.contracts_dir
    return run_executor(args)


# --------------------------------------------------------------------------- creds


def _add_creds(commands: Any, common: argparse.ArgumentParser) -> None:
    creds = _command(
        commands,
        "creds",
        "generate the deployment's NKeys and nats-server config",
        "Generate one NKey per identity and the nats-server config granting each role"
        " exactly what it needs.",
        common,
    )
    creds.add_argument(
        "--out", type=Path, help="directory (default: $OPLEDGER_CREDS_DIR, else <home>/creds)"
    )
    creds.add_argument("--hosts", default="demo", help="agent hosts, comma-separated")
    creds.add_argument(
        "--tools", default="", help="tools, comma-separated (default: every sample tool)"
    )
    creds.add_argument("--auditors", default="auditor", help="auditors, comma-separated")
    creds.add_argument(
        "--approvers",
        default="",
        help="approver identities, comma-separated (default: none); their roles are the"
        " ledger service's --approver NAME=ROLE",
    )
    creds.add_argument(
        "--operators",
        default="",
        help="operator identities, comma-separated (default: none): `ops cancel|resolve|retry"
        " --operator NAME`",
    )
    creds.add_argument("--port", type=int, default=4222, help="client port in the config")
    creds.set_defaults(run=_creds)


def _creds(args: argparse.Namespace, settings: Settings) -> int:
    from ledger.nats import generate_credentials, write_server_config

    home = settings.home
    out = args.out or settings.creds_dir or home / "creds"
    if args.tools:
        tools = [t for t in args.tools.split(",") if t]
    else:
        from executors.samples import SAMPLE_TOOLS

        tools = sorted(SAMPLE_TOOLS)
    credentials = generate_credentials(
        out,
        hosts=[h for h in args.hosts.split(",") if h],
        tools=tools,
        auditors=[a for a in args.auditors.split(",") if a],
        approvers=[a for a in args.approvers.split(",") if a],
        operators=[o for o in args.operators.split(",") if o],
    )
    config = write_server_config(
        out / "nats-server.conf",
        credentials,
        port=args.port,
        store_dir=home / "nats" / "store",
        server_name="opledger",
    )
    for identity in credentials.identities:
        print(f"{identity.role.value:9} {identity.name:28} {identity.seed_path}")
    print(f"server config: {config}")
    return EXIT_OK
