"""Shared resource pools: a group's resources go back to their pool on every path (a stop that lands while a
group acquires, backs off after "exhausted", runs or releases never leaves a unit taken), and groups sharing a
pool of unknown size take turns to acquire, so they never each hold part of it and wait for the rest."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_client import Environment, Gate, ResourceExhausted, ScriptedPolicy, Session, Task, Timeouts
from rollout_client import resources as resources_module
from rollout_client.group import acquire_resources, run_group
from rollout_client.resources import Capacity
from rollout_client.runner.execution import GroupExecutor
from rollout_client.runner.inflight import Group, InFlight
from rollout_client.runner.stats import RunnerStats

pytestmark = pytest.mark.anyio


class Remote:
    """A remote pool of `size` units that answers "exhausted" when none is free. Its acquire and release
    requests each take a number of event-loop turns (`turns`, cycled), as a request on its way does: a release
    cut short there never reaches the pool. `releasing` is set as a release starts; a release waits for `go`."""

    def __init__(self, size: int, turns: list[int] | None = None) -> None:
        self.size = size
        self.free = size
        self.turns = turns or [0]
        self.calls = 0
        self.releasing = asyncio.Event()
        self.go = asyncio.Event()
        self.go.set()

    async def _request(self) -> None:
        self.calls += 1
        for _ in range(self.turns[self.calls % len(self.turns)]):
            await asyncio.sleep(0)

    @asynccontextmanager
    async def unit(self) -> AsyncIterator[None]:
        await self._request()
        if self.free == 0:
            raise ResourceExhausted("no unit free", retry_after=0.0)
        self.free -= 1
        try:
            yield
        finally:
            self.releasing.set()
            await self.go.wait()
            await self._request()
            self.free += 1
            assert self.free <= self.size


@dataclass
class Pooled(Environment):
    """G rollouts of a few loop turns each, each holding a unit of `pool`."""

    pool: Remote = field(default_factory=lambda: Remote(1))
    name: str = "pooled"
    group_size: int = 3
    steps: int = 1

    def resource(self, task: Task) -> AbstractAsyncContextManager[None]:
        return self.pool.unit()

    async def rollout(self, task: Task, session: Session) -> None:
        await session.observe(task.prompt)
        for _ in range(self.steps):
            await asyncio.sleep(0)
            await session.generate()

    def score(self, task: Task, session: Session) -> float:
        return 1.0


TASK = Task("t", "Q:")


async def test_a_stop_inside_the_release_after_exhausted_gives_every_unit_back_and_stops() -> None:
    """The pool has 2 units for a group of 3: the third answers "exhausted", so the group lets go of the 2 it
    holds; the stop lands while those releases are on their way. Each release finishes, the pool has both
    units back, and the cancellation goes on (the group does not back off and try again)."""
    pool = Remote(2)
    pool.go.clear()
    env = Pooled(pool=pool, group_size=3)
    acquiring = asyncio.create_task(acquire_resources(env, TASK, 3))
    await asyncio.wait_for(pool.releasing.wait(), 5)  # inside the release after "exhausted"
    acquiring.cancel()  # runner.stop() cancels the group's task
    await asyncio.sleep(0)
    pool.go.set()  # the release requests arrive
    done, _ = await asyncio.wait([acquiring], timeout=5)
    assert done, "the stopped group went on acquiring"
    assert acquiring.cancelled(), "the stop was swallowed"
    assert pool.free == 2, f"{2 - pool.free} of 2 units never went back to the pool"


async def test_a_second_stop_inside_the_release_does_not_cut_it_short_either() -> None:
    """A worker's group hears its runner's cancel, then the worker's own stop: both inside the release."""
    pool = Remote(2)
    pool.go.clear()
    acquiring = asyncio.create_task(acquire_resources(Pooled(pool=pool, group_size=3), TASK, 3))
    await asyncio.wait_for(pool.releasing.wait(), 5)
    for _ in range(2):
        acquiring.cancel()
        await asyncio.sleep(0)
    pool.go.set()
    await asyncio.wait([acquiring], timeout=5)
    assert acquiring.cancelled() and pool.free == 2


