"""`opledger web serve | token`: the approval page, and tokens for its embedded default.

    opledger web serve                       # loopback, the home's own key (below)
    opledger web token --as lead --group support_lead    # a token for that page
    opledger web serve --listen 0.0.0.0:8700 --issuer https://idp.example \\
        --audience opledger --jwks-url https://idp.example/jwks.json \\
        --group support-leads=support_lead --secure-cookies

Behind an identity provider, the page checks each bearer token against its
pinned key or JWKS, and `--group GROUP=ROLE,...` says which approver roles a
group of the token's `--roles-claim` carries (a group named nowhere carries
none). With no key given, it uses the home's own key pair (`<home>/web/`), and
a group there is the role of the same name: whoever can read that key can
sign tokens, as whoever can write the database can decide (break glass).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ledger.config import ConfigError, Settings
from ledger.entrypoints.parsing import EXIT_OK

__all__ = ["add_web_command"]

DEFAULT_LISTEN = "127.0.0.1:8700"


def add_web_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add `web serve` and `web token` to the subcommands `commands`."""
    web: argparse.ArgumentParser = commands.add_parser(
        "web",
        help="the approval web page",
        description="The approval web page: approvers log in with a bearer token and decide.",
        parents=[common],
    )
    actions = web.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve: argparse.ArgumentParser = actions.add_parser(
        "serve", help="serve the approval page until Ctrl-C",
        description="Serve the approval page until Ctrl-C.", parents=[common],
    )
    serve.add_argument(
        "--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
        help=f"where to listen (default: {DEFAULT_LISTEN})",
    )
    serve.add_argument("--issuer", help="the tokens' required `iss` (default: the home's key's)")
    serve.add_argument(
        "--audience", help="the tokens' required `aud` (default: the home's key's)"
    )
    keys = serve.add_mutually_exclusive_group()
    keys.add_argument("--public-key", type=Path, help="a pinned public key, PEM (default: none)")
    keys.add_argument("--jwks", type=Path, help="a JSON Web Key Set file (default: none)")
    keys.add_argument("--jwks-url", help="the identity provider's JWKS URL (default: none)")
    serve.add_argument(
        "--user-claim", default="sub", help="the claim naming the approver (default: sub)"
    )
    serve.add_argument(
        "--roles-claim", default="groups", help="the claim listing groups (default: groups)"
    )
    serve.add_argument(
        "--group", dest="groups", action="append", default=[], metavar="GROUP=ROLE[,ROLE]",
        help="the approver roles a group carries (repeatable; default: with the home's key,"
        " each group is the role of its name; otherwise none)",
    )
    serve.add_argument(
        "--secure-cookies", action="store_true",
        help="mark cookies Secure (and __Host-), for a page served over HTTPS (default: off)",
    )
    serve.add_argument(
        "--public-origin", metavar="URL",
        help="the origin browsers see, e.g. https://approvals.example, when a proxy"
        " rewrites Host (default: the request's Host)",
    )
    serve.set_defaults(run=_serve)
    token: argparse.ArgumentParser = actions.add_parser(
        "token", help="sign a token with the home's key, for the loopback page",
        description="Print a bearer token signed with the home's own key.", parents=[common],
    )
    token.add_argument("--as", dest="user", required=True, metavar="NAME", help="who")
    token.add_argument(
        "--group", dest="groups", action="append", default=[], metavar="GROUP",
        help="a group, i.e. an approver role on the loopback page (repeatable; default: none)",
    )
    token.add_argument(
        "--lifetime", type=int, default=8 * 3600, help="seconds (default: 28800, 8 hours)"
    )
    token.set_defaults(run=_token)


def _token(args: argparse.Namespace, settings: Settings) -> int:
    from ledger.web import LocalSigner

    print(LocalSigner(settings.home / "web").token(args.user, args.groups,
                                                   lifetime_s=args.lifetime))
    return EXIT_OK


def _role_map(flags: list[str]) -> dict[str, frozenset[str]]:
    roles: dict[str, frozenset[str]] = {}
    for flag in flags:
        group, sep, listed = flag.partition("=")
        held = frozenset(r.strip() for r in listed.split(",") if r.strip())
        if not group or not sep or not held:
            raise ConfigError(f"--group {flag!r}: write GROUP=ROLE[,ROLE...]")
        roles[group] = roles.get(group, frozenset()) | held
    return roles


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    import jwt
    import uvicorn

    from ledger.bootstrap import open_ledger
    from ledger.web import (
        LOCAL_AUDIENCE,
        LOCAL_ISSUER,
        LocalSigner,
        TokenSettings,
        TokenVerifier,
        WebOptions,
        build_web_app,
    )

    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--listen {args.listen!r}: write HOST:PORT")
    role_map: dict[str, frozenset[str]] = _role_map(args.groups)
    try:
        if args.public_key or args.jwks or args.jwks_url:
            if not args.issuer or not args.audience:
                raise ConfigError("with an identity provider's key, give --issuer and --audience")
            tokens = TokenSettings(
                issuer=args.issuer, audience=args.audience,
                public_key_pem=args.public_key.read_text() if args.public_key else None,
                jwks=TokenSettings.jwks_from_file(args.jwks) if args.jwks else None,
                jwks_url=args.jwks_url, user_claim=args.user_claim,
                roles_claim=args.roles_claim, role_map=role_map,
            )
        else:
            tokens = TokenSettings(
                issuer=args.issuer or LOCAL_ISSUER, audience=args.audience or LOCAL_AUDIENCE,
                public_key_pem=LocalSigner(settings.home / "web").public_key_pem(),
                algorithms=("EdDSA",), user_claim=args.user_claim,
                roles_claim=args.roles_claim, role_map=role_map,
                groups_are_roles=not role_map,
            )
        verifier = TokenVerifier(tokens)
    except (OSError, ValueError, jwt.PyJWTError) as error:
        raise ConfigError(f"the token settings are unusable: {error}") from None
    if not args.secure_cookies and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {host} without --secure-cookies: the session cookie"
              " would also travel over plain HTTP", file=sys.stderr)
    ledger = open_ledger(settings.storage(), read_only=False, contracts_dir=settings.contracts_dir)
    app = build_web_app(
        ledger,
        WebOptions(verifier=verifier, secure_cookies=args.secure_cookies,
                   public_origin=args.public_origin),
    )
    print(f"approval page on http://{host}:{port}/ (Ctrl-C stops it)", flush=True)
    try:
        uvicorn.Server(
            uvicorn.Config(app, host=host, port=int(port), log_level="warning",
                           server_header=False, proxy_headers=False)
        ).run()
    finally:
        ledger.close()
    return EXIT_OK

