"""`opledger tools export`: the tools a host may call, as a model API wants them.

    opledger tools export --format openai --capability email:send --capability documents:search

Prints a JSON list of tool definitions (OpenAI function tools, Anthropic tools,
or MCP `Tool`s; `policy.export_tool`), one per contract in the catalog that a
caller holding the given capabilities may call at all: tools whose contract
forbids agents (`approval: forbidden`) and tools needing a capability not given
are left out, so a model is never offered a call that can only be refused.
Without `--capability`, every tool that agents may call is listed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ledger.config import ConfigError, Settings
from ledger.entrypoints.parsing import EXIT_OK
from ledger.mcp.cli import add_import_mcp
from policy import ContractRegistry, export_tool, offered_contracts

__all__ = ["add_tools_command", "offered_contracts"]


def add_tools_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add `tools export` to the subcommands `commands`."""
    tools: argparse.ArgumentParser = commands.add_parser(
        "tools", help="the tool catalog, for hosts and their models",
        description="The tool catalog, for hosts and their models.", parents=[common],
    )
    actions = tools.add_subparsers(dest="action", required=True, metavar="ACTION")
    export: argparse.ArgumentParser = actions.add_parser(
        "export", help="tool definitions in a model API's format (JSON on stdout)",
        description="Print the tools a caller may call as OpenAI, Anthropic or MCP tool"
        " definitions.", parents=[common],
    )
    export.add_argument(
        "--format", dest="fmt", choices=["openai", "anthropic", "mcp"], default="openai",
        help="the definitions' format (default: openai)",
    )
    export.add_argument(
        "--capability", dest="capabilities", action="append", default=None, metavar="CAP",
        help="a capability the caller holds (repeatable; default: list every tool agents"
        " may call)",
    )
    export.add_argument(
        "--contracts", type=Path, default=None,
        help="contract directory (default: $OPLEDGER_CONTRACTS_DIR, else the samples)",
    )
    export.set_defaults(run=_export)
    add_import_mcp(actions, common)


def _export(args: argparse.Namespace, settings: Settings) -> int:
    directory = settings.contracts_dir if args.contracts is None else args.contracts
    if directory is None:  # the settings fill in the samples: never None in practice
        raise ConfigError("no contract directory: give --contracts")
    try:
        catalog = ContractRegistry.from_directory(directory).pin_latest()
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read the contracts in {directory}: {error}") from None
    capabilities = None if args.capabilities is None else frozenset(args.capabilities)
    contracts = offered_contracts([contract for _, contract in catalog.items()], capabilities)
    print(json.dumps([export_tool(c, args.fmt) for c in contracts], indent=2))
    return EXIT_OK
