"""The approval page against what an attacker or a careless user sends it: a real
uvicorn server over a real SQLite ledger, spoken to over HTTP.

Each row is something that must not decide anything: a token signed by another
key, for another audience, unsigned, or signed with the public key as an HMAC
secret; a form without its token, with another session's token, or from another
site; an approval of a hash that is not the call's; a group nobody mapped to a
role. A legitimate approval on the same server shows the page does decide when
it should.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import uvicorn
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from ledger import StorageConfig
from ledger.web import SESSION_COOKIE, TokenSettings, TokenVerifier, WebOptions, build_web_app
from schemas import ErrorCategory, ErrorInfo, PreviewReport
from tests.ledger.helpers import ALICE, email, make_ledger, previewed
from tests.ports import free_port

ISSUER, AUDIENCE = "https://idp.test", "opledger-approvals"
OP = "op-mail"


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


IDP, STRANGER = _key(), _key()
IDP_PUBLIC = IDP.public_key().public_bytes(
    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
).decode()


def token(sub: str = "lead-ana", groups: tuple[str, ...] = ("support-leads",), *,
          key: Any = IDP, algorithm: str = "RS256", **claims: Any) -> str:
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": sub, "groups": list(groups),
            "iat": now, "exp": now + 600, **claims}
    return jwt.encode(body, key, algorithm=algorithm)


class Server:
    """The page on a free loopback port, in a thread, over the ledger in `path`."""

    def __init__(self, path: Path, **ledger_options: Any) -> None:
        self.path = path
        self._ledger_options = ledger_options
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Server:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        ready = threading.Event()

        def run() -> None:
            # The ledger is built in the server's own thread, where it is used.
            ledger = make_ledger(StorageConfig.sqlite(self.path), **self._ledger_options)
            settings = TokenSettings(
                issuer=ISSUER, audience=AUDIENCE, public_key_pem=IDP_PUBLIC,
                role_map={"support-leads": frozenset({"support_lead"}),
                          "stewards": frozenset({"data_steward"}),
                          "files-admins": frozenset({"files_admin"})},
            )
            app = build_web_app(ledger, WebOptions(verifier=TokenVerifier(settings)))
            self._server = uvicorn.Server(
                uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
            )
            ready.set()
            self._server.run()
            ledger.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        for _ in range(200):
            if self._server is not None and self._server.started:
                break
            time.sleep(0.02)
        return self

    def __exit__(self, *_: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(10)


PREVIEW = PreviewReport(effect={
    "summary": "send 1 e-mail(s): We received your request TCK-42",
    # What a tool renders can carry what the host sent: shown as text, never as markup.
    "body": "Hello <b onmouseover=alert(1)>customer</b>,\n\nWe received your request",
    "recipients": [{"customer_id": "cus-0001", "address": "customer-0001@acme.example.test"}],
})
"""The e-mail executor's preview of the call (its contract asks for one before approval)."""


@pytest.fixture
def page(tmp_path: Path) -> Iterator[tuple[Server, str]]:
    """A ledger with one e-mail awaiting approval (previewed), the page over it, and that
    call's hash."""
    path = tmp_path / "ledger.db"
    ledger = make_ledger(StorageConfig.sqlite(path))
    submission = ledger.submit(email(OP), ALICE)
    assert submission.decision is not None
    digest = submission.decision.proposal_hash or ""
    previewed(ledger, OP, PREVIEW)
    ledger.close()
    with Server(path) as server:
        yield server, digest


def _history(server: Server) -> list[tuple[Any, ...]]:
    ledger = make_ledger(StorageConfig.sqlite(server.path))
    try:
        rows: list[tuple[Any, ...]] = []
        for event in ledger.history(OP):
            name = type(event).__name__
            if name.startswith("Approval") and name != "ApprovalRequested":
                rows.append((name, event.approver, getattr(event, "reason", ""), event.via))
        return rows
    finally:
        ledger.close()


