"""The approval page: a queue, one screen per call with its effect, approve or deny.

Plain HTML forms rendered on the server (Starlette and Jinja2); no script and
no build step. Every page needs a verified bearer token (`_auth`), from the
`Authorization` header a proxy adds or from the session cookie the login form
sets. An approval posts the proposal hash that was on the screen (and, for a
call its tool previews, the preview's hash), so it counts for exactly the call
and the effect the person saw: had either changed, the ledger refuses it
(`proposal_hash_mismatch`, `preview_hash_mismatch`) and says so. Decisions are recorded as the
token's user with the roles the configuration maps their groups to, and
`via: web`.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ledger.domain.errors import ApprovalRefused, LedgerError
from ledger.domain.event_kinds import when_text
from ledger.domain.operation import Operation, same_person
from ledger.domain.plan import Plan, PlanState
from ledger.domain.states import TERMINAL_STATES, OperationState
from ledger.entrypoints.plans import plan_view
from ledger.entrypoints.views import approval_view, pending_view, timeline_entry
from ledger.service import Ledger
from ledger.web._auth import Approver, NotAuthenticated, TokenVerifier
from ledger.web._csrf import CsrfGuard
from schemas import DIGEST_PATTERN

__all__ = ["SESSION_COOKIE", "WebOptions", "build_web_app"]

_log = logging.getLogger("opledger.web")
_HERE = Path(__file__).parent

SESSION_COOKIE = "opledger_session"
"""The session cookie's name; `__Host-` is put in front of it with secure cookies
(the browser then keeps it to this exact host and path, over HTTPS only)."""
_LOGIN_COOKIE = "opledger_login"
_PROPOSAL_HASH = re.compile(DIGEST_PATTERN)
_DECISIONS = frozenset({"approve", "deny"})
_MAX_BODY = 64 * 1024
"""A form here is a hash, a token and a reason: anything larger is not one of ours."""

_HEADERS = {
    # Nothing but this page's own styles; no script at all; never in a frame.
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self';"
    " form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    # `same-origin`, not `no-referrer`: under `no-referrer` a browser sends its form
    # posts with `Origin: null`, and the origin check below could not tell ours.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class WebOptions:
    """How the page authenticates and what it tells browsers."""

    verifier: TokenVerifier
    secure_cookies: bool = False
    """Mark cookies `Secure` (behind HTTPS; off for the loopback default)."""
    csrf_key: bytes | None = None
    """The form-token key; None: a fresh random one per process."""
    public_origin: str | None = None
    """The origin browsers see (`https://approvals.example`), for the check of a form
    post's `Origin` behind a proxy that rewrites `Host`; None: the request's `Host`."""


def build_web_app(ledger: Ledger, options: WebOptions) -> Starlette:
    """The approval page over `ledger` (which it reads, and records decisions in)."""
    page = _Page(ledger, options)
    routes = [
        Route("/", page.home),
        Route("/login", page.login_form, methods=["GET"]),
        Route("/login", page.login, methods=["POST"]),
        Route("/logout", page.logout, methods=["POST"]),
        Route("/approvals", page.queue),
        Route("/approvals/{operation_id:path}", page.approval),
        Route("/approve/{operation_id:path}", page.approve, methods=["POST"]),
        Route("/deny/{operation_id:path}", page.deny, methods=["POST"]),
        Route("/operations/{operation_id:path}", page.operation),
        Route("/plans/{plan_id:path}", page.plan),
        Route("/approve-plan/{plan_id:path}", page.approve_plan, methods=["POST"]),
        Route("/deny-plan/{plan_id:path}", page.deny_plan, methods=["POST"]),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes, max_body_size=_MAX_BODY)


class _Page:
    def __init__(self, ledger: Ledger, options: WebOptions) -> None:
        self._ledger = ledger
        self._options = options
        self._csrf = CsrfGuard(options.csrf_key)
        self._templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(_HERE / "templates"),
            autoescape=True,  # every value on these pages came from a model or a host
            undefined=jinja2.StrictUndefined,
        )
        self._templates.filters["when"] = when_text

    # ------------------------------------------------------------------ helpers

    async def _render(
        self, request: Request, name: str, status: int = 200, **context: Any
    ) -> HTMLResponse:
        if "csrf" not in context:
            # Every page with a session has the sign-out form, which needs its token.
            session = await self._session(request)
            context["csrf"] = self._csrf.token_for(_session_key(session[0])) if session else ""
        html = self._templates.get_template(name).render(request=request, **context)
        return HTMLResponse(html, status_code=status, headers=_HEADERS)

    async def _session(self, request: Request) -> tuple[str, Approver] | None:
        """The bearer token in use and who it names, or None (not logged in).

        Checked once per request, in a worker thread: with a JWKS URL the first
        check fetches the key set, which must not stall every other request.
        """
        if "session" in request.state._state:
            cached: tuple[str, Approver] | None = request.state.session
            return cached
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        token = token or request.cookies.get(self._session_cookie, "")
        session = None
        if token:
            try:
                session = token, await run_in_threadpool(self._options.verifier.verify, token)
            except NotAuthenticated:
                session = None
        request.state.session = session
        return session

    @property
    def _session_cookie(self) -> str:
        return ("__Host-" if self._options.secure_cookies else "") + SESSION_COOKIE

    def _same_origin(self, request: Request) -> bool:
        origin = request.headers.get("origin")
        if origin is None or origin == "null":
            # Browsers send Origin with every form POST; a missing one is not a
            # browser on another site (whose forms always carry theirs).
            return origin is None
        if self._options.public_origin is not None:
            return origin.rstrip("/") == self._options.public_origin.rstrip("/")
        return urlsplit(origin).netloc == request.headers.get("host", "")

    def _login_redirect(self, request: Request) -> Response:
        target = quote(request.url.path, safe="/")
        return RedirectResponse(f"/login?next={target}", status_code=303, headers=_HEADERS)

    async def _form(self, request: Request, token: str) -> dict[str, str] | None:
        """The posted form, if it came from this page's own form for this session."""
        if not self._same_origin(request):
            return None
        form = await request.form()
        fields = {key: value for key, value in form.items() if isinstance(value, str)}
        if not self._csrf.check(_session_key(token), fields.get("csrf", "")):
            return None
        return fields

    async def _forbidden(
        self, request: Request, approver: Approver | None, message: str = ""
    ) -> HTMLResponse:
        return await self._render(
            request, "message.html", 403, approver=approver, title="Refused",
            message=message or "This form did not come from this page (or the page was"
            " reloaded since): go back and try again.",
        )

    async def _not_found(self, request: Request, approver: Approver) -> HTMLResponse:
        # The same answer for a missing operation and one this person may not see.
        return await self._render(
            request, "message.html", 404, approver=approver, title="No such operation",
            message="There is no such operation among the calls you may decide.",
        )

    async def _operation_of(
        self, request: Request
    ) -> tuple[str, Approver, Operation] | Response:
        """The session and the operation the path names, or the answer instead: the
        login form, or not found for a missing operation and one not theirs to see."""
        session = await self._session(request)
        if session is None:
            return self._login_redirect(request)
        token, approver = session
        try:
            operation = self._ledger.get(request.path_params["operation_id"])
        except LedgerError:
            return await self._not_found(request, approver)
        if not self._visible(operation, approver):
            return await self._not_found(request, approver)
        return token, approver, operation

    def _visible(self, operation: Operation, approver: Approver) -> bool:
        """Whether `approver` may see `operation`: it asked for one of their roles."""
        approval = operation.approval
        return approval is not None and bool(approver.roles & set(approval.approver_roles))

    # ------------------------------------------------------------------ pages

    async def home(self, request: Request) -> Response:
        target = "/approvals" if await self._session(request) else "/login"
        return RedirectResponse(target, status_code=303, headers=_HEADERS)

    async def login_form(self, request: Request, *, error: str = "") -> Response:
        nonce = secrets.token_urlsafe(24)
        response = await self._render(
            request, "login.html", 401 if error else 200, approver=None, error=error,
            csrf=self._csrf.token_for(nonce), next=_local(request.query_params.get("next")),
        )
        self._set_cookie(response, _LOGIN_COOKIE, nonce, max_age=600)
        return response

    async def login(self, request: Request) -> Response:
        nonce = request.cookies.get(_LOGIN_COOKIE, "")
        form = await request.form()
        fields = {key: value for key, value in form.items() if isinstance(value, str)}
        if not nonce or not self._same_origin(request) or not self._csrf.check(
            nonce, fields.get("csrf", "")
        ):
            return await self._forbidden(request, None)
        token = fields.get("token", "").strip()
        try:
            approver = self._options.verifier.verify(token)
        except NotAuthenticated as refusal:
            _log.info("login refused: %s", refusal.message)
            return await self.login_form(request, error=refusal.message)
        _log.info("login: %s with roles %s", approver.name, sorted(approver.roles))
        response = RedirectResponse(
            _local(fields.get("next")), status_code=303, headers=_HEADERS
        )
        lifetime = int((approver.expires_at - datetime.now(UTC)).total_seconds())
        self._set_cookie(response, self._session_cookie, token, max_age=max(lifetime, 1))
        response.delete_cookie(_LOGIN_COOKIE)
        return response

    async def logout(self, request: Request) -> Response:
        """Forget the session here (the token itself stays valid until it expires: its
        issuer revokes it, if it can)."""
        session = await self._session(request)
        if session is not None and await self._form(request, session[0]) is None:
            return await self._forbidden(request, session[1])
        response = RedirectResponse("/login", status_code=303, headers=_HEADERS)
        response.delete_cookie(self._session_cookie)
        return response

    async def queue(self, request: Request) -> Response:
        session = await self._session(request)
        if session is None:
            return self._login_redirect(request)
        token, approver = session
        rows = self._ledger.projector.rows(
            state=OperationState.AWAITING_APPROVAL.value, current=True
        )
        pending = []
        for row in rows:
            item = pending_view(asdict(row))
            operation = self._ledger.get(item["operation_id"])
            if not self._visible(operation, approver):
                continue  # another team's call: not theirs to see
            item["own"] = same_person(operation.actor) == same_person(approver.name)
            pending.append(item)
        plans = []
        for plan_id in self._ledger.plans.open_ids():
            plan = self._ledger.plans.get(plan_id)
            approval = plan.approval
            if (
                plan.state is PlanState.AWAITING_APPROVAL
                and approval is not None
                and approver.roles & set(approval.approver_roles)
            ):
                plans.append(plan_view(self._ledger, plan.id) | {
                    "own": plan.is_requester(approver.name)
                })
        return await self._render(
            request, "queue.html", approver=approver, pending=pending, plans=plans,
            csrf=self._csrf.token_for(_session_key(token)),
        )

    async def approval(self, request: Request, *, error: str = "", status: int = 200) -> Response:
        found = await self._operation_of(request)
        if isinstance(found, Response):
            return found
        token, approver, operation = found
        assert operation.approval is not None
        view = approval_view(operation)
        given = [
            {"approver": g.approver, "roles": sorted(g.roles), "via": g.via}
            for g in operation.approvals_given
        ]
        proposal = operation.proposal
        return await self._render(
            request, "approval.html", status, approver=approver, view=view, given=given,
            required_from=dict(operation.approval.required_from),
            still_needed=operation.approval.still_needed(operation.approvals_given),
            proposal=proposal, awaiting=operation.state is OperationState.AWAITING_APPROVAL,
            expired=datetime.now(UTC) >= operation.approval.expires_at,
            own=operation.approval.separation_of_duties
            and same_person(operation.actor) == same_person(approver.name),
            csrf=self._csrf.token_for(_session_key(token)), error=error,
        )

    async def approve(self, request: Request) -> Response:
        return await self._decide(request, "approve")

    async def deny(self, request: Request) -> Response:
        return await self._decide(request, "deny")

    async def _decision(
        self, request: Request, decision: str, subject: str
    ) -> tuple[Approver, dict[str, str]] | Response:
        """Who decides and the form they posted, or the answer instead: the login form,
        a form that did not come from this page for this session, or no approver role
        (someone the identity provider knows but this deployment made no approver:
        refused, logged, and nothing appended to anyone's ledger)."""
        session = await self._session(request)
        if session is None:
            return self._login_redirect(request)
        token, approver = session
        fields = await self._form(request, token)
        if fields is None:
            return await self._forbidden(request, approver)
        if not approver.roles:
            _log.info("%s of %s by %s refused: no approver role", decision, subject,
                      approver.name)
            return await self._forbidden(request, approver, "You hold no approver role here.")
        return approver, fields

    async def _decide(self, request: Request, decision: str) -> Response:
        operation_id = request.path_params["operation_id"]
        posted = await self._decision(request, decision, operation_id)
        if isinstance(posted, Response):
            return posted
        approver, fields = posted
        shown_preview = fields.get("preview_hash") or None
        if decision == "approve" and (
            not _PROPOSAL_HASH.match(fields.get("proposal_hash", ""))
            or (shown_preview is not None and not _PROPOSAL_HASH.match(shown_preview))
        ):
            return await self._render(
                request, "message.html", 400, approver=approver, title="Not a proposal hash",
                message="The form did not carry the proposal hash of a call: open the call"
                " again and approve from its page.",
            )
        try:
            if decision == "approve":
                self._ledger.approve(
                    operation_id, approver=approver.name, approver_roles=approver.roles,
                    proposal_hash=fields.get("proposal_hash", ""), via="web",
                    preview_hash=shown_preview,
                )
            else:
                self._ledger.deny(
                    operation_id, approver=approver.name, approver_roles=approver.roles,
                    reason=fields.get("reason", "")[:500], via="web",
                )
        except (ApprovalRefused, LedgerError) as refusal:
            _log.info("%s of %s by %s refused: %s", decision, operation_id, approver.name,
                      refusal.message)
            try:
                visible = self._visible(self._ledger.get(operation_id), approver)
            except LedgerError:
                visible = False
            if visible:
                return await self.approval(request, error=refusal.message, status=409)
            return await self._render(request, "message.html", 409, approver=approver,
                                      title="Refused", message=refusal.message)
        _log.info("%s of %s by %s", decision, operation_id, approver.name)
        return RedirectResponse(
            f"/operations/{quote(operation_id, safe='/')}?decided={decision}",
            status_code=303, headers=_HEADERS,
        )

    async def operation(self, request: Request) -> Response:
        found = await self._operation_of(request)
        if isinstance(found, Response):
            return found
        token, approver, operation = found
        timeline = [timeline_entry(event) for event in self._ledger.history(operation.id)]
        final = operation.state in TERMINAL_STATES
        decided = request.query_params.get("decided", "")
        return await self._render(
            request, "operation.html", approver=approver, operation=operation,
            state=operation.state.value, final=final, timeline=timeline,
            outcome=operation.outcome.as_dict() if operation.outcome else None,
            decided=decided if decided in _DECISIONS else "",
            csrf=self._csrf.token_for(_session_key(token)),
        )

    # ------------------------------------------------------------------ plans

    async def _plan_of(self, request: Request) -> tuple[str, Approver, Plan] | Response:
        """The session and the plan the path names, or the answer instead (the login
        form, or not found for a missing plan and one not theirs to decide)."""
        session = await self._session(request)
        if session is None:
            return self._login_redirect(request)
        token, approver = session
        try:
            plan = self._ledger.plans.get(request.path_params["plan_id"])
        except LedgerError:
            return await self._not_found(request, approver)
        approval = plan.approval
        if approval is None or not approver.roles & set(approval.approver_roles):
            return await self._not_found(request, approver)
        return token, approver, plan

    async def plan(self, request: Request, *, error: str = "", status: int = 200) -> Response:
        """A plan as its approvers decide on it: every step's exact effect, in order."""
        found = await self._plan_of(request)
        if isinstance(found, Response):
            return found
        token, approver, plan = found
        assert plan.approval is not None
        view = plan_view(self._ledger, plan.id)
        decided = request.query_params.get("decided", "")
        return await self._render(
            request, "plan.html", status, approver=approver, view=view,
            steps=plan.approval.effect_preview.get("steps", []),
            awaiting=plan.state is PlanState.AWAITING_APPROVAL,
            expired=datetime.now(UTC) >= plan.approval.expires_at,
            own=plan.approval.separation_of_duties and plan.is_requester(approver.name),
            still_needed=plan.approval.still_needed(plan.approvals_given),
            decided=decided if decided in _DECISIONS else "",
            csrf=self._csrf.token_for(_session_key(token)), error=error,
        )

    async def approve_plan(self, request: Request) -> Response:
        return await self._decide_plan(request, "approve")

    async def deny_plan(self, request: Request) -> Response:
        return await self._decide_plan(request, "deny")

    async def _decide_plan(self, request: Request, decision: str) -> Response:
        plan_id = request.path_params["plan_id"]
        posted = await self._decision(request, decision, f"plan {plan_id}")
        if isinstance(posted, Response):
            return posted
        approver, fields = posted
        if decision == "approve" and not _PROPOSAL_HASH.match(fields.get("plan_hash", "")):
            return await self._render(
                request, "message.html", 400, approver=approver, title="Not a plan hash",
                message="The form did not carry the hash of a plan: open the plan again and"
                " approve from its page.",
            )
        try:
            if decision == "approve":
                self._ledger.approve_plan(
                    plan_id, approver=approver.name, approver_roles=approver.roles,
                    plan_hash=fields.get("plan_hash", ""), via="web",
                )
            else:
                self._ledger.deny_plan(
                    plan_id, approver=approver.name, approver_roles=approver.roles,
                    reason=fields.get("reason", "")[:500], via="web",
                )
        except (ApprovalRefused, LedgerError) as refusal:
            _log.info("%s of plan %s by %s refused: %s", decision, plan_id, approver.name,
                      refusal.message)
            found = await self._plan_of(request)
            if isinstance(found, Response):
                return await self._render(request, "message.html", 409, approver=approver,
                                          title="Refused", message=refusal.message)
            return await self.plan(request, error=refusal.message, status=409)
        _log.info("%s of plan %s by %s", decision, plan_id, approver.name)
        return RedirectResponse(
            f"/plans/{quote(plan_id, safe='/')}?decided={decision}",
            status_code=303, headers=_HEADERS,
        )

    def _set_cookie(self, response: Response, name: str, value: str, *, max_age: int) -> None:
        response.set_cookie(
            name, value, max_age=max_age, httponly=True, samesite="strict",
            secure=self._options.secure_cookies, path="/",
        )


def _session_key(token: str) -> str:
    # The form token derives from the bearer token's digest, not the token itself.
    return hashlib.sha256(token.encode()).hexdigest()


def _local(target: str | None) -> str:
    """A redirect target on this site only (never `//evil.example` or a scheme)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/approvals"
    return target
