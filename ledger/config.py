"""Operator settings: environment variables `OPLEDGER_*` and an optional `opledger.toml`.

Precedence, highest first: values passed to `Settings(...)` (the CLI's
options), environment variables (`OPLEDGER_HOME`, `OPLEDGER_DATABASE`, ...),
the TOML file `<home>/opledger.toml`, then the defaults. Relative paths are
relative to the current working directory, wherever they were given. A
`<home>/opledger.toml` looks like:

    database = "postgresql://ledger@db.internal/opledger"
    postgres_schema = "ledger"
    contracts_dir = "/etc/opledger/contracts"

    [approver_roles]
    lead = ["support_lead"]
    fin-1 = ["finance_approver"]

Every misconfiguration raises `ConfigError` with one line that names the
setting, and never echoes a DSN (it may hold a password).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from psycopg import ProgrammingError
from psycopg.conninfo import conninfo_to_dict
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from ledger.adapters.storage import StorageConfig
from schemas import ErrorCategory, OpledgerError, check_token

__all__ = [
    "CONFIG_FILE_NAME",
    "DEFAULT_HOME",
    "ENV_PREFIX",
    "ConfigError",
    "Settings",
    "config_file",
    "find_home",
    "parse_database",
    "seconds_argument",
]

ENV_PREFIX = "OPLEDGER_"
"""The prefix of every environment variable opledger reads."""

DEFAULT_HOME = Path(".opledger")
"""The state directory's name: without `--home` or `OPLEDGER_HOME`, the nearest
`.opledger` folder in the current folder or above it (`find_home`), else this one."""


def find_home(start: Path | None = None) -> Path:
    """The state directory a command uses when none is named: the nearest `.opledger`
    folder in `start` (the current folder) or one of its parents, as git finds its
    repository, so that `opledger` works from any folder under a stack; if there is
    none, `.opledger` in `start` (where `opledger up` then creates it)."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / DEFAULT_HOME).is_dir():
            return folder / DEFAULT_HOME
    return here / DEFAULT_HOME

CONFIG_FILE_NAME = "opledger.toml"
"""The optional settings file inside the home directory."""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_CONNINFO = re.compile(r"^\s*[A-Za-z_]+\s*=")
_POSTGRES_SCHEMES = frozenset({"postgresql", "postgres"})
_NATS_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class ConfigError(OpledgerError):
    """The settings are unusable; the message says which one and why, in one line."""

    category = ErrorCategory.INVALID_INPUT
    code = "INVALID_CONFIG"


