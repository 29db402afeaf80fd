"""The runner's in-flight ledger alone: slots taken together, given back once, cancellations counted once."""

from __future__ import annotations

import asyncio

import pytest

from rollout_client.runner.inflight import Group, InFlight
from rollout_client.runner.stats import RunnerStats

pytestmark = pytest.mark.anyio


async def test_a_group_holds_its_slots_until_its_rollouts_end_and_gives_them_back_once() -> None:
    stats = RunnerStats()
    ledger = InFlight(8, stats)

    async def hang() -> None:
        await asyncio.Event().wait()

    tasks = [asyncio.create_task(hang()) for _ in range(2)]
    ledger.add("a", Group(tasks[0], env=0, size=4, policy_step=0))
    ledger.add("b", Group(tasks[1], env=1, size=3, policy_step=0))
    assert (ledger.free, stats.in_flight, stats.max_in_flight, stats.dispatched) == (1, 7, 7, 2)
    assert sorted(ledger.pending()) == [(0, 4), (1, 3)]
    assert ledger.release("a") and not ledger.release("a"), "slots go back once"
    assert (ledger.free, stats.in_flight, stats.max_in_flight) == (5, 3, 7)
    assert sorted(ledger.pending()) == [(0, 4), (1, 3)], "released, but not yet seen by the server"
    ledger.remove("a")
    assert ledger.free == 5 and [g.env for g in ledger] == [1]
    for g in ledger:
        ledger.cancel(g, "stale")
        ledger.cancel(g, "stopped")
    assert stats.skipped == {"stale": 1}, "a group is cancelled and counted once"
    await ledger.wait(None)
    assert tasks[1].cancelled()
    ledger.remove("b")
    assert (ledger.free, stats.in_flight, list(ledger)) == (8, 0, [])
    tasks[0].cancel()


async def test_a_stop_cancels_what_generates_lets_submits_finish_then_cancels_them() -> None:
    """`stop`: groups still generating are cancelled (`stopped`); one submitting is left until `submits_by`,
    then cancelled (`unsent`); each counted once, under one reason."""
    stats = RunnerStats()
    ledger = InFlight(8, stats)
    submitted = asyncio.Event()

    async def generating() -> None:
        await asyncio.Event().wait()

    async def submitting() -> None:
        await submitted.wait()

    def launch(key: str, task: asyncio.Task[None], submitting: bool) -> None:
        """As the runner's groups do: in the ledger until their task ends."""
        ledger.add(key, Group(task, env=0, size=2, policy_step=0, submitting=submitting))
        task.add_done_callback(lambda _: ledger.remove(key))

    gen, sub = asyncio.create_task(generating()), asyncio.create_task(submitting())
    launch("gen", gen, False)
    launch("sub", sub, True)
    loop = asyncio.get_running_loop()
    stopping = asyncio.create_task(ledger.stop(loop.time() + 60.0, loop.time() + 60.0))
    await asyncio.wait([gen])
    assert gen.cancelled() and not sub.done() and stats.skipped == {"stopped": 1}
    submitted.set()  # its submit finishes in time: not cancelled
    await stopping
    assert not sub.cancelled() and stats.skipped == {"stopped": 1}

    late = asyncio.create_task(generating())
    launch("late", late, True)
    await ledger.stop(loop.time(), loop.time() + 60.0)  # no time left for submits
    assert late.cancelled() and stats.skipped == {"stopped": 1, "unsent": 1}


async def test_a_pause_holds_every_deadline_with_what_it_had_left_and_the_resume_restores_it() -> None:
    ledger = InFlight(8, RunnerStats())
    loop = asyncio.get_running_loop()

    async def timed() -> None:
        async with asyncio.timeout(30.0) as deadline:
            ledger.groups["a"].deadline = deadline
            await asyncio.Event().wait()

    task = asyncio.create_task(timed())
    ledger.add("a", Group(task, env=0, size=1, policy_step=0))
    await asyncio.sleep(0)
    g = ledger.groups["a"]
    assert g.deadline is not None and (when := g.deadline.when()) is not None
    ledger.hold_deadlines(when - 10.0)
    assert g.deadline.when() is None and g.remaining == 10.0
    ledger.hold_deadlines(loop.time())  # held already: holding again changes nothing
    assert g.remaining == 10.0
    now = loop.time()
    ledger.release_deadlines(now)
    assert g.deadline.when() == now + 10.0 and g.remaining is None
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_group_that_drops_itself_is_counted_once_and_not_cancelled() -> None:
    stats = RunnerStats()
    ledger = InFlight(4, stats)

    async def hang() -> None:
        await asyncio.Event().wait()

    task = asyncio.create_task(hang())
    ledger.add("a", Group(task, env=0, size=2, policy_step=0))
    [g] = list(ledger)
    ledger.drop(g, "lease_lost")
    ledger.cancel(g, "stopped")
    ledger.drop(g, "lease_lost")
    assert stats.skipped == {"lease_lost": 1} and not task.cancelled()
    task.cancel()
