"""The pieces of the runner's scheduling alone: slots given back per rollout and taken back for a retry,
a group keeping its survivors, a pool's admission (never over capacity, first come first served), and the
backoff an "exhausted" pool gets."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_client import ResourceExhausted, ResourceTimeout
from rollout_client.aio import acquire_all
from rollout_client.errors import EnvExited, GroupDropped
from rollout_client.group import failures_of, survive
from rollout_client.resources import MAX_BACKOFF_S, Capacity, acquire_backing_off, backoff
from rollout_client.runner.inflight import Group, InFlight
from rollout_client.runner.stats import RunnerStats

pytestmark = pytest.mark.anyio


async def test_slots_go_back_one_rollout_at_a_time_and_a_retry_takes_them_back_all_at_once() -> None:
    stats = RunnerStats()
    ledger = InFlight(6, stats)
    task = asyncio.create_task(asyncio.Event().wait())
    ledger.add("a", Group(task, env=0, size=4, policy_step=0))
    assert ledger.ended("a") and ledger.ended("a")
    assert (ledger.free, stats.in_flight) == (4, 2), "two rollouts ended: two slots free"
    ledger.add("b", Group(task, env=0, size=4, policy_step=0))
    assert ledger.free == 0
    refill = asyncio.create_task(ledger.refill("a"))
    await asyncio.sleep(0)
    assert not refill.done() and ledger.groups["a"].held == 2, "nothing taken until all it lacks is free"
    ledger.ended("b")
    await asyncio.sleep(0)
    assert not refill.done()
    ledger.ended("b")
    await asyncio.wait_for(refill, 1)
    assert (ledger.groups["a"].held, ledger.free, stats.in_flight) == (4, 0, 6)
    assert ledger.release("a") and not ledger.ended("a"), "nothing left to give"
    ledger.remove("b")
    assert (ledger.free, stats.in_flight) == (6, 0)
    task.cancel()


async def ok(v: int) -> int:
    await asyncio.sleep(0)
    return v


async def boom(msg: str) -> int:
    await asyncio.sleep(0)
    raise ValueError(msg)


async def never() -> int:
    await asyncio.Event().wait()
    return 0


async def test_survivors_are_kept_and_failures_counted() -> None:
    kept, failures = await survive([ok(0), boom("x"), ok(2), ok(3)], need=3)
    assert kept == [(0, 0), (2, 2), (3, 3)] and failures == {"env_error": 1}


async def test_too_few_survivors_cancel_the_rest_and_raise_the_first_error_with_the_counts() -> None:
    hanging = asyncio.ensure_future(never())
    with pytest.raises(ValueError, match="x") as info:
        await survive([boom("x"), boom("y"), hanging, ok(3)], need=3)
    assert hanging.cancelled(), "no point running the rest: the group cannot be kept"
    assert failures_of(info.value) == {"env_error": 2}
    assert any("fewer than min_group_size=3" in n for n in info.value.__notes__)


async def test_a_dropped_group_is_dropped_whatever_survives() -> None:
    async def dropped() -> int:
        raise GroupDropped("pause_timeout")

    with pytest.raises(GroupDropped) as info:
        await survive([ok(0), dropped(), ok(2), ok(3)], need=1)
    assert failures_of(info.value) == {}, "not a rollout's failure"


async def test_a_rollout_cancelled_from_inside_is_a_failure_not_a_silent_gap() -> None:
    async def cancelled() -> int:
        raise asyncio.CancelledError

    kept, failures = await survive([ok(0), cancelled(), ok(2)], need=2)
    assert [i for i, _ in kept] == [0, 2] and failures == {"env_error": 1}
    with pytest.raises(EnvExited):
        await survive([ok(0), cancelled()], need=2)


async def test_every_rollout_needed_is_the_old_rule() -> None:
    with pytest.raises(ValueError):
        await survive([ok(0), boom("x")], need=2)


@given(st.integers(1, 8), st.lists(st.integers(1, 8), min_size=1, max_size=12), st.randoms())
def test_a_pool_never_goes_over_capacity_and_grants_in_order(size: int, needs: list[int], rng: random.Random) -> None:
    needs = [min(n, size) for n in needs]

    async def scenario() -> list[int]:
        pool = Capacity(size)
        granted: list[int] = []
        held: list[int] = []

        async def holder(i: int, n: int) -> None:
            await pool.take(n)
            assert pool.used <= size
            granted.append(i)
            held.append(n)
            for _ in range(rng.randrange(3)):
                await asyncio.sleep(0)
            held.remove(n)
            pool.give(n)

        await asyncio.gather(*(holder(i, n) for i, n in enumerate(needs)))
        assert pool.used == 0
        return granted

    granted = asyncio.run(scenario())
    assert sorted(granted) == list(range(len(needs)))
    assert granted == sorted(granted), "first come, first served: a large need is not starved by small ones"


async def test_a_cancelled_waiter_gives_its_turn_on() -> None:
    pool = Capacity(2)
    await pool.take(2)
    first = asyncio.create_task(pool.take(2))
    second = asyncio.create_task(pool.take(1))
    await asyncio.sleep(0)
    first.cancel()
    pool.give(2)
    await asyncio.wait_for(second, 1)
    assert pool.used == 1


@given(st.integers(0, 30), st.none() | st.floats(0, 10), st.randoms())
def test_backoff_grows_is_capped_jittered_and_honours_retry_after(
    attempt: int, retry_after: float | None, rng: random.Random
) -> None:
    wait = backoff(attempt, retry_after, rng)
    assert wait >= (retry_after or 0.0)
    assert wait <= max(MAX_BACKOFF_S, retry_after or 0.0)


class Slot:
    """A pool entry that says "exhausted" the first `refusals` times it is asked."""

    def __init__(self, log: list[str], refusals: int) -> None:
        self.log, self.refusals = log, refusals

    async def __aenter__(self) -> str:
        if self.refusals > 0:
            self.refusals -= 1
            raise ResourceExhausted("full", retry_after=0.0)
        self.log.append("in")
        return "sandbox"

    async def __aexit__(self, *exc: object) -> None:
        self.log.append("out")


async def test_exhausted_releases_what_the_group_holds_and_tries_again() -> None:
    log: list[str] = []
    slots = [Slot(log, 0), Slot(log, 2), Slot(log, 0)]
    values, stack = await acquire_backing_off(lambda: acquire_all(slots), timeout=5)
    assert values == ["sandbox"] * 3
    assert log.count("in") - log.count("out") == 3, "the tries that met 'exhausted' held nothing after"
    assert log[:4] == ["in", "in", "out", "out"], "the others finished entering, then all were released"
    await stack.aclose()


async def test_exhausted_past_the_timeout_is_a_resource_timeout() -> None:
    with pytest.raises(ResourceTimeout) as info:
        await acquire_backing_off(lambda: acquire_all([Slot([], 10**6)]), timeout=0.2)
    assert isinstance(info.value.__cause__, ResourceExhausted)


@given(st.integers(1, 128), st.integers(1, 512), st.integers(0, 8), st.booleans())
def test_the_user_is_told_when_whole_groups_leave_workers_idle(g: int, slots: int, workers: int, each: bool) -> None:
    """G=64 on 64 slots and 2 workers pins one worker, silently. The hint comes exactly when fewer
    groups fit than there are workers, names the env and the setting that spreads a group."""
    from rollout_client.examples import Arithmetic
    from rollout_client.runner.execution import spread_hint

    env = Arithmetic(name="big", group_size=g)
    env.scores_each_rollout = each
    hint = spread_hint(env, slots, workers)
    assert (hint is not None) == (workers >= 2 and not each and slots // g < workers)
    if hint is not None:
        assert "env 'big'" in hint and "scores_each_rollout = True" in hint