class Settings(BaseSettings):
    """Where the ledger keeps its state and what it connects to (immutable once read)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )

    home: Path = Field(default_factory=find_home)
    """The state directory (`OPLEDGER_HOME`); holds `opledger.toml` and the default database.
    Unset: the nearest `.opledger` in the current folder or above (`find_home`)."""

    database: str | None = None
    """A SQLite file path or a `postgresql://` DSN; unset means `<home>/ledger.db`."""

    postgres_schema: str = ""
    """The PostgreSQL schema for the ledger's tables; empty means the server's default."""

    contracts_dir: Path | None = None
    """The directory of tool contracts; unset means the sample catalog."""

    nats_url: str | None = None
    """The NATS server(s), e.g. `nats://127.0.0.1:4222`; comma-separated for a cluster."""

    creds_dir: Path | None = None
    """The directory of NATS credentials; unset means `<home>/creds`."""

    host_tenants: dict[str, frozenset[str]] | None = None
    """Agent host → the tenants it may act for; unset trusts every host for every tenant."""
    approver_roles: dict[str, frozenset[str]] | None = None
    """Approver identity → the approver roles it holds (`[approver_roles]` in
    opledger.toml); the ledger's word, never the approver's. Unset: nobody holds any."""

    def __init__(self, **values: Any) -> None:
        """Read the settings; raises `ConfigError` instead of a validation report."""
        try:
            super().__init__(**values)
        except ValidationError as error:
            raise ConfigError(_first_problem(error), setting=_first_setting(error)) from None
        except tomllib.TOMLDecodeError as error:
            where = config_file(values.get("home") or os.environ.get(f"{ENV_PREFIX}HOME"))
            raise ConfigError(f"{where} is not valid TOML: {error}") from None
        except OSError as error:
            where = config_file(values.get("home") or os.environ.get(f"{ENV_PREFIX}HOME"))
            raise ConfigError(f"cannot read {where}: {error.strerror}") from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,  # noqa: ARG003 (called by keyword)
        file_secret_settings: PydanticBaseSettingsSource,  # noqa: ARG003
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments, then `OPLEDGER_*` variables, then `<home>/opledger.toml`.

        No `.env` file and no secrets directory: one file, in one known place.
        """
        toml_file = config_file(init_settings().get("home") or env_settings().get("home"))
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file)

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any) -> Any:
        """Resolve the defaults that depend on `home`."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        home = Path(data.get("home") or find_home())
        if not data.get("database"):
            data["database"] = str(home / "ledger.db")
        if not data.get("creds_dir"):
            data["creds_dir"] = home / "creds"
        if not data.get("contracts_dir"):
            from policy.catalog import CATALOG_DIR

            data["contracts_dir"] = CATALOG_DIR
        return data

    @model_validator(mode="after")
    def _check(self) -> Settings:
        """Refuse settings that cannot work, before anything connects."""
        self.storage()
        _check_contracts_dir(self.contracts_dir)
        if self.nats_url is not None:
            _check_nats_url(self.nats_url)
        for approver, roles in (self.approver_roles or {}).items():
            if any(not role or role != role.strip() for role in roles):
                raise ConfigError(
                    f"approver_roles gives {approver!r} a blank role or one with spaces"
                    " around it",
                    setting="approver_roles",
                )
            try:
                check_token(approver)  # the same rule as the approver's subject
            except ValueError:
                raise ConfigError(
                    f"approver_roles names {approver!r}, which is not a valid identity name",
                    setting="approver_roles",
                ) from None
            if not roles:
                raise ConfigError(
                    f"approver_roles gives {approver!r} no role; leave it out instead",
                    setting="approver_roles",
                )
        for host, tenants in (self.host_tenants or {}).items():
            try:
                check_token(host)  # the same rule as the host's subjects
            except ValueError:
                raise ConfigError(
                    f"host_tenants names the host {host!r}, which is not a valid host name",
                    setting="host_tenants",
                ) from None
            if not tenants:
                raise ConfigError(
                    f"host_tenants gives the host {host!r} no tenant; leave it out instead",
                    setting="host_tenants",
                )
        return self

    def storage(self) -> StorageConfig:
        """The storage backend these settings name (see `parse_database`)."""
        return parse_database(self.database or str(self.home / "ledger.db"), self.postgres_schema)


def config_file(home: Path | str | None) -> Path:
    """The settings file of the home directory `home` (or of the one `find_home` finds)."""
    return Path(home or find_home()) / CONFIG_FILE_NAME


def parse_database(database: str, postgres_schema: str = "") -> StorageConfig:
    """The one reading of a database setting, for every command; `ConfigError` otherwise.

    - a plain path, `sqlite:///abs/path` (absolute) or `sqlite:relative/path`:
      a SQLite file;
    - `postgresql://…` or `postgres://…` (the scheme in any case, passed on in lower
      case): a PostgreSQL DSN, in `postgres_schema` when that is given;
    - any other scheme, or a `key=value` connection string: refused in one line.
    """
    scheme = _scheme(database)
    if scheme in _POSTGRES_SCHEMES:
        # libpq accepts the scheme in lower case only: `POSTGRESQL://` is the same DSN.
        return _postgres(scheme + database[len(scheme) :], postgres_schema)
    if postgres_schema:
        raise ConfigError(
            "postgres_schema is set but database is not a postgresql:// DSN",
            setting="postgres_schema",
        )
    return StorageConfig.sqlite(_sqlite_path(database, scheme))


def _scheme(database: str) -> str | None:
    match = _SCHEME.match(database)
    if match:
        return match.group(1).lower()
    if database[: len("sqlite:")].lower() == "sqlite:":
        return "sqlite"
    return None


def _postgres(dsn: str, schema: str) -> StorageConfig:
    try:
        conninfo_to_dict(dsn)
    except ProgrammingError:
        # The DSN may hold a password: never echo it.
        raise ConfigError("database is not a valid PostgreSQL DSN", setting="database") from None
    if schema and not _SCHEMA_NAME.match(schema):
        raise ConfigError(
            f"postgres_schema must be a plain lowercase identifier, not {schema!r}",
            setting="postgres_schema",
        )
    return StorageConfig.postgres(dsn, schema)


def _sqlite_path(database: str, scheme: str | None) -> Path:
    if scheme == "sqlite":
        # `sqlite:///abs` keeps its third slash (absolute); `sqlite:rel` is relative.
        rest = database[len("sqlite:") :]
        database = rest[2:] if rest.startswith("//") else rest
    elif scheme is not None:
        raise ConfigError(
            f"database has the unknown scheme '{scheme}://'; "
            "give a SQLite file path or a postgresql:// DSN",
            setting="database",
        )
    elif _CONNINFO.match(database):
        raise ConfigError(
            "database looks like a key=value connection string; write it as a postgresql:// URL",
            setting="database",
        )
    if not database.strip():
        raise ConfigError("database names no SQLite file", setting="database")
    path = Path(database)
    if path.is_dir():
        raise ConfigError(f"database {path} is a directory, not a SQLite file", setting="database")
    return path


def _check_contracts_dir(contracts_dir: Path | None) -> None:
    if contracts_dir is not None and not contracts_dir.is_dir():
        raise ConfigError(
            f"contracts_dir {contracts_dir} does not exist or is not a directory",
            setting="contracts_dir",
        )


def _check_nats_url(nats_url: str) -> None:
    for server in (part.strip() for part in nats_url.split(",")):
        scheme = _scheme(server)
        if not server or (scheme is not None and scheme not in _NATS_SCHEMES):
            raise ConfigError(
                f"nats_url must list nats://, tls://, ws:// or wss:// servers, not '{scheme}://'"
                if scheme
                else "nats_url names an empty server",
                setting="nats_url",
            )


def _first_setting(error: ValidationError) -> str:
    problems = error.errors()
    return ".".join(str(part) for part in problems[0]["loc"]) if problems else ""


def _first_problem(error: ValidationError) -> str:
    problems = error.errors()
    if not problems:
        return "invalid settings"
    first, setting = problems[0], _first_setting(error) or "settings"
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    if first["type"] == "extra_forbidden":
        return f"unknown setting '{setting}' (check {CONFIG_FILE_NAME}){more}"
    return f"invalid setting {setting} ({ENV_PREFIX}{setting.upper()}): {first['msg']}{more}"


def seconds_argument(text: str) -> float:
    """A duration given on a command line: 0 or more seconds, finite (an argparse `type`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < math.inf:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be 0 or a positive number of seconds: {text!r}")
    return value
