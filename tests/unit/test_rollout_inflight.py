"""The runner's in-flight ledger alone: slots taken together, given back once, cancellations counted once."""

from __future__ import annotations

import asyncio

import pytest

from rollout_client.inflight import Group, InFlight
from rollout_client.stats import RunnerStats

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
