"""`opledger executor run MODULE:TOOL ...`: one executor process, until SIGTERM or SIGINT.

    opledger executor run executors.samples.email:send_customer_email \\
        --creds exec_send_customer_email.nk --nats-url nats://127.0.0.1:4222 \\
        --contracts policy/catalog --secrets email-secrets.json --metrics-port 9301

`python -m executors run ...` is the same command for a process without the
ledger installed beside it: there `--nats-url` and `--contracts` are required,
since the operator settings (`OPLEDGER_*`, `opledger.toml`) belong to the
`opledger` command (`ledger.entrypoints`), which fills them in.

The first SIGTERM/SIGINT finishes the current item and stops; a second one
abandons it (it is redelivered and the ledger decides). Exit codes: 0 after
a stop, 2 for a configuration error (one line on stderr, never a traceback),
64 for a command line that does not parse.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from executors._api import Tool
from executors._process import ProcessorOptions
from executors._runner import ExecutorRunner, RunnerOptions, load_contract
from executors._secrets import load_secrets
from schemas import OpledgerError, inbox_prefix, setup_tracing

__all__ = [
    "add_run_arguments",
    "build_connect_options",
    "build_parser",
    "load_tool",
    "run_executor",
    "run_executor_main",
    "serve_until_stopped",
]

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_USAGE = 64

_log = logging.getLogger("opledger.executor")


def _quiet_gc() -> None:
    """Keep the garbage collector from pausing the loop (why: `ledger.server.main._quiet_gc`)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(2_000, 10, 100)


def load_tool(spec: str) -> Tool:
    """The `Tool` named by `package.module:attribute`."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"expected MODULE:TOOL, got {spec!r}")
    module = importlib.import_module(module_name)
    found = getattr(module, attribute, None)
    if not isinstance(found, Tool):
        raise ValueError(f"{spec} is not an executors.Tool")
    return found


def build_connect_options(
    *,
    nats_url: str,
    tool_name: str,
    executor: str,
    creds: Path | None = None,
) -> dict[str, Any]:
    """Options for `nats.connect`: servers, identity, credentials, private inbox.

    `creds` is an NKey seed file, or a JWT `.creds` file when it ends in `.creds`.
    """
    options: dict[str, Any] = {
        "servers": [url.strip() for url in nats_url.split(",") if url.strip()],
        "name": executor,
        # Replies (lease answers, PubAcks, fetched messages) arrive under this
        # prefix only: the executor's credentials never allow `_INBOX.>`.
        "inbox_prefix": inbox_prefix("exec", tool_name),
    }
    if creds is not None:
        key = "user_credentials" if creds.suffix == ".creds" else "nkeys_seed"
        options[key] = str(creds)
    return options


class _Parser(argparse.ArgumentParser):
    # The same exit code as `opledger`'s parser (`ledger.entrypoints.parsing`):
    # the executors do not import the ledger, so the alias repeats these lines.
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    """The options of `executor run` but `--nats-url` and `--contracts` (see `build_parser`)."""
    run.add_argument(
        "tool", metavar="MODULE:TOOL", help="e.g. executors.samples.email:send_customer_email"
    )
    run.add_argument(
        "--creds",
        type=Path,
        help="NKey seed file (or JWT .creds) of this executor (default: none, development only)",
    )
    run.add_argument(
        "--secrets", type=Path, help="JSON file of this executor's secrets (default: none)"
    )
    run.add_argument("--name", help="executor identity (default: <tool>-<host>-<pid>)")
    run.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on this port (default: none)"
    )
    run.add_argument(
        "--metrics-addr", default="0.0.0.0", help="address for --metrics-port (default: 0.0.0.0)"
    )
    run.add_argument(
        "--batch",
        type=int,
        default=1,
        help="work items run at once (the tool must allow concurrent calls) (default: 1)",
    )
    run.add_argument(
        "--progress-every",
        type=_positive_seconds,
        default=5.0,
        help=(
            "seconds between in-progress acks during long work; keep it well under the"
            " work consumer's ack wait (the service's --ack-wait), or long work is redelivered"
            " (default: 5.0)"
        ),
    )
    run.add_argument(
        "--log-level", default="INFO", help="DEBUG, INFO, WARNING, ... (default: INFO)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m executors` (`opledger executor`, without the settings)."""
    parser = _Parser(prog="python -m executors", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run one tool's executor until SIGTERM/SIGINT")
    add_run_arguments(run)
    run.add_argument("--nats-url", required=True, help="NATS server URL(s), comma-separated")
    run.add_argument("--contracts", type=Path, required=True, help="contract directory")
    return parser


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < math.inf:  # also refuses NaN and infinity (never an ack)
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


def _default_name(tool_name: str) -> str:
    return f"{tool_name}-{socket.gethostname()}-{os.getpid()}"[:128]


async def serve_until_stopped(runner: ExecutorRunner) -> None:
    """Run `runner`; the first SIGTERM/SIGINT finishes the current item, a second abandons
    it (it is redelivered, and the ledger decides)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            _log.info("stopping after the current item (signal again to abandon it)")
            runner.stop()
            return
        # The runner abandons its items itself: a cancel of the run alone may be
        # dropped by nats-py as one of its waits completes, and the items then ran
        # on. The cancel still cuts short whatever else the run is waiting for.
        runner.abandon()
        if task is not None:
            task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await runner.run()
    except asyncio.CancelledError:
        _log.warning("stopped at once; items in progress are redelivered")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run_executor_main(argv: Sequence[str] | None = None) -> int:
    """`python -m executors run ...`: parse the arguments, then `run_executor`."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # --help, or a usage error argparse already printed
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    return run_executor(args)


def run_executor(args: argparse.Namespace) -> int:
    """Run one executor from parsed `executor run` options (`nats_url` and `contracts` set).

    The exit code: 0 after a stop, 2 when it cannot start (one line on stderr).
    """
    try:
        logging.basicConfig(
            level=str(args.log_level).upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
        tool = load_tool(args.tool)
        contract = load_contract(args.contracts, tool.name, tool.version)
        secrets = load_secrets(args.secrets)
        name = args.name or _default_name(tool.name)
        # Each executor names itself on every line: several share one log collector.
        for handler in logging.getLogger().handlers:
            handler.setFormatter(
                logging.Formatter(
                    f"%(asctime)s %(levelname)s executor[{name}] %(name)s: %(message)s"
                )
            )
        if args.creds is None:
            _log.warning("no --creds: connecting without credentials (development only)")
        options = RunnerOptions(
            ProcessorOptions(
                executor=name, secrets=secrets, heartbeat_interval_s=args.progress_every
            ),
            connect_options=build_connect_options(
                nats_url=args.nats_url, tool_name=tool.name, executor=name, creds=args.creds
            ),
            batch_size=args.batch,
            metrics_port=args.metrics_port,
            metrics_addr=args.metrics_addr,
        )
        runner = ExecutorRunner(tool, contract, options)
        # Spans only if the environment asks (OTEL_EXPORTER_OTLP_ENDPOINT, ...).
        setup_tracing(f"opledger-executor-{tool.name}", instance=name)
    except (OpledgerError, ValueError, ImportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    _quiet_gc()
    asyncio.run(serve_until_stopped(runner))
    return EXIT_OK
