"""The approval page for plans: every step's effect on one screen, one approval bound to the
plan's hash, over a real uvicorn server and a real SQLite ledger, spoken to over HTTP.

What must not decide anything: a form without its token, an approval of another plan's
hash, the requester approving their own plan, someone without the plan's role (who
does not even learn the plan exists). A legitimate approval on the same server shows
the page does decide when it should.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger import StorageConfig
from policy.catalog import FILES_CATALOG_DIR
from schemas import PlanProposal, RuntimeContext
from tests.ledger.helpers import make_ledger
from tests.web.test_page_attacks import Server, _client, _csrf, token

FILES = RuntimeContext(principal="alice", tenant="acme",
                       capabilities=frozenset({"files:write", "files:share", "notify:send"}))
PLAN = "h1/share"


@pytest.fixture
def page(tmp_path: Path) -> Iterator[tuple[Server, str]]:
    """A ledger with one plan awaiting approval, the page over it, and the plan's hash."""
    path = tmp_path / "ledger.db"
    options: dict[str, Any] = {"contracts_dir": FILES_CATALOG_DIR, "resolver": None, "rules": {}}
    ledger = make_ledger(StorageConfig.sqlite(path), **options)
    status = ledger.propose_plan(PlanProposal.model_validate({
        "plan_id": "share", "conversation_id": "c-1", "requested_by_user_id": "alice",
        "steps": [
            {"step": "file", "operation_id": "op-file", "tool_name": "write_file",
             "arguments": {"path": "/shared/q3.md", "content": "Q3 <b>numbers</b>"}},
            {"step": "grant", "operation_id": "op-grant", "tool_name": "grant_access",
             "arguments": {"file_id": {"$result": {"step": "file", "pointer": "/file_id"}},
                           "person": "bob"}, "depends_on": ["file"]},
        ],
    }), FILES, "h1")
    ledger.close()
    assert status.plan_hash is not None
    with Server(path, **options) as server:
        yield server, status.plan_hash


def _state(server: Server) -> str:
    ledger = make_ledger(StorageConfig.sqlite(server.path), contracts_dir=FILES_CATALOG_DIR,
                         resolver=None, rules={})
    try:
        return ledger.plans.get(PLAN).state.value
    finally:
        ledger.close()


def _post(client: httpx.Client, path: str, form: dict[str, str]) -> httpx.Response:
    return client.post(path, data=form, headers={"Origin": str(client.base_url).rstrip("/")})


def test_the_page_shows_every_step_and_approves_only_the_plan_shown(
    page: tuple[Server, str],
) -> None:
    server, digest = page
    with _client(server, token("carol", ("files-admins",))) as client:
        queue = client.get("/approvals").text
        assert f'href="/plans/{PLAN}"' in queue
        html = client.get(f"/plans/{PLAN}").text
        # Every step's effect and exact arguments, where a value comes from, the hash;
        # what the host sent is text, never markup.
        for text in ('id="step-file"', 'id="step-grant"', "write_file", "grant_access",
                     "takes <code>/file_id</code> of step file", f'id="plan-hash">{digest}',
                     "Q3 \\u003cb\\u003enumbers"):
            assert text in html, text
        assert "<b>numbers</b>" not in html
        csrf = _csrf(client, f"/plans/{PLAN}")
        no_token = _post(client, f"/approve-plan/{PLAN}", {"plan_hash": digest, "csrf": "x"})
        assert no_token.status_code == 403
        other = _post(client, f"/approve-plan/{PLAN}", {"plan_hash": "0" * 64, "csrf": csrf})
        assert other.status_code == 409 and "proposal_hash_mismatch" in other.text
        assert _state(server) == "awaiting_approval"
        done = _post(client, f"/approve-plan/{PLAN}", {"plan_hash": digest, "csrf": csrf})
        assert done.status_code == 303, done.text
        assert _state(server) == "running"


def test_the_requester_and_other_roles_cannot_decide_and_others_do_not_see_it(
    page: tuple[Server, str],
) -> None:
    server, digest = page
    with _client(server, token("alice", ("files-admins",))) as client:
        csrf = _csrf(client, f"/plans/{PLAN}")
        own = _post(client, f"/approve-plan/{PLAN}", {"plan_hash": digest, "csrf": csrf})
        assert own.status_code == 409 and "requester_cannot_approve" in own.text
    with _client(server, token("lead-ana", ("support-leads",))) as client:
        assert client.get(f"/plans/{PLAN}").status_code == 404  # not theirs: not found
        assert f"/plans/{PLAN}" not in client.get("/approvals").text
        csrf = _csrf(client, "/approvals")
        refused = _post(client, f"/approve-plan/{PLAN}", {"plan_hash": digest, "csrf": csrf})
        assert refused.status_code == 409 and "not_an_approver" in refused.text
        assert "Q3" not in refused.text  # the refusal shows nothing of the plan
    assert _state(server) == "awaiting_approval"


def test_a_plans_stored_id_on_the_call_routes_is_not_found_and_decides_nothing(
    page: tuple[Server, str],
) -> None:
    """The plan's own ID as the ledger stores it, on the routes of single calls. Before: the
    call routes loaded the plan as if it were a call and answered 500, and the deny route
    recorded `PlanDenied` first (the attack review). Now each is a call nobody has: not
    found, or refused, and nothing is recorded."""
    server, digest = page
    stored = f"{PLAN}~plan"
    with _client(server, token("carol", ("files-admins",))) as client:
        csrf = _csrf(client, f"/plans/{PLAN}")
        for path in (f"/approvals/{stored}", f"/operations/{stored}"):
            assert client.get(path).status_code == 404, path
        for path, form in (
            (f"/approve/{stored}", {"proposal_hash": digest, "csrf": csrf}),
            (f"/deny/{stored}", {"reason": "no", "csrf": csrf}),
        ):
            response = _post(client, path, form)
            assert response.status_code in (404, 409), (path, response.status_code)
        assert _state(server) == "awaiting_approval"
        # The plan's own route still decides (the control).
        done = _post(client, f"/approve-plan/{PLAN}", {"plan_hash": digest, "csrf": csrf})
        assert done.status_code == 303, done.text
        assert _state(server) == "running"