async def test_a_release_that_hangs_still_ends_a_stopped_group_within_the_release_timeout() -> None:
    """Shielded, but bounded: a release that never returns is abandoned after `release_timeout`, and the
    stop goes on."""
    pool = Remote(2)
    pool.go.clear()  # never set: the releases hang
    acquiring = asyncio.create_task(acquire_resources(Pooled(pool=pool, group_size=3), TASK, 3, release_timeout=0.05))
    await asyncio.wait_for(pool.releasing.wait(), 5)
    acquiring.cancel()
    done, _ = await asyncio.wait([acquiring], timeout=5)
    assert done and acquiring.cancelled()


def _run(size: int, groups: int, g: int, turns: list[int], stops: list[int]) -> tuple[int, list[str]]:
    """`groups` groups of `g` on a pool of `size`, requests taking `turns` loop turns each; each stop in
    `stops` cancels every group after that many turns (in a row: a second cancel). Returns the units free once
    every group ended, and how each ended."""

    async def scenario() -> tuple[int, list[str]]:
        pool = Remote(size, turns)
        env = Pooled(pool=pool, group_size=g)
        policy = ScriptedPolicy(lambda prompt, seed: " 1")
        tasks = [
            asyncio.create_task(run_group(env, TASK, policy, group_key=f"g{k}", release_timeout=30.0))
            for k in range(groups)
        ]
        for wait in stops:
            for _ in range(wait):
                await asyncio.sleep(0)
            for t in tasks:
                t.cancel()
        done, pending = await asyncio.wait(tasks, timeout=30.0)
        assert not pending, "a stopped group went on"
        ends = [
            "cancelled" if t.cancelled() else type(t.exception()).__name__ if t.exception() else "done" for t in tasks
        ]
        return pool.free, ends

    with mock.patch.object(resources_module, "BACKOFF_S", 0.0):  # "exhausted" tried again at the next turn
        return asyncio.run(scenario())


@given(
    size=st.integers(1, 6),
    groups=st.integers(1, 3),
    g=st.integers(1, 4),
    turns=st.lists(st.integers(0, 4), min_size=1, max_size=8),
    stops=st.lists(st.integers(0, 60), min_size=1, max_size=2),
)
def test_wherever_a_stop_lands_every_unit_goes_back(
    size: int, groups: int, g: int, turns: list[int], stops: list[int]
) -> None:
    """Groups sharing a pool that answers "exhausted", stopped (once or twice) after any number of loop turns:
    while acquiring, backing off, releasing after "exhausted", rolling out, scoring or releasing at the end.
    Every group ends (none goes on trying), and the pool has every unit back."""
    free, ends = _run(size, groups, g, turns, stops)
    assert free == size, f"{size - free} of {size} units leaked; the groups ended {ends}"
    assert all(e in ("cancelled", "done") for e in ends), ends


@given(
    size=st.integers(1, 6),
    plan=st.lists(
        st.tuples(st.integers(1, 6), st.integers(0, 5), st.none() | st.integers(0, 8)), min_size=1, max_size=10
    ),
)
def test_a_capacity_cancelled_anywhere_ends_with_nothing_used(
    size: int, plan: list[tuple[int, int, int | None]]
) -> None:
    """`Capacity` (`max_resources`) under takes, gives and cancellations at any turn: never over its size, and
    once every holder ended (given back or cancelled, waiting or holding) nothing is used and no one waits."""

    async def scenario() -> None:
        pool = Capacity(size)

        async def holder(n: int, hold: int) -> None:
            await pool.take(n)
            try:
                assert pool.used <= size
                for _ in range(hold):
                    await asyncio.sleep(0)
            finally:
                pool.give(n)

        tasks = [asyncio.create_task(holder(min(n, size), hold)) for n, hold, _ in plan]
        for turn in range(10):
            for t, (_, _, cancel_at) in zip(tasks, plan, strict=True):
                if cancel_at == turn:
                    t.cancel()
            await asyncio.sleep(0)
        await asyncio.wait(tasks, timeout=5.0)
        assert all(t.done() for t in tasks), "a holder waits for units that are free"
        assert pool.used == 0 and not pool._waiters

    asyncio.run(scenario())


