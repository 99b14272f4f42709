"""The daemon's waiting loops stop when cancelled, even when the cancel lands as a wait ends.

On Python 3.11 ``asyncio.wait_for`` returns the inner result instead of raising
when a cancel arrives just as the inner wait completes; a loop around it then
never stops, and neither does the daemon's shutdown (seen in the suite: a
trainer that published a version a few milliseconds before SIGTERM).
"""

import asyncio
from types import SimpleNamespace

import pytest

from sparrowd.daemon.swarm import Swarm


@pytest.mark.asyncio
async def test_a_cancel_that_lands_as_a_wait_ends_still_stops_the_loop():
    for _ in range(20):
        state = SimpleNamespace(gen=0, _closing=False, _waiters=asyncio.Condition())

        async def watch():
            while True:  # as the engine server's decode-ahead loop does
                await Swarm.changed(state, state.gen, 5.0)

        task = asyncio.create_task(watch())
        await asyncio.sleep(0.01)  # it is waiting now
        state.gen += 1
        async with state._waiters:
            state._waiters.notify_all()
        task.cancel()  # the same moment the wait ends
        done, _ = await asyncio.wait([task], timeout=1.0)
        assert task in done and task.cancelled()


@pytest.mark.asyncio
async def test_a_wait_times_out_and_a_change_ends_it_early():
    state = SimpleNamespace(gen=3, _closing=False, _waiters=asyncio.Condition())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await Swarm.changed(state, 3, 0.1)
    assert 0.09 <= loop.time() - t0 < 1.0
    waiter = asyncio.create_task(Swarm.changed(state, 3, 5.0))
    await asyncio.sleep(0.01)
    state.gen = 4
    async with state._waiters:
        state._waiters.notify_all()
    await asyncio.wait_for(waiter, 1.0)
    t0 = loop.time()
    await Swarm.changed(state, 3, 5.0)  # already past: no wait at all
    assert loop.time() - t0 < 0.05
