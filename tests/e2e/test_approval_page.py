"""The approval page in a real browser: Debian's chromium, headless, driven by Selenium
through Debian's chromedriver, against `opledger web serve` on a running stack.

A person logs in with a bearer token from an identity provider (a key pair the
test plays the provider with), sees the call's real effect (the recipient's name,
not only `cus-0001`), approves exactly the hash on the screen, and watches the
operation succeed; the e-mail is sent once. The screenshot of the approval
screen is `docs/approval-page.png` (`OPLEDGER_SCREENSHOT_DIR` keeps a fresh one).

Skips with its reason where no chromium is installed, unless
`OPLEDGER_REQUIRE_CHROMIUM` is set (`.ci/run` installs chromium and sets it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from executors.samples.email import count_send_requests
from ledger.client import AgentHostClient
from ledger.nats import connect_as
from schemas import RuntimeContext, ToolProposal
from tests.e2e.conftest import BackendStack, backend_stack
from tests.ports import free_port
from tests.previews import await_preview

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(180)]

REQUIRE_CHROMIUM = os.environ.get("OPLEDGER_REQUIRE_CHROMIUM", "") not in ("", "0", "false")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ISSUER, AUDIENCE = "https://idp.test", "opledger-approvals"
ALICE = RuntimeContext(principal="alice", tenant="acme", capabilities=frozenset({"email:send"}))


def _browser_or_skip() -> tuple[str, str]:
    if CHROMIUM and CHROMEDRIVER:
        return CHROMIUM, CHROMEDRIVER
    problem = "no chromium and chromedriver on PATH (Debian: apt-get install chromium" \
              " chromium-driver)"
    if REQUIRE_CHROMIUM:
        pytest.fail(f"OPLEDGER_REQUIRE_CHROMIUM is set but {problem}")
    pytest.skip(problem)


class Provider:
    """The identity provider the page trusts: one RSA key pair, tokens on demand."""

    def __init__(self, directory: Path) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.public_path = directory / "idp.pub.pem"
        self.public_path.write_bytes(self.key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ))

    def token(self, sub: str, groups: list[str], **extra: Any) -> str:
        now = int(time.time())
        claims = {"iss": ISSUER, "aud": AUDIENCE, "sub": sub, "groups": groups,
                  "iat": now, "exp": now + 600, **extra}
        return jwt.encode(claims, self.key, algorithm="RS256")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path / "stack", "sqlite", hosts=["h1"],
                       tools=["send_customer_email"]) as running:
        running.start_executor("send_customer_email")
        yield running


@pytest.fixture
def page(stack: BackendStack, tmp_path: Path) -> Iterator[tuple[str, Provider]]:
    """`opledger web serve` on the stack's ledger, trusting `Provider`'s key, with the
    provider's group `support-leads` mapped to the approver role `support_lead`."""
    provider = Provider(tmp_path)
    port = free_port()
    log = (tmp_path / "web.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "ledger.entrypoints", "--database", str(stack.home / "ledger.db"),
         "web", "serve", "--listen", f"127.0.0.1:{port}", "--issuer", ISSUER,
         "--audience", AUDIENCE, "--public-key", str(provider.public_path),
         "--group", "support-leads=support_lead"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"{url}/login", timeout=1).close()
                break
            except OSError:
                if process.poll() is not None:
                    raise RuntimeError((tmp_path / "web.log").read_text()) from None
                time.sleep(0.1)
        yield url, provider
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def browser() -> Iterator[Any]:
    binary, driver_path = _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1100,1500", "--lang=en-US"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


async def _propose(stack: BackendStack) -> str:
    nc = await connect_as(stack.server.url, stack.credentials.host("h1"))
    host = AgentHostClient(nc, "h1")
    try:
        reply = await host.propose(
            ToolProposal(
                proposal_id="p-page", conversation_id="conv-support-17",
                requested_by_user_id="alice", tool_name="send_customer_email",
                operation_id="op-page", model_snapshot="model-2026-10-01",
                prompt_release="support-agent@42",
                arguments={"recipient_ids": ["cus-0001"], "template": "support_received",
                           "variables": {"ticket_id": "TCK-42"}},
            ),
            ALICE,
        )
    finally:
        await host.close()
    assert reply.state == "awaiting_approval" and reply.decision is not None
    return reply.decision.proposal_hash or ""