@pytest.mark.parametrize("attempt", [1023, 1024, 10**6])
def test_the_backoff_stays_capped_however_long_the_pool_stays_exhausted(attempt: int) -> None:
    """With `acquire_timeout=None` a group may meet "exhausted" a thousand times in a row (about 35 minutes at
    2 s each): the 1024th wait must be the cap, not an OverflowError that fails the group."""
    wait = resources_module.backoff(attempt, None, random.Random(0))
    assert resources_module.MAX_BACKOFF_S / 2 <= wait <= resources_module.MAX_BACKOFF_S


class Blocking:
    """A pool of `size` units that makes a request wait until a unit is free (a capped sandbox server that
    holds the request), serving requests in the order they arrive. A group's i-th request arrives after i
    loop turns, so two groups acquiring at once interleave their requests (A0, B0, A1, B1, ...)."""

    def __init__(self, size: int) -> None:
        self.free = size
        self.waiting: list[asyncio.Future[None]] = []
        self.most_waiting = 0

    @asynccontextmanager
    async def unit(self, i: int) -> AsyncIterator[None]:
        for _ in range(i):
            await asyncio.sleep(0)
        if self.free == 0 or self.waiting:
            fut = asyncio.get_running_loop().create_future()
            self.waiting.append(fut)
            self.most_waiting = max(self.most_waiting, len(self.waiting))
            await fut  # handed a unit by a release
        else:
            self.free -= 1
        try:
            yield
        finally:
            if self.waiting:
                self.waiting.pop(0).set_result(None)
            else:
                self.free += 1


@dataclass
class Shared(Environment):
    """G rollouts, each holding a unit of a blocking pool for a few loop turns."""

    pool: Blocking = field(default_factory=lambda: Blocking(4))
    name: str = "shared"
    group_size: int = 4
    max_resources: int | None = None
    requests: int = 0

    def resource(self, task: Task) -> AbstractAsyncContextManager[None]:
        self.requests += 1
        return self.pool.unit((self.requests - 1) % self.group_size)

    async def rollout(self, task: Task, session: Session) -> None:
        await session.observe(task.prompt)
        for _ in range(3):
            await asyncio.sleep(0)
        await session.generate()

    def score(self, task: Task, session: Session) -> float:
        return 1.0


@pytest.mark.parametrize("groups", [2, 3])
async def test_groups_sharing_a_pool_of_unknown_size_smaller_than_their_sum_all_finish(groups: int) -> None:
    """Groups of 4 on a blocking pool of 4, no `max_resources`: acquiring at once, each would take part of the
    pool and wait for the rest held by the others, forever. They take turns to acquire: each finishes."""
    env = Shared()
    stats = RunnerStats()
    in_flight = InFlight(4 * groups, stats)
    executor = GroupExecutor(
        [env],
        pool=None,
        policy=ScriptedPolicy(lambda prompt, seed: " 1"),
        limits=Timeouts().limits(),
        group_timeout=None,
        in_flight=in_flight,
        capacity=[Capacity(None)],
        gate=Gate(),
        stats=stats,
        stopping=asyncio.Event(),
        on_rollout_end=lambda _: None,
    )
    tasks = []
    for k in range(groups):
        tasks.append(asyncio.create_task(executor.run(0, Task(f"t{k}", "Q:"), f"g{k}")))
        in_flight.add(f"g{k}", Group(tasks[-1], 0, env.group_size, 0))  # type: ignore[arg-type]
    done, pending = await asyncio.wait(tasks, timeout=10)
    for t in pending:
        t.cancel()
    assert not pending, f"{len(pending)} of {groups} groups wait for each other (each holds part of the pool)"
    assert all(t.result().group is not None for t in done)
    assert env.pool.free == 4 and not env.pool.waiting
