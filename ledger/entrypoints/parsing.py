"""What every `opledger` command shares: its parser class, global options, exit codes,
and the one way flags become `Settings`.

Exit codes (the table in docs/operations.md):

- 0 `EXIT_OK`: done.
- 1 `EXIT_FINDINGS`: `audit verify` found faults (also: a demo step misbehaved,
  a process stopped on an unexpected error).
- 2 `EXIT_REFUSED`: a refusal or an error, in one line: bad settings, no ledger
  (`NO_LEDGER`), an unknown operation, a refused approval.
- 64 `EXIT_USAGE`: the command line itself is wrong (unknown command or flag, a
  flag's value that does not parse); nothing ran. `EX_USAGE` of sysexits.h.
- 141 `EXIT_BROKEN_PIPE`: the reader of stdout went away.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

from ledger.config import Settings

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_FINDINGS",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_USAGE",
    "SETTING_OPTIONS",
    "CommandParser",
    "DefaultsHelpFormatter",
    "global_options",
    "settings_from",
]

EXIT_OK = 0
"""The command did what was asked."""
EXIT_FINDINGS = 1
"""`audit verify` found faults."""
EXIT_REFUSED = 2
"""A refusal or an error, printed as one line: settings, no ledger, unknown operation."""
EXIT_USAGE = 64
"""The command line is wrong (`EX_USAGE`); kept apart from refusals so scripts can tell."""
EXIT_BROKEN_PIPE = 141
"""The reader of stdout went away (128 + SIGPIPE, as a shell reports it)."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already says it.

    `ArgumentDefaultsHelpFormatter` would print "(default: None)" for an option
    whose default is "whatever the settings say"; those help texts say what
    unset means themselves, and a test checks that each one does.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.default is None:
            return text
        return f"{text} (default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose usage errors exit `EXIT_USAGE` (64), not argparse's 2.

    Exit code 2 already means a refusal (no ledger, bad settings): a script
    must be able to tell "you typed it wrong" from "the ledger said no".
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print the usage and the problem on stderr; exit `EXIT_USAGE`."""
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


SETTING_OPTIONS: dict[str, str] = {
    "home": "home",
    "database": "database",
    "postgres_schema": "postgres_schema",
    "nats_url": "nats_url",
    "contracts": "contracts_dir",
    "creds_dir": "creds_dir",
}
"""Parsed option (its `dest`) → the `Settings` field it overrides, for every command."""


def settings_from(args: argparse.Namespace) -> Settings:
    """The settings for one command: its flags over `OPLEDGER_*` over `opledger.toml`.

    The one place any command turns options into settings, so the database
    (and every other setting) is read the same way by all of them.
    """
    given = {
        setting: getattr(args, dest)
        for dest, setting in SETTING_OPTIONS.items()
        if getattr(args, dest, None) is not None
    }
    return Settings(**given)


def global_options() -> argparse.ArgumentParser:
    """The options every command takes, before or after its name (a parent parser)."""
    # SUPPRESS: an option given before the subcommand is not reset by the subcommand's default.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--home",
        type=Path,
        default=argparse.SUPPRESS,
        help="state directory (default: $OPLEDGER_HOME or .opledger)",
    )
    common.add_argument(
        "--database",
        default=argparse.SUPPRESS,
        metavar="DATABASE",
        help="SQLite file (a path, sqlite:///ABS or sqlite:REL) or postgresql:// DSN"
        " (default: $OPLEDGER_DATABASE or <home>/ledger.db)",
    )
    common.add_argument(
        "--postgres-schema",
        default=argparse.SUPPRESS,
        metavar="SCHEMA",
        help="the PostgreSQL schema of the ledger's tables"
        " (default: $OPLEDGER_POSTGRES_SCHEMA, else the server's default)",
    )
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="machine-readable output, for the inspection commands (default: text)",
    )
    return common
