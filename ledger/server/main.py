"""`opledger serve`: run the ledger service until a signal (`python -m ledger.server` too).

    opledger --database .opledger/ledger.db serve --nats-url nats://127.0.0.1:4333 \\
        --creds .opledger/creds/ledger-ledger.nk --tools search_documents,send_customer_email

Its settings come from `ledger.entrypoints.parsing.settings_from`, as every
command's do. A configuration error prints one line and exits 2; never a
traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import logging
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from ledger.audit.seal import SealKey
from ledger.bootstrap import build_ledger
from ledger.config import ConfigError, Settings, seconds_argument
from ledger.entrypoints.parsing import CommandParser, global_options
from ledger.nats.topology import declare_topology
from ledger.server.app import LedgerService, ServiceOptions
from schemas import OpledgerError, check_token, inbox_prefix, setup_tracing

__all__ = ["add_serve_arguments", "build_parser", "run_service", "run_service_main"]

_log = logging.getLogger("opledger.service")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `opledger serve` (the global ones come from the parent parser)."""
    parser.add_argument(
        "--nats-url", help="the NATS server(s), comma-separated (default: $OPLEDGER_NATS_URL)"
    )
    parser.add_argument(
        "--creds",
        type=Path,
        help="the ledger identity's NKey seed file"
        " (default: <OPLEDGER_CREDS_DIR>/ledger-<name>.nk, if it exists)",
    )
    parser.add_argument("--name", default="ledger", help="the ledger identity's name")
    parser.add_argument(
        "--contracts",
        type=Path,
        help="contract directory (default: $OPLEDGER_CONTRACTS_DIR, else the samples)",
    )
    parser.add_argument(
        "--tools",
        default="",
        help="comma-separated tools to declare work for (default: every tool with a contract)",
    )
    parser.add_argument(
        "--plugins",
        default="policy.catalog:sample_plugins",
        help="module:function returning (resolver, rules)",
    )
    parser.add_argument("--ack-wait", type=float, default=30.0, help="work item ack wait, s")
    parser.add_argument(
        "--max-deliver", type=int, default=10, help="deliveries of one work item at most"
    )
    parser.add_argument(
        "--lease-grace", type=float, default=5.0, help="seconds a lease outlives its deadline"
    )
    parser.add_argument(
        "--redispatch-after",
        type=seconds_argument,
        default=60.0,
        help=(
            "seconds an operation may stay ready while its tool's work queue is empty before"
            " its work item is published again (a lost item); 0: never"
        ),
    )
    parser.add_argument(
        "--previous-seal-key",
        dest="previous_seal_keys",
        action="append",
        default=[],
        metavar="PUBLIC_KEY",
        help="a public key (U...) this service sealed with before its key was rotated"
        " (repeatable): the seal continues from heads it signed (default: none)",
    )
    parser.add_argument(
        "--seal-existing",
        action="store_true",
        help="seal events no signed head covers yet, from the first: once, for a ledger"
        " never sealed (from before signed heads) or after a deliberate reset of the seal",
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="JetStream replicas of the streams"
    )
    parser.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics here (default: no metrics)"
    )
    parser.add_argument("--metrics-addr", default="127.0.0.1", help="address for --metrics-port")
    parser.add_argument(
        "--approver",
        dest="approvers",
        action="append",
        default=[],
        metavar="NAME=ROLE[,ROLE...]",
        help="approver identity NAME holds these approver roles (repeatable; added to"
        " approver_roles of opledger.toml). An approver named nowhere holds no role",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")


def build_parser() -> argparse.ArgumentParser:
    """The parser of `opledger serve` alone (`python -m ledger.server` parses the same)."""
    parser = CommandParser(
        prog="opledger serve", description=__doc__.split("\n")[0], parents=[global_options()]
    )
    add_serve_arguments(parser)
    return parser


def _fill_from_settings(args: argparse.Namespace, settings: Settings) -> None:
    """What the flags leave unset comes from the settings (`OPLEDGER_*`, `opledger.toml`)."""
    args.nats_url = settings.nats_url
    args.contracts = settings.contracts_dir
    if args.creds is None and settings.creds_dir is not None:
        seed = Path(settings.creds_dir) / f"ledger-{args.name}.nk"
        args.creds = seed if seed.exists() else None
    if not args.nats_url:
        raise ConfigError("no NATS URL: give --nats-url or set OPLEDGER_NATS_URL")
    args.host_tenants = settings.host_tenants
    args.approver_roles = _approver_roles(settings.approver_roles or {}, args.approvers)


def _approver_roles(
    configured: Mapping[str, frozenset[str]], flags: Sequence[str]
) -> dict[str, frozenset[str]]:
    """The settings' approver roles with `--approver NAME=ROLE,...` added to them."""
    roles = {name: frozenset(held) for name, held in configured.items()}
    for flag in flags:
        name, sep, listed = flag.partition("=")
        held = frozenset(r.strip() for r in listed.split(",") if r.strip())
        try:
            check_token(name)
        except ValueError:
            raise ConfigError(
                f"--approver {flag!r}: {name!r} is not a valid identity name"
            ) from None
        if not sep or not held:
            raise ConfigError(
                f"--approver {flag!r} names no role: write NAME=ROLE[,ROLE...]"
            )
        roles[name] = roles.get(name, frozenset()) | held
    return roles


def _plugins(spec: str) -> tuple[Any, Any]:
    module_name, _, attribute = spec.partition(":")
    factory: Callable[[], tuple[Any, Any]] = getattr(
        importlib.import_module(module_name), attribute
    )
    return factory()


def _quiet_gc() -> None:
    """Keep the cyclic garbage collector from pausing the event loop mid-request.

    Measured in `bench/e2e_bench.py` (launcher experiment `gc-pauses`) with
    Python's default thresholds: full collections paused the ledger service
    for up to 50 ms and an executor for up to 30 ms, the p99 latency of the
    whole path. Everything loaded at start (modules, contracts, schemas) is
    moved out of the collector's sight, and collections run less often, so
    full ones (which walk every tracked object) are rare; the young
    generations stay small enough to collect in about a millisecond.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(2_000, 10, 100)


async def _serve(service: LedgerService) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    _quiet_gc()
    await service.run_until(stop)


def run_service_main(argv: Sequence[str] | None = None) -> int:
    """`python -m ledger.server ARGS`: the same as `opledger serve ARGS`."""
    from ledger.entrypoints.cli import main

    return main(["serve", *(sys.argv[1:] if argv is None else argv)])


def run_service(args: argparse.Namespace, settings: Settings) -> int:
    """Run the ledger service with parsed `opledger serve` options; the exit code.

    A configuration error raises `ConfigError` (the command line prints it);
    a failure to start prints one line and returns 2.
    """
    _fill_from_settings(args, settings)
    # Each instance names itself on every line: several share one log collector.
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s ledger[{args.name}] %(name)s: %(message)s",
    )
    # Spans only if the environment asks (OTEL_EXPORTER_OTLP_ENDPOINT, ...).
    setup_tracing("opledger-ledger", instance=args.name)
    try:
        resolver, rules = _plugins(args.plugins)
        # The service's NKey is its seal key too: only the service seals, and
        # auditors check its signatures with the public key of this identity.
        seal_key = SealKey.from_seed_file(args.creds) if args.creds is not None else None
        if seal_key is None:
            _log.warning("no --creds: the ledger is not sealed (verification will say so)")
        ledger = build_ledger(
            settings.storage(),
            contracts_dir=args.contracts,
            resolver=resolver,
            rules=rules,
            lease_grace=timedelta(seconds=args.lease_grace),
            seal_key=seal_key,
            previous_seal_keys=args.previous_seal_keys,
            seal_existing=args.seal_existing,
            seal_every=timedelta(milliseconds=250),
        )
    except (OpledgerError, ImportError, AttributeError, ValueError, OSError) as exc:
        print(f"error: cannot start the ledger service: {exc}", file=sys.stderr)
        return 2
    tools = [t for t in args.tools.split(",") if t] or ledger.contracts.tools()
    connect: dict[str, Any] = {
        "inbox_prefix": inbox_prefix("ledger", args.name),
        "name": f"ledger-{args.name}",
    }
    if args.creds is not None:
        connect["nkeys_seed"] = str(args.creds)

    async def declare(js: Any) -> None:
        await declare_topology(
            js,
            tools,
            ack_wait_s=args.ack_wait,
            max_deliver=args.max_deliver,
            replicas=args.replicas,
        )

    service = LedgerService(
        ledger,
        ServiceOptions(
            nats_url=args.nats_url,
            connect_options=connect,
            declare=declare,
            metrics_port=args.metrics_port,
            metrics_addr=args.metrics_addr,
            allowed_tenants=args.host_tenants,
            approver_roles=args.approver_roles,
            instance=args.name,
            redispatch_after=(
                timedelta(seconds=args.redispatch_after) if args.redispatch_after > 0 else None
            ),
        ),
    )
    try:
        asyncio.run(_serve(service))
    except OpledgerError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except Exception as exc:  # e.g. NATS unreachable: one line for people, details in the log
        _log.debug("the ledger service stopped", exc_info=True)
        print(f"error: the ledger service stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        ledger.close()
    return 0
