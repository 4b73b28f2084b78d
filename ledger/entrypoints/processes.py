"""`opledger serve | executor run | creds | up | demo`: commands that run processes.

They are separate from the inspection commands (`ops`, `audit`, `approvals`),
which only open the ledger: these start servers and supervise children.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from ledger.config import Settings
from schemas import OpledgerError

__all__ = ["PROCESS_COMMANDS", "run_process_command"]


def _serve(argv: Sequence[str]) -> int:
    from ledger.server.main import run_service_main

    return run_service_main(list(argv))


def _executor(argv: Sequence[str]) -> int:
    from executors._main import run_executor_main

    return run_executor_main(list(argv))


def _creds(argv: Sequence[str]) -> int:
    from ledger.nats import generate_credentials, write_server_config

    parser = argparse.ArgumentParser(
        prog="opledger creds",
        description="Generate one NKey per identity and the nats-server config granting each"
        " role exactly what it needs.",
    )
    parser.add_argument("--out", type=Path, help="directory (default: <home>/creds)")
    parser.add_argument("--home", type=Path, help="state directory (default: ./.opledger)")
    parser.add_argument("--hosts", default="demo", help="agent hosts, comma-separated")
    parser.add_argument("--tools", default="", help="tools (default: every sample tool)")
    parser.add_argument("--auditors", default="auditor")
    parser.add_argument("--port", type=int, default=4222, help="client port in the config")
    args = parser.parse_args(argv)
    home = args.home or Settings().home
    out = args.out or home / "creds"
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
    return 0


def _up(argv: Sequence[str]) -> int:
    from ledger.embedded import EmbeddedStack, running_stack

    parser = argparse.ArgumentParser(
        prog="opledger up",
        description="Run the embedded default in the foreground until Ctrl-C: nats-server,"
        " the SQLite ledger service and one executor process per sample tool.",
    )
    parser.add_argument("--home", type=Path, help="state directory (default: ./.opledger)")
    parser.add_argument(
        "--monitor",
        action="store_true",
        help="also run nats-server's HTTP monitoring endpoints, on 127.0.0.1 (they need no"
        " credentials and list every connection's key and subscriptions)",
    )
    parser.add_argument(
        "--seal-existing",
        action="store_true",
        help="let the ledger service seal events no signed head covers yet (a home written"
        " by a version before signed heads); see docs/operations.md",
    )
    args = parser.parse_args(argv)
    home = args.home or Settings().home
    if running_stack(home) is not None:
        print(f"error: a stack is already running from {home}", file=sys.stderr)
        return 2
    stack = EmbeddedStack(home, monitor=args.monitor, seal_existing=args.seal_existing)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stack.start()
    except OpledgerError as error:
        print(f"error: {error.code}: {error.message}", file=sys.stderr)
        return 2
    print(stack.describe(), flush=True)
    print("Ctrl-C stops everything.", flush=True)
    try:
        while not stop.wait(1.0):
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
    return 0


def _demo(argv: Sequence[str]) -> int:
    from ledger.demo import run_demo_main

    return run_demo_main(list(argv))


PROCESS_COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "serve": _serve,
    "executor": _executor,
    "creds": _creds,
    "up": _up,
    "demo": _demo,
}
"""First word of the command line → its runner."""


def run_process_command(argv: Sequence[str]) -> int:
    """Run `argv[0]` with the rest of the arguments."""
    command, rest = argv[0], list(argv[1:])
    try:
        return PROCESS_COMMANDS[command](rest)
    except OpledgerError as error:
        print(f"error: {error.code}: {error.message}", file=sys.stderr)
        return 2
