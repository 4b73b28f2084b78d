"""A refused status or lease request is answered with the common error envelope.

Before: both were answered with a propose reply carrying an `error`, the
shape of another subject's answer. A proposal refused is still a propose
reply with its `error` (that is the propose subject's own answer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from ledger.nats import connect_as
from schemas import ErrorEnvelope, LeaseRequest, ProposeReply, StatusRequest, Subjects
from tests.e2e.conftest import BackendStack, backend_stack

pytestmark = [pytest.mark.nats, pytest.mark.timeout(120)]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[BackendStack]:
    with backend_stack(tmp_path, "sqlite", hosts=["h1"], tools=["search_documents"]) as running:
        yield running


def test_refused_status_and_lease_requests_get_the_error_envelope(stack: BackendStack) -> None:
    async def scenario() -> dict[str, bytes]:
        host = await connect_as(stack.server.url, stack.credentials.host("h1"))
        executor = await connect_as(stack.server.url,
                                    stack.credentials.executor("search_documents"))
        try:
            async def ask(nc: object, subject: str, body: bytes) -> bytes:
                reply = await nc.request(subject, body, timeout=10)  # type: ignore[attr-defined]
                return bytes(reply.data)

            status = Subjects.status("h1")
            lease = Subjects.lease("search_documents")
            return {
                "status_unknown": await ask(
                    host, status, StatusRequest(operation_id="nobody").model_dump_json().encode()
                ),
                "status_malformed": await ask(host, status, b'{"operation_id": 1}'),
                "lease_unknown": await ask(
                    executor, lease,
                    LeaseRequest(operation_id="h1/nobody", executor="e").model_dump_json().encode(),
                ),
                "lease_malformed": await ask(executor, lease, b"[]"),
                "propose_malformed": await ask(host, Subjects.propose("h1"), b"{}"),
            }
        finally:
            await host.close()
            await executor.close()

    answers = asyncio.run(scenario())
    expected = {
        "status_unknown": ("OPERATION_NOT_FOUND", {"operation_id": "nobody"}),
        "status_malformed": ("INVALID_MESSAGE", {}),
        "lease_unknown": ("OPERATION_NOT_FOUND", {"operation_id": "h1/nobody"}),
        "lease_malformed": ("INVALID_MESSAGE", {}),
    }
    for name, (code, meta) in expected.items():
        envelope = ErrorEnvelope.model_validate_json(answers[name])
        assert (envelope.ok, envelope.error.code, envelope.meta) == (False, code, meta), name
    refused = ProposeReply.model_validate_json(answers["propose_malformed"])
    assert refused.error is not None and refused.error.code == "INVALID_MESSAGE"
    assert "ok" not in orjson.loads(answers["propose_malformed"])