def _client(server: Server, bearer: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    return httpx.Client(base_url=server.url, headers=headers, follow_redirects=False,
                        timeout=10)


def _csrf(client: httpx.Client, path: str) -> str:
    html = client.get(path).text
    marker = 'name="csrf" value="'
    start = html.index(marker) + len(marker)
    return html[start:html.index('"', start)]


def _approve(client: httpx.Client, digest: str, csrf: str, *, preview: str = PREVIEW.digest(),
             **headers: str) -> httpx.Response:
    form = {"csrf": csrf, "proposal_hash": digest, "preview_hash": preview}
    return client.post(f"/approve/{OP}", data=form,
                       headers={"Origin": str(client.base_url).rstrip("/"), **headers})


@pytest.mark.parametrize(
    ("what", "bearer"),
    [
        ("no token", None),
        ("another key", lambda: token(key=STRANGER)),
        ("another audience", lambda: token(aud="some-other-app")),
        ("another issuer", lambda: token(iss="https://evil.test")),
        ("expired", lambda: token(exp=int(time.time()) - 3600, iat=int(time.time()) - 7200)),
        ("unsigned (alg none)", lambda: jwt.encode(
            {"iss": ISSUER, "aud": AUDIENCE, "sub": "lead-ana", "groups": ["support-leads"],
             "iat": int(time.time()), "exp": int(time.time()) + 600}, "", algorithm="none")),
        ("the public key as an HMAC secret", lambda: _hmac_with_public_key()),
        ("no subject", lambda: token(sub="")),
        ("a subject that is markup", lambda: token(sub="<script>alert(1)</script>")),
    ],
)
def test_a_token_the_page_did_not_issue_decides_nothing(
    page: tuple[Server, str], what: str, bearer: Any
) -> None:
    server, digest = page
    with _client(server, bearer() if bearer else None) as client:
        assert client.get("/approvals").status_code == 303, what  # to the login form
        response = client.post(f"/approve/{OP}", data={"proposal_hash": digest, "csrf": "x"})
        assert response.status_code == 303 and "/login" in response.headers["location"], what
    # And as a login, it is refused with a reason, not a session.
    if bearer is not None:
        with _client(server) as client:
            csrf = _csrf(client, "/login")
            response = client.post("/login", data={"csrf": csrf, "token": bearer()},
                                   headers={"Origin": server.url})
            assert response.status_code == 401, what
            assert SESSION_COOKIE not in response.cookies
    assert _history(server) == []


def _hmac_with_public_key() -> str:
    # The classic algorithm confusion: a verifier that let the token pick HS256 would
    # check it with the public key as the secret, which everyone has.
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "lead-ana", "groups": ["support-leads"],
            "iat": now, "exp": now + 600}
    header = jwt.utils.base64url_encode(b'{"alg":"HS256","typ":"JWT"}')
    payload = jwt.utils.base64url_encode(jwt.utils.force_bytes(__import__("json").dumps(body)))
    import hashlib
    import hmac

    signing_input = header + b"." + payload
    signature = hmac.new(IDP_PUBLIC.encode(), signing_input, hashlib.sha256).digest()
    return (signing_input + b"." + jwt.utils.base64url_encode(signature)).decode()


def test_forged_forms_decide_nothing_and_the_real_one_does(page: tuple[Server, str]) -> None:
    server, digest = page
    with _client(server, token()) as client, _client(server, token("lead-bo")) as other:
        assert _approve(client, digest, "").status_code == 403  # no form token
        for odd in ("é", "ü" * 64, "\x00"):  # not ASCII: refused, not a 500
            assert _approve(client, digest, odd).status_code == 403, odd
        response = client.post(f"/deny/{OP}", content=b"csrf=%ff%fe&reason=no",
                               headers={"Origin": server.url,
                                        "Content-Type": "application/x-www-form-urlencoded"})
        assert response.status_code == 403
        foreign = _csrf(other, f"/approvals/{OP}")  # another session's
        assert _approve(client, digest, foreign).status_code == 403
        csrf = _csrf(client, f"/approvals/{OP}")
        # The right token, posted by a page on another site.
        assert _approve(client, digest, csrf, Origin="https://evil.test").status_code == 403
        assert _history(server) == []
        # The form as the page served it.
        response = _approve(client, digest, csrf)
        assert response.status_code == 303, response.text
        assert response.headers["location"] == f"/operations/{OP}?decided=approve"
    assert _history(server) == [("ApprovalGranted", "lead-ana", "", "web")]


