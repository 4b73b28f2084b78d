"""The three `opledger` commands of the MCP bridge, added by `ledger.entrypoints`:

    opledger mcp serve --host NAME --principal P --tenant T [--capability C]... \\
        [--transport stdio|http] [--listen 127.0.0.1:8765] [--token-file PATH]
    opledger executor mcp --tool NAME (--upstream URL | --upstream-command CMD...)
    opledger tools import-mcp (--upstream URL | --upstream-command CMD...) --out DIR

The MCP SDK is imported only when one of them runs, so other commands start
as fast as before.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import shlex
import sys
from pathlib import Path
from typing import Any

from ledger.config import ConfigError, Settings
from ledger.mcp._errors import McpConfigError

__all__ = ["add_executor_mcp", "add_import_mcp", "add_mcp_command"]

_STATE_KEY_ENV = "OPLEDGER_MCP_STATE_KEY"
_TOKEN_ENV = "OPLEDGER_MCP_TOKEN"  # `ledger.mcp._auth.TOKEN_ENV`, without loading the SDK


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < 86_400 * 365:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


def _add_upstream(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--upstream", metavar="URL",
        help="the MCP server's Streamable HTTP URL (default: none; this or --upstream-command)",
    )
    where.add_argument(
        "--upstream-command", metavar="CMD",
        help="start the MCP server with this command line and speak to it over stdio"
        " (default: none; this or --upstream)",
    )


# ------------------------------------------------------------------ mcp serve


def add_mcp_command(groups: Any, common: argparse.ArgumentParser) -> None:
    """Add `mcp serve` to the `opledger` command groups."""
    group: argparse.ArgumentParser = groups.add_parser(
        "mcp", help="serve MCP clients through the ledger",
        description="The MCP gateway: MCP clients call tools as proposals to the ledger.",
        parents=[common],
    )
    actions = group.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve: argparse.ArgumentParser = actions.add_parser(
        "serve", help="an MCP server (stdio or Streamable HTTP) in front of the ledger",
        description="Serve MCP clients as one agent host: tools/list is what this host's"
        " caller may call, tools/call is a proposal under the configured runtime context.",
        parents=[common],
    )
    serve.add_argument("--host", dest="host_name", required=True, help="the host identity")
    serve.add_argument(
        "--creds", type=Path, help="the host's NKey seed (default: the host's seed in --creds-dir)"
    )
    serve.add_argument("--nats-url", help="NATS server URL(s) (default: $OPLEDGER_NATS_URL)")
    context = serve.add_argument_group("runtime context (trusted: never from the MCP client)")
    context.add_argument("--principal", required=True, help="who the calls run for")
    context.add_argument("--tenant", required=True, help="the tenant the calls run for")
    context.add_argument("--capability", dest="capabilities", action="append", default=[],
                         metavar="CAP",
                         help="a capability the caller holds (repeatable; default: none)")
    context.add_argument("--environment", default="development",
                         help="the runtime environment (default: development)")
    context.add_argument("--conversation", default="mcp",
                         help="conversation ID of the proposals (default: mcp)")
    serve.add_argument("--transport", choices=["stdio", "http"], default="stdio",
                       help="how MCP clients connect (default: stdio)")
    serve.add_argument("--listen", default="127.0.0.1:8765", metavar="HOST:PORT",
                       help="for --transport http (default: 127.0.0.1:8765)")
    serve.add_argument("--path", default="/mcp", help="the MCP endpoint path (default: /mcp)")
    auth = serve.add_argument_group(
        "client authentication (--transport http)",
        f"Every HTTP request must carry `Authorization: Bearer <token>`: the token is read"
        f" from --token-file, else from ${_TOKEN_ENV}; at least 32 random bytes.",
    )
    auth.add_argument("--token-file", type=Path, metavar="PATH",
                      help="a file (mode 600) holding this gateway's one bearer token"
                      f" (default: ${_TOKEN_ENV})")
    auth.add_argument("--insecure-no-auth", action="store_true",
                      help="serve without a token; refused unless --listen is a loopback"
                      " address (default: a token is required)")
    serve.add_argument("--approval-round", type=_seconds, default=10.0, metavar="S",
                       help="seconds one round of a call awaiting approval waits (default: 10)")
    serve.add_argument("--outcome-wait", type=_seconds, default=60.0, metavar="S",
                       help="seconds one round of a ready call waits for its outcome (default: 60)")
    serve.add_argument("--dedup-window", type=_seconds, default=600.0, metavar="S",
                       help="identical writes within this window are one operation (default: 600)")
    serve.add_argument("--max-waiting", type=int, default=256, metavar="N",
                       help="calls held open at once; past it a call is answered at once"
                       " (default: 256)")
    serve.set_defaults(run=_serve)


def _host_identity(args: argparse.Namespace, settings: Settings) -> Any:
    from ledger.nats import Identity, Role, load_credentials

    if args.creds is not None:
        return Identity.from_seed_file(Role.HOST, args.host_name, args.creds)
    if settings.creds_dir is None:
        raise ConfigError("no host seed: give --creds or --creds-dir")
    return load_credentials(settings.creds_dir).host(args.host_name)


def _state_key() -> bytes:
    # Replicas behind one endpoint need one key (a round may reach another replica);
    # a single process may use a key of its own.
    from ledger.mcp._calls import STATE_KEY_MIN_BYTES

    text = os.environ.get(_STATE_KEY_ENV)
    if not text:
        return secrets.token_bytes(STATE_KEY_MIN_BYTES)
    key = text.encode()
    if len(key) < STATE_KEY_MIN_BYTES:
        raise McpConfigError(
            f"{_STATE_KEY_ENV} needs at least {STATE_KEY_MIN_BYTES} bytes"
            f" (e.g. {secrets.token_hex(STATE_KEY_MIN_BYTES)!r})"
        )
    return key


def _bearer_token(args: argparse.Namespace) -> str | None:
    """The HTTP endpoint's bearer token: from --token-file, else from the environment."""
    from ledger.mcp._auth import check_token, read_token_file

    from_env = os.environ.get(_TOKEN_ENV)
    if args.token_file is not None:
        if from_env:
            raise McpConfigError(
                f"give --token-file or {_TOKEN_ENV}, not both (which one do clients hold?)"
            )
        return read_token_file(args.token_file)
    if from_env:
        return check_token(from_env, _TOKEN_ENV)
    return None


