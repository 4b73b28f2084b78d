"""`opledger demo`: the whole job, step by step, against a running or a fresh stack.

Each step states what must happen and checks that it did; the run ends with a
table and exits non-zero if any step did not behave as stated, so the demo is
also a smoke test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from executors.samples.email import count_send_requests, count_sends
from ledger.client import AgentHostClient
from ledger.embedded import DEMO_HOST, EmbeddedStack, StackInfo, running_stack
from ledger.nats import connect_as, load_credentials
from schemas import ProposeReply, RuntimeContext, ToolProposal, ledger_operation_id

__all__ = ["run_demo", "run_demo_main"]

ALICE = RuntimeContext(
    principal="alice",
    tenant="acme",
    capabilities=frozenset(
        {"documents:search", "documents:read", "documents:delete", "email:send"}
    ),
)


@dataclass
class Step:
    """One line of the final table."""

    name: str
    expected: str
    observed: str = ""
    ok: bool = False


class Demo:
    """The scenario, run through an agent-host client like any host would."""

    def __init__(self, info: StackInfo, stack: EmbeddedStack | None, home: Path) -> None:
        self.info = info
        self.stack = stack
        self.home = home
        self.run_id = f"{int(time.time())}"
        self.steps: list[Step] = []
        self.host: AgentHostClient | None = None

    def _op(self, name: str) -> str:
        return f"demo-{self.run_id}-{name}"

    def _say(self, text: str) -> None:
        print(text, flush=True)

    async def _propose(
        self,
        name: str,
        tool: str,
        arguments: object,
        context: RuntimeContext = ALICE,
        *,
        repairs: str | None = None,
    ) -> ProposeReply:
        assert self.host is not None
        proposal = ToolProposal(
            proposal_id=f"p-{self._op(name)}",
            conversation_id=f"demo-{self.run_id}",
            requested_by_user_id=context.principal,
            tool_name=tool,
            arguments=arguments,
            operation_id=self._op(name),
            repairs=self._op(repairs) if repairs else None,
        )
        return await self.host.propose(proposal, context)

    async def step(self, name: str, expected: str, body: Callable[[Step], Awaitable[None]]) -> None:
        """Run one step; a failure is recorded, never raised."""
        self._say(f"\n▶ {name}\n  expected: {expected}")
        step = Step(name, expected)
        try:
            await body(step)
        except Exception as exc:  # the table must show every step, even a broken one
            step.observed = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
            step.ok = False
        self._say(
            f"  observed: {step.observed}\n  {'✔ as stated' if step.ok else '✘ NOT as stated'}"
        )
        self.steps.append(step)

    # ------------------------------------------------------------------ steps

    async def auto_approved_read(self, step: Step) -> None:
        reply = await self._propose("read", "search_documents", {"query": "refund policy"})
        assert self.host is not None
        status = await self.host.outcome(reply.operation_id or "", timeout=30)
        items = len((status.result.data or {}).get("items", [])) if status.result else 0
        step.observed = f"{reply.state} → {status.state}, {items} results (untrusted data)"
        step.ok = reply.state == "ready" and status.state == "succeeded"

    async def repair_loop(self, step: Step) -> None:
        bad = await self._propose("repair-1", "search_documents", '{"query": "x", "top_k": 50}')
        issues = bad.decision.issues if bad.decision else ()
        feedback = ", ".join(
            f"{i.path} {i.keyword} (expected {i.expected}, got {i.actual})" for i in issues
        )
        self._say(f"  feedback to the model: {feedback}")
        fixed = await self._propose(
            "repair-2",
            "search_documents",
            {"query": "refund policy", "top_k": 20},
            repairs="repair-1",  # the ledger counts the chain and bounds it
        )
        assert self.host is not None
        status = await self.host.outcome(fixed.operation_id or "", timeout=30)
        repair = fixed.decision.repair if fixed.decision else None
        counted = f"repair {repair.attempt} of {repair.max_attempts}" if repair else "no count"
        step.observed = (
            f"rejected with {len(issues)} repairable findings; repaired → {status.state}"
            f" ({counted}, counted by the ledger)"
        )
        step.ok = (
            bad.state == "rejected"
            and bool(bad.decision and bad.decision.repairable)
            and {i.path for i in issues} == {"/query", "/top_k"}
            and status.state == "succeeded"
            and repair is not None
            and repair.attempt == 1
        )

    async def cross_tenant(self, step: Step) -> None:
        reply = await self._propose(
            "tenant",
            "read_document_span",
            {"document_id": "document-g", "start_char": 0, "end_char": 100},
        )
        codes = [i.code for i in reply.decision.issues] if reply.decision else []
        step.observed = f"{reply.state}: {', '.join(codes)} (existence not revealed)"
        step.ok = reply.state == "rejected" and codes == ["TARGET_NOT_FOUND"]

    async def approved_email(self, step: Step) -> None:
        arguments = {
            "recipient_ids": ["cus-0001"],
            "template": "support_received",
            "variables": {"ticket_id": "TCK-1001"},
        }
        reply = await self._propose("email", "send_customer_email", arguments)
        op = reply.operation_id or ""
        # The ledger knows the operation by the host's namespace and its ID.
        ledger_op = ledger_operation_id(DEMO_HOST, op)
        proposal_hash = (reply.decision.proposal_hash if reply.decision else "") or ""
        # The executor renders the message and resolves its recipient first (a dry run).
        preview_hash = await self._previewed(ledger_op)
        self._say(f"  {ledger_op} is {reply.state}; the approver sees:")
        shown = self._cli("approvals", "show", ledger_op)
        # The whole screen: what it acts on, what would be sent, the exact arguments,
        # the hashes approved.
        self._say("    " + "\n    ".join(shown.strip().splitlines()))
        # As the approver identity `lead`, over NATS: the ledger gives `lead` its
        # roles from its own configuration.
        self._cli("approvals", "approve", ledger_op, "--approver", "lead",
                  "--proposal-hash", proposal_hash, "--preview-hash", preview_hash)
        assert self.host is not None
        status = await self.host.outcome(op, timeout=60)
        sends = count_sends(self.info.home + "/email-provider.db", ledger_op)
        step.observed = (
            f"{reply.state} → approved by `lead` over NATS → {status.state},"
            f" sent {sends} time(s)"
        )
        step.ok = reply.state == "awaiting_approval" and status.state == "succeeded" and sends == 1

    async def forbidden_delete(self, step: Step) -> None:
        reply = await self._propose(
            "delete",
            "delete_document",
            {"document_id": "document-a", "expected_revision": "8", "reason": "cleanup old"},
        )
        codes = [i.code for i in reply.decision.issues] if reply.decision else []
        step.observed = f"{reply.state}: {', '.join(codes)}"
        step.ok = reply.state == "rejected" and codes == ["TOOL_FORBIDDEN"]

    async def killed_executor(self, step: Step) -> None:
        regular = self.info.pids.get("executor-send_customer_email")
        if regular is not None:
            os.kill(regular, signal.SIGSTOP)  # let the crashing executor take the item
        crashing = None
        try:
            await asyncio.sleep(5.5)  # the paused executor's pull request expires
            crashing = self._start_crashing_executor()
            arguments = {
                "recipient_ids": ["cus-0002"],
                "template": "support_received",
                "variables": {"ticket_id": "TCK-1002"},
            }
            reply = await self._propose("crash", "send_customer_email", arguments)
            op = reply.operation_id or ""
            ledger_op = ledger_operation_id(DEMO_HOST, op)
            self._cli(
                "approvals",
                "approve",
                ledger_op,
                "--approver",
                "lead",
                "--proposal-hash",
                (reply.decision.proposal_hash if reply.decision else "") or "",
                "--preview-hash",
                await self._previewed(ledger_op),
            )
            for _ in range(300):
                if crashing.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            self._say(
                f"  executor killed after the send (exit {crashing.returncode});"
                " the work item will be redelivered"
            )
        finally:
            if regular is not None:
                os.kill(regular, signal.SIGCONT)
        assert self.host is not None
        status = await self.host.outcome(op, timeout=90)
        provider = self.info.home + "/email-provider.db"
        ledger_op = ledger_operation_id(DEMO_HOST, op)
        sends, calls = count_sends(provider, ledger_op), count_send_requests(provider, ledger_op)
        step.observed = (
            f"crashed ({crashing.returncode}) → redelivered → {status.state},"
            f" sent {sends} time(s), provider called {calls} time(s)"
        )
        # One call: the redelivered item was reconciled, not sent again (the
        # provider's own deduplication would hide a second call from `sends`).
        step.ok = crashing.returncode == 137 and status.state == "succeeded" and sends == calls == 1

    def _start_crashing_executor(self) -> subprocess.Popen[bytes]:
        creds = load_credentials(self.info.creds_dir)
        from policy.catalog import CATALOG_DIR

        env = {k: v for k, v in os.environ.items() if not k.startswith("OPLEDGER_SECRET_")}
        env["OPLEDGER_TEST_CRASH_AFTER_SEND"] = "1"
        env["OPLEDGER_SECRET_EMAIL_PROVIDER_DB"] = self.info.home + "/email-provider.db"
        log = (Path(self.info.home) / "logs" / "demo-crashing-executor.log").open("ab")
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "executors",
                "run",
                "executors.samples.email:send_customer_email",
                "--creds",
                str(creds.executor("send_customer_email").seed_path),
                "--nats-url",
                self.info.nats_url,
                "--contracts",
                str(CATALOG_DIR),
                "--name",
                "demo-crashing-executor",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    async def verify(self, step: Step) -> None:
        output = self._cli("audit", "verify", check=False)
        last = [line for line in output.splitlines() if line.strip()]
        step.observed = "; ".join(last[:2]) if last else "no output"
        step.ok = self._last_code == 0

    # ---------------------------------------------------------------- helpers

    _last_code = 0

    async def _previewed(self, ledger_op: str, timeout_s: float = 60.0) -> str:
        """The preview hash of an e-mail awaiting approval, once its executor sent it."""
        deadline = time.monotonic() + timeout_s
        while True:
            shown = orjson.loads(self._cli("approvals", "show", ledger_op, "--json"))
            if shown.get("preview_hash"):
                return str(shown["preview_hash"])
            if time.monotonic() > deadline:
                raise RuntimeError(f"no preview of {ledger_op} within {timeout_s:.0f} s")
            await asyncio.sleep(0.2)

    def _cli(self, *args: str, check: bool = True) -> str:
        run = subprocess.run(
            [sys.executable, "-m", "ledger.entrypoints", *args, "--home", str(self.home)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        self._last_code = run.returncode
        if check and run.returncode != 0:
            raise RuntimeError(f"opledger {' '.join(args)}: {run.stderr.strip()}")
        return run.stdout

    async def run(self) -> bool:
        """Every step, then the table; True when all behaved as stated."""
        nc = await connect_as(
            self.info.nats_url, load_credentials(self.info.creds_dir).host(DEMO_HOST)
        )
        self.host = AgentHostClient(nc, DEMO_HOST, timeout=10)
        try:
            await self.step(
                "auto-approved read",
                "search_documents runs without approval",
                self.auto_approved_read,
            )
            await self.step(
                "repair loop",
                "schema-invalid arguments rejected with repair"
                " feedback, then the repaired call succeeds",
                self.repair_loop,
            )
            await self.step(
                "cross-tenant attempt",
                "another tenant's document is refused as not found",
                self.cross_tenant,
            )
            await self.step(
                "approved e-mail",
                "a high-risk e-mail waits for approval, is approved from the CLI as the"
                " approver identity lead (over NATS) and sent exactly once",
                self.approved_email,
            )
            await self.step(
                "forbidden delete", "delete_document is refused outright", self.forbidden_delete
            )
            await self.step(
                "killed executor",
                "an executor dies after sending; the"
                " redelivery converges on one send and one outcome",
                self.killed_executor,
            )
            await self.step(
                "audit verify", "every hash chain and the sealed digest check out", self.verify
            )
        finally:
            await self.host.close()
        self._table()
        return all(step.ok for step in self.steps)

    def _table(self) -> None:
        width = max(len(step.name) for step in self.steps)
        self._say("\n" + f"{'step':<{width}}  ok  observed")
        for step in self.steps:
            self._say(f"{step.name:<{width}}  {'✔ ' if step.ok else '✘ '}  {step.observed}")


def run_demo_main(argv: list[str]) -> int:
    """`opledger demo ARGS` (the old entry point; the command line is `ledger.entrypoints`)."""
    from ledger.entrypoints.cli import main

    return main(["demo", *argv])


def run_demo(home: Path) -> int:
    """Run the scenario from `home` (a running stack's, or a fresh one's); 0 only if every
    step behaved."""
    home = home.resolve()
    info = running_stack(home)
    stack: EmbeddedStack | None = None
    if info is None:
        print(f"starting the embedded stack in {home} …", flush=True)
        stack = EmbeddedStack(home)
        info = stack.start()
        print(stack.describe(), flush=True)
    else:
        print(f"using the stack running from {home} ({info.nats_url})", flush=True)
    try:
        ok = asyncio.run(Demo(info, stack, home).run())
    finally:
        if stack is not None:
            print("\nstopping the embedded stack …", flush=True)
            stack.stop()
    print("\nall steps behaved as stated" if ok else "\nSOME STEPS DID NOT BEHAVE AS STATED")
    return 0 if ok else 1