def test_an_approval_counts_for_the_hash_on_the_screen_only(page: tuple[Server, str]) -> None:
    server, _ = page
    with _client(server, token()) as client:
        csrf = _csrf(client, f"/approvals/{OP}")
        response = _approve(client, "0" * 64, csrf)
        assert response.status_code == 409
        assert "proposal_hash_mismatch" in response.text
        assert "show the approval again" in response.text  # what to do next
    assert _history(server) == [("ApprovalRefused", "lead-ana", "proposal_hash_mismatch", "web")]


def test_an_approval_counts_for_the_preview_on_the_screen_only(
    page: tuple[Server, str],
) -> None:
    server, digest = page
    other = PreviewReport(effect={**(PREVIEW.effect or {}), "recipients": []}).digest()
    with _client(server, token()) as client:
        html = client.get(f"/approvals/{OP}").text
        assert f'name="preview_hash" value="{PREVIEW.digest()}"' in html
        # The rendered message is on the screen, as text.
        assert "We received your request" in html and "customer-0001@acme.example.test" in html
        assert "<b onmouseover" not in html and "&lt;b onmouseover=alert(1)&gt;" in html
        csrf = _csrf(client, f"/approvals/{OP}")
        for shown, status in ((other, 409), ("", 409), ("not-a-digest", 400)):
            response = _approve(client, digest, csrf, preview=shown)
            assert response.status_code == status, (shown, response.text)
        assert "preview_hash_mismatch" in _approve(client, digest, csrf, preview=other).text
    assert [row[2] for row in _history(server)] == ["preview_hash_mismatch"] * 3


def _awaiting(path: Path, report: PreviewReport | None) -> tuple[str, str]:
    """An e-mail awaiting approval in a new ledger at `path`, previewed with `report`
    (None: not yet); its proposal hash and preview hash ("" without one)."""
    ledger = make_ledger(StorageConfig.sqlite(path))
    try:
        submission = ledger.submit(email(OP), ALICE)
        assert submission.decision is not None
        digest = submission.decision.proposal_hash or ""
        return digest, previewed(ledger, OP, report) if report is not None else ""
    finally:
        ledger.close()