def _listen(args: argparse.Namespace) -> Any:
    """Where and how the HTTP endpoint listens; refused before anything starts unless it
    authenticates its clients (`HttpListen.check`)."""
    from ledger.mcp.serving import HttpListen

    listen_host, _, port_text = str(args.listen).rpartition(":")
    if not listen_host or not port_text.isdigit():
        raise McpConfigError(f"--listen wants HOST:PORT, not {args.listen!r}")
    if args.transport != "http":
        if args.token_file is not None or args.insecure_no_auth:
            raise McpConfigError(
                "--token-file and --insecure-no-auth are for --transport http: over stdio,"
                " the client starts the gateway itself"
            )
        return HttpListen(host=listen_host, port=int(port_text), path=args.path)
    listen = HttpListen(
        host=listen_host, port=int(port_text), path=args.path, token=_bearer_token(args),
        insecure_no_auth=args.insecure_no_auth,
    )
    listen.check()
    return listen


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    from ledger.mcp.gateway import GatewaySettings
    from ledger.mcp.serving import serve_gateway
    from schemas import RuntimeContext

    if not settings.nats_url:
        raise ConfigError("no NATS URL: give --nats-url or set OPLEDGER_NATS_URL")
    listen = _listen(args)
    # Logs go to stderr: on stdio, stdout carries the protocol.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    gateway = GatewaySettings(
        host=args.host_name,
        context=RuntimeContext(
            principal=args.principal, tenant=args.tenant,
            capabilities=frozenset(args.capabilities), environment=args.environment,
        ),
        conversation_id=args.conversation,
        approval_round_s=args.approval_round,
        outcome_wait_s=args.outcome_wait,
        dedup_window_s=args.dedup_window,
        state_key=_state_key(),
        max_waiting=max(args.max_waiting, 0),
    )
    asyncio.run(
        serve_gateway(
            gateway, nats_url=settings.nats_url, identity=_host_identity(args, settings),
            transport=args.transport, listen=listen,
        )
    )
    return 0


# -------------------------------------------------------------- executor mcp