def _preview_text(browser: Any) -> str:
    return _text(browser, "#preview")


def _text(browser: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    return str(browser.find_element(By.CSS_SELECTOR, css).text)


def _arrive(browser: Any, path: str) -> None:
    """Wait until the browser shows a page under `path` (a click on a form's button
    returns before the next page has loaded)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(browser, 15).until(lambda b: path in b.current_url
                                         and b.execute_script("return document.readyState")
                                         == "complete")
    except TimeoutException:
        # Say where the browser is instead, and what the page says (a refusal, say).
        text = browser.find_element("tag name", "main").text[:1500]
        raise AssertionError(f"not at {path}: at {browser.current_url}: {text}") from None


def _log_in(browser: Any, url: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{url}/approvals")  # not logged in: sent to the login form
    assert "/login" in browser.current_url
    browser.find_element(By.ID, "token").send_keys(token)
    browser.find_element(By.ID, "sign-in").click()
    _arrive(browser, "/approvals")


async def test_an_approver_logs_in_sees_the_effect_approves_and_it_runs(
    stack: BackendStack, page: tuple[str, Provider], browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    url, provider = page
    digest = await _propose(stack)
    # The executor previews the e-mail (renders it, resolves the recipient) first.
    shown = await await_preview(stack.ledger(), "h1/op-page")
    _log_in(browser, url, provider.token("lead-ana", ["support-leads", "staff"]))
    assert _text(browser, "#approver-name") == "lead-ana"
    queue = _text(browser, "#queue")
    assert "h1/op-page" in queue and "yours to decide" in queue

    browser.find_element(By.LINK_TEXT, "h1/op-page").click()
    _arrive(browser, "/approvals/h1/op-page")
    # The real effect: who receives it (the host's name for cus-0001), what runs,
    # why it is risky, who asked in which conversation, the hash being approved.
    assert "cus-0001: Alice" in _text(browser, "#targets")
    assert _text(browser, "#effect-kind") == "irreversible_write — cannot be undone"
    assert '"template": "support_received"' in _text(browser, "#arguments")
    assert _text(browser, "#requested-by").startswith("alice (acme")
    context = _text(browser, "#context")
    assert "conv-support-17" in context and "model-2026-10-01" in context
    assert "support-agent@42" in context
    # What would be sent, as the tool itself renders it: the message and its address.
    preview = _preview_text(browser)
    assert "We received your request TCK-42" in preview
    assert "customer-0001@acme.example.test" in preview
    assert "Hello customer," in _text(browser, "#preview-body")
    assert _text(browser, "#proposal-hash") == digest
    assert _text(browser, "#preview-hash") == shown
    assert "0 of 1" in _text(browser, "#approvals")
    shots = Path(os.environ.get("OPLEDGER_SCREENSHOT_DIR", stack.home))
    shots.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(shots / "approval-page.png"))

    browser.find_element(By.ID, "approve").click()
    _arrive(browser, "/operations/h1/op-page")
    assert _text(browser, "#decided") == "Your decision (approve) is recorded."
    for _ in range(150):  # the page follows the operation (it refreshes every 2 s)
        if _text(browser, "#state") == "succeeded":
            break
        time.sleep(0.2)
        browser.refresh()
        _arrive(browser, "/operations/h1/op-page")
    assert _text(browser, "#state") == "succeeded", stack.log("service.log")
    assert "approved by lead-ana as support_lead on the approval page" in _text(
        browser, "#timeline")
    assert count_send_requests(stack.email_db, "h1/op-page") == 1
    granted = [e for e in stack.ledger().history("h1/op-page")
               if type(e).__name__ == "ApprovalGranted"]
    assert [(e.approver, e.approver_roles, e.via, e.preview_hash) for e in granted] == [
        ("lead-ana", ["support_lead"], "web", shown)
    ]