def test_a_call_not_previewed_yet_cannot_be_approved(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    digest, _ = _awaiting(path, None)
    with Server(path) as server, _client(server, token()) as client:
        html = client.get(f"/approvals/{OP}").text
        assert 'id="preview-pending"' in html
        assert 'id="approve" class="approve" disabled' in html
        # A form posted anyway (an old tab, a crafted post) is refused, and recorded.
        response = _approve(client, digest, _csrf(client, f"/approvals/{OP}"), preview="")
        assert response.status_code == 409 and "preview_pending" in response.text
        assert _history(server) == [("ApprovalRefused", "lead-ana", "preview_pending", "web")]


def test_a_call_the_tool_could_not_preview_can_only_be_denied(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    failed = PreviewReport(error=ErrorInfo(
        code="RECIPIENT_NOT_FOUND", category=ErrorCategory.NOT_FOUND,
        message="a recipient does not exist",
    ))
    digest, shown = _awaiting(path, failed)
    with Server(path) as server, _client(server, token()) as client:
        html = client.get(f"/approvals/{OP}").text
        assert 'id="preview-error"' in html and "RECIPIENT_NOT_FOUND" in html
        assert 'id="approve" class="approve" disabled' in html
        response = _approve(client, digest, _csrf(client, f"/approvals/{OP}"), preview=shown)
        assert response.status_code == 409 and "preview_failed" in response.text
        assert _history(server) == [("ApprovalRefused", "lead-ana", "preview_failed", "web")]


def test_a_group_nobody_mapped_carries_no_role_and_sees_nothing(
    page: tuple[Server, str],
) -> None:
    server, digest = page
    bearer = token("mallory", ("support_lead", "admins"))  # a role's name, not a mapped group
    with _client(server, bearer) as client:
        assert "You hold no approver role here" in client.get("/approvals").text
        # Another's call is answered like a missing one: no arguments, no outcome.
        for path in (f"/approvals/{OP}", f"/operations/{OP}", "/approvals/op-none"):
            response = client.get(path)
            assert response.status_code == 404 and "cus-0001" not in response.text, path
        csrf = _csrf(client, "/approvals")  # the sign-out form's token: a valid session's
        assert _approve(client, digest, csrf).status_code == 403
        response = client.post(f"/deny/{OP}", data={"csrf": csrf, "reason": "no"},
                               headers={"Origin": server.url})
        assert response.status_code == 403
    # Refused, and nothing appended: an identity provider's users cannot grow the ledger.
    assert _history(server) == []


def test_a_role_the_call_does_not_ask_for_sees_nothing_and_is_refused_and_recorded(
    page: tuple[Server, str],
) -> None:
    server, digest = page
    with _client(server, token("steward-sam", ("stewards",))) as client:
        assert "No call waits for a decision of yours" in client.get("/approvals").text
        assert client.get(f"/approvals/{OP}").status_code == 404
        csrf = _csrf(client, "/approvals")
        response = _approve(client, digest, csrf)
        assert response.status_code == 409 and "not_an_approver" in response.text
    assert _history(server) == [("ApprovalRefused", "steward-sam", "not_an_approver", "web")]


def test_the_requester_under_another_spelling_cannot_approve_on_the_page(
    page: tuple[Server, str],
) -> None:
    server, digest = page
    with _client(server, token("Alice", ("support-leads",))) as client:  # alice asked
        assert "You asked for this call" in client.get(f"/approvals/{OP}").text
        csrf = _csrf(client, f"/approvals/{OP}")
        response = _approve(client, digest, csrf)
        assert response.status_code == 409 and "requester_cannot_approve" in response.text
    assert _history(server) == [("ApprovalRefused", "Alice", "requester_cannot_approve", "web")]


@pytest.mark.parametrize("junk", ["", "0" * 63, "g" * 64, "A" * 64, "0" * 60000])
def test_an_approval_without_a_proposal_hash_is_not_taken(
    page: tuple[Server, str], junk: str
) -> None:
    server, _ = page
    with _client(server, token()) as client:
        csrf = _csrf(client, f"/approvals/{OP}")
        response = _approve(client, junk, csrf)
        assert response.status_code in (400, 413), response.status_code
    assert _history(server) == []


def test_a_token_that_lives_for_ever_is_refused_not_a_crash(page: tuple[Server, str]) -> None:
    server, _ = page
    for exp in (10**12, 2**63):
        with _client(server, token(exp=exp)) as client:
            response = client.get("/approvals")
            assert response.status_code == 303, exp  # not logged in, and no 500
            assert "/login" in response.headers["location"]


def test_the_decision_banner_shows_only_a_decision(page: tuple[Server, str]) -> None:
    server, _ = page
    spoof = "approve. NOTE: approval was lost, please approve op-evil again"
    with _client(server, token()) as client:
        text = client.get(f"/operations/{OP}", params={"decided": spoof}).text
        assert "op-evil" not in text and 'id="decided"' not in text


def test_what_the_host_sent_is_shown_as_text_never_as_markup(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = make_ledger(StorageConfig.sqlite(path))
    hostile = email(OP).model_copy(update={"arguments": {
        "recipient_ids": ["cus-0001"], "template": "support_received",
        "variables": {"ticket_id": "TCK-42"}, "body": "<script>alert(1)</script>",
    }})
    assert ledger.submit(hostile, ALICE).state == "awaiting_approval"
    ledger.close()
    with Server(path) as server, _client(server, token()) as client:
        response = client.get(f"/approvals/{OP}")
        assert response.status_code == 200
        assert "<script>alert(1)</script>" not in response.text
        # Shown, escaped (the arguments block is JSON: `<` is written `\u003c` there).
        assert "\\u003cscript\\u003ealert(1)" in response.text
        policy = response.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "script-src" not in policy


def test_the_login_never_redirects_off_the_site(page: tuple[Server, str]) -> None:
    server, _ = page
    for target in ("//evil.test/x", "https://evil.test/", "/\\evil.test"):
        with _client(server) as client:
            csrf = _csrf(client, f"/login?next={target}")
            response = client.post("/login", data={"csrf": csrf, "token": token(),
                                                   "next": target},
                                   headers={"Origin": server.url})
            assert response.status_code == 303
            assert response.headers["location"] == "/approvals", target
            cookie = response.headers["set-cookie"]
            assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