def add_executor_mcp(actions: Any, common: argparse.ArgumentParser) -> None:
    """Add `executor mcp` beside `executor run`."""
    run: argparse.ArgumentParser = actions.add_parser(
        "mcp", help="run one tool of an MCP server as this tool's executor",
        description="Run one tool of an existing MCP server as an opledger executor, under"
        " the tool's contract, until SIGTERM/SIGINT.",
        parents=[common],
    )
    run.add_argument("--tool", required=True, help="the contract's tool name")
    run.add_argument("--upstream-tool", help="the tool's name at the server (default: --tool)")
    _add_upstream(run)
    run.add_argument("--bearer-secret", metavar="NAME",
                     help="the executor secret holding a bearer token for --upstream"
                     " (default: none)")
    run.add_argument("--env-secret", action="append", default=[], metavar="VAR=NAME",
                     help="for --upstream-command: set VAR from the executor secret NAME"
                     " (repeatable; default: none)")
    run.add_argument("--lookup-tool", metavar="NAME",
                     help="a server tool that says whether an operation ID was applied"
                     " (default: none; unknown outcomes go to a person)")
    run.add_argument("--creds", type=Path,
                     help="this executor's NKey seed (default: none, development only)")
    run.add_argument("--secrets", type=Path,
                     help="JSON file of this executor's secrets (default: OPLEDGER_SECRET_* only)")
    run.add_argument("--name", help="executor identity (default: <tool>-mcp-<pid>)")
    run.add_argument("--nats-url", help="NATS server URL(s) (default: $OPLEDGER_NATS_URL)")
    run.add_argument("--contracts", type=Path,
                     help="contract directory (default: $OPLEDGER_CONTRACTS_DIR, else the samples)")
    run.add_argument("--batch", type=int, default=1, help="work items at once (default: 1)")
    run.add_argument("--log-level", default="INFO", help="DEBUG, INFO, ... (default: INFO)")
    run.set_defaults(run=_executor)


def _upstream(args: argparse.Namespace) -> Any:
    from ledger.mcp.executor import McpUpstream

    env: dict[str, str] = {}
    for pair in getattr(args, "env_secret", []):
        var, _, name = pair.partition("=")
        if not var or not name:
            raise McpConfigError(f"--env-secret wants VAR=NAME, not {pair!r}")
        env[var] = name
    command = tuple(shlex.split(args.upstream_command)) if args.upstream_command else ()
    return McpUpstream(
        url=args.upstream, command=command,
        bearer_secret=getattr(args, "bearer_secret", None), env_secrets=env,
    )


def _executor(args: argparse.Namespace, settings: Settings) -> int:
    from executors import (
        ExecutorRunner,
        ProcessorOptions,
        RunnerOptions,
        build_connect_options,
        load_contract,
        load_secrets,
        serve_until_stopped,
    )
    from ledger.mcp.executor import mcp_tool
    from schemas import OpledgerError

    if not settings.nats_url:
        raise ConfigError("no NATS URL: give --nats-url or set OPLEDGER_NATS_URL")
    contracts = args.contracts or settings.contracts_dir
    if contracts is None:
        raise ConfigError("no contract directory: give --contracts")
    logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        contract = load_contract(contracts, args.tool)
        tool = mcp_tool(
            args.tool, _upstream(args), upstream_tool=args.upstream_tool,
            version=contract.version, contract=contract, lookup_tool=args.lookup_tool,
        )
        name = args.name or f"{args.tool}-mcp-{os.getpid()}"[:128]
        runner = ExecutorRunner(
            tool, contract,
            RunnerOptions(
                ProcessorOptions(executor=name, secrets=load_secrets(args.secrets)),
                connect_options=build_connect_options(
                    nats_url=settings.nats_url, tool_name=tool.name, executor=name,
                    creds=args.creds,
                ),
                batch_size=max(args.batch, 1),
            ),
        )
    except (OpledgerError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    asyncio.run(serve_until_stopped(runner))
    return 0


# -------------------------------------------------------------- tools import-mcp


def add_import_mcp(actions: Any, common: argparse.ArgumentParser) -> None:
    """Add `tools import-mcp` beside `tools export`."""
    imports: argparse.ArgumentParser = actions.add_parser(
        "import-mcp", help="draft contracts from an MCP server's tools/list",
        description="Write one draft contract per tool of an MCP server: its schemas and"
        " description, with what no server declares (effect, risk, approval, idempotency,"
        " retry) left for an operator. The registry refuses a draft until it is completed.",
        parents=[common],
    )
    _add_upstream(imports)
    imports.add_argument("--tool", dest="tools", action="append", default=[], metavar="NAME",
                         help="only this tool (repeatable; default: every tool)")
    imports.add_argument("--out", type=Path, required=True, help="directory for the drafts")
    imports.add_argument("--overwrite", action="store_true",
                         help="replace existing files (default: refuse to)")
    imports.set_defaults(run=_import)


def _import(args: argparse.Namespace, settings: Settings) -> int:
    del settings
    from ledger.mcp.importer import list_upstream_tools

    paths = asyncio.run(
        list_upstream_tools(_upstream(args), names=args.tools, out=args.out,
                            overwrite=args.overwrite)
    )
    for path in paths:
        print(path)
    return 0
