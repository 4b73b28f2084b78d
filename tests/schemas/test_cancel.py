"""`schemas.cancel_and_wait`: a task that does not hear its first cancel still ends."""

from __future__ import annotations

import asyncio

import pytest

from schemas import cancel_and_wait

pytestmark = pytest.mark.anyio


async def _deaf_once(told: asyncio.Event) -> None:
    """Drops its first cancel, as 3.11's `wait_for` (in nats-py's requests) does when
    the answer arrives in the same turn, then waits for what never comes."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        told.set()
    await asyncio.Event().wait()


async def test_a_task_that_drops_its_first_cancel_is_cancelled_again_until_it_ends() -> None:
    told = asyncio.Event()
    task = asyncio.get_running_loop().create_task(_deaf_once(told))
    await asyncio.sleep(0)
    # One cancel, as the stops did: the task goes on (what the helper is for).
    task.cancel()
    await asyncio.wait({task}, timeout=0.2)
    assert told.is_set() and not task.done()

    async with asyncio.timeout(5):
        await cancel_and_wait(task)
    assert task.cancelled()


async def test_what_the_tasks_raised_is_dropped_and_none_is_no_task() -> None:
    async def fails() -> None:
        raise RuntimeError("a bug in a loop")

    failed = asyncio.get_running_loop().create_task(fails())
    await asyncio.sleep(0)
    done = asyncio.get_running_loop().create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    waiting = asyncio.get_running_loop().create_task(asyncio.Event().wait())
    async with asyncio.timeout(5):
        await cancel_and_wait(failed, None, done, waiting)
    assert isinstance(failed.exception(), RuntimeError)
    assert done.done() and not done.cancelled()
    assert waiting.cancelled()
