"""`SendLog`: when a call over HTTP certainly never left (ledger/mcp/_sends.py).

Only "no request carrying the key got a connection" may say *not sent*; everything
else, including what the log cannot read, must say *may have reached*.
"""

from __future__ import annotations

import socket
from typing import Any

import httpx2
import orjson
import pytest

from ledger.mcp._sends import NOT_CONNECTED, SendLog, SendLoggingClient

KEY_FIELD = "io.opledger/operationId"


def _post(
    *keys: str | None, batch: bool = False, body: bytes | None = None, method: str = "tools/call"
) -> httpx2.Request:
    messages: list[dict[str, Any]] = [
        {"jsonrpc": "2.0", "id": index, "method": method,
         "params": {"name": "t", "arguments": {}, **({"_meta": {KEY_FIELD: key}} if key else {})}}
        for index, key in enumerate(keys)
    ]
    content = body if body is not None else orjson.dumps(messages if batch else messages[0])
    return httpx2.Request("POST", "http://upstream.example/mcp", content=content)


def test_a_call_none_of_whose_requests_connected_never_reached() -> None:
    log = SendLog(KEY_FIELD)
    with log.call("op-1") as reached:
        assert not reached()  # nothing given yet
        given = log.given(_post("op-1"))
        assert reached()  # given: it may be on its way
        log.sent(given, connected=False)
        assert not reached()
        log.sent(log.given(_post("op-1")), connected=True)  # tried again, and connected
        assert reached()


def test_requests_of_other_keys_and_without_a_body_to_read_count_as_they_must() -> None:
    log = SendLog(KEY_FIELD)
    with log.call("op-1") as reached:
        log.given(_post("op-2"))
        log.given(_post(None, method="tools/list"))
        log.given(httpx2.Request("GET", "http://upstream.example/mcp"))
        log.given(httpx2.Request("DELETE", "http://upstream.example/mcp"))
        assert not reached()
        # A POST the log cannot read might be this call's: it may have reached.
        log.given(_post(body=b"not json"))
        assert reached()


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"{"])
def test_a_body_that_is_no_json_rpc_message_may_be_any_call(body: bytes) -> None:
    log = SendLog(KEY_FIELD)
    with log.call("op-1") as reached:
        log.given(_post(body=body))
        assert reached()


def test_a_tool_call_without_a_key_may_be_any_call() -> None:
    """Fail closed: should the SDK ever move the key, a call would otherwise count for no
    one and look unsent. (The lookup, sent unkeyed, lands here too.)"""
    log = SendLog(KEY_FIELD)
    with log.call("op-1") as reached:
        log.given(_post(None))
        assert reached()


def test_a_request_with_the_key_still_on_its_way_from_before_counts_as_reached() -> None:
    """An earlier attempt's request, cut off by a timeout but still connecting, may land
    during the next attempt with the same key: that attempt is never "not sent"."""
    log = SendLog(KEY_FIELD)
    with log.call("op-1"):
        earlier = log.given(_post("op-1"))
    with log.call("op-1") as reached:
        log.sent(log.given(_post("op-1")), connected=False)
        assert reached()
        log.sent(earlier, connected=True)
    with log.call("op-1") as later:  # nothing of the key in flight any more
        assert not later()


def test_a_batch_counts_for_every_key_in_it() -> None:
    log = SendLog(KEY_FIELD)
    with log.call("op-1") as first, log.call("op-2") as second:
        log.given(_post("op-2", "op-1", batch=True))
        assert first() and second()


def test_two_calls_with_one_key_each_see_the_other_calls_requests() -> None:
    """The same key twice at once (no attempt should, but a replay could): a request
    of either may be the other's, so both count it."""
    log = SendLog(KEY_FIELD)
    with log.call("op-1") as first:
        with log.call("op-1") as second:
            log.sent(log.given(_post("op-1")), connected=True)
            assert first() and second()
        assert first()
    with log.call("op-1") as again:  # a later call starts from nothing
        assert not again()


@pytest.mark.anyio
async def test_the_client_counts_a_refused_connection_as_not_connected() -> None:
    """A real refused connection through the client the executor uses (a port where
    nothing listens), and a request that did connect (an in-process server).

    The refused request is answered with a JSON-RPC error for its own ID, which the SDK
    hands to that request's caller alone (raised, the error ended the SDK's session and
    every call in flight on it); a notification's is raised, as before."""
    log = SendLog(KEY_FIELD)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again below: nothing listens there
    refused = _post("op-1")
    refused.url = httpx2.URL(f"http://127.0.0.1:{port}/mcp")
    async with SendLoggingClient(sends=log) as client:
        with log.call("op-1") as reached:
            made_up = await client.send(refused)
            assert not reached()
        assert made_up.status_code == 503
        assert orjson.loads(made_up.content) == {
            "jsonrpc": "2.0", "id": 0,
            "error": {"code": NOT_CONNECTED, "message": "no connection to the MCP server"
                                                        " (ConnectError)"},
        }
        def refused_post(message: dict[str, Any]) -> httpx2.Request:
            return httpx2.Request("POST", f"http://127.0.0.1:{port}/mcp",
                                  content=orjson.dumps({"jsonrpc": "2.0", **message}))

        with pytest.raises(httpx2.ConnectError):
            await client.send(refused_post({"method": "notifications/initialized"}))
        # What the client owes the server is a courtesy: lost, as on any network, and
        # the session goes on (raised, it ended the session; found in review).
        for courtesy in (
            {"method": "notifications/cancelled", "params": {"requestId": 3}},
            {"id": 7, "result": {}},  # its answer to the server's ping
            {"id": 8, "error": {"code": -1, "message": "declined"}},  # to an elicitation
        ):
            assert (await client.send(refused_post(courtesy))).status_code == 202
        # The handshake is raised: any error there makes the SDK fall back to the older
        # revision (found in review).
        for handshake in ("initialize", "server/discover"):
            with pytest.raises(httpx2.ConnectError):
                await client.send(refused_post({"id": 1, "method": handshake, "params": {}}))

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, json={"jsonrpc": "2.0", "id": 0, "result": {}})

    async with SendLoggingClient(sends=log, transport=httpx2.MockTransport(answer)) as client:
        with log.call("op-1") as reached:
            await client.send(_post("op-1"))
            assert reached()
