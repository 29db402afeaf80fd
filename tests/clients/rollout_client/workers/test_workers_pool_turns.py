"""Turns from worker processes, against the in-process app and a real `WorkerPool` (rollout_client/workers/turns.py,
docs/episodes.md, "Worker processes"): a rollout run in a worker hands each turn it ends to the runner, which posts
it; a worker killed -9 mid-episode leaves its acknowledged turns, and the slot continues from them on the
replacement worker (replay or snapshot; from the prompt for an env that can do neither), sealed equal to the
uninterrupted rollout token for token, each turn acknowledged once. A worker that speaks for a job it does not
hold is answered that the slot is not its own; one that sends what the protocol cannot carry is killed."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from rollout_client import Gate, ScriptedPolicy, Timeouts
from rollout_client.episodes import SlotLost, TurnPiece
from rollout_client.examples import RestartWalk, SnapshotWalk, Walk, walk_script
from rollout_client.group import Rollout, run_rollout
from rollout_client.leases.open_groups import OpenGroups
from rollout_client.policy import Completion
from rollout_client.resources import Capacity
from rollout_client.runner.execution import GroupExecutor
from rollout_client.runner.inflight import InFlight
from rollout_client.runner.per_rollout import Poster, task_to_wire
from rollout_client.runner.stats import RunnerStats
from rollout_client.runner.turns import TurnPoster
from rollout_client.workers.pool import WorkerPool
from tests.clients.rollout_client.runner.test_runner_turns import TASK, TURNS, app, lease_of, producer, turns_in

pytestmark = pytest.mark.anyio


class Slow(ScriptedPolicy):
    """The walk policy, `gen_s` a generation (the model's time); it pickles, so each worker builds its own."""

    def __init__(self, gen_s: float) -> None:
        super().__init__(walk_script)
        self.gen_s = gen_s

    async def generate(self, prompt_ids: list[int], **kw: Any) -> Completion:
        await asyncio.sleep(self.gen_s)
        return await super().generate(prompt_ids, **kw)


@asynccontextmanager
async def pooled(env: Walk, groups: OpenGroups, stats: RunnerStats, gen_s: float) -> AsyncIterator[GroupExecutor]:
    """An executor whose rollouts run on one worker process, their turns posted through `groups`."""
    limits = Timeouts().limits()
    pool = WorkerPool(1, [env], Slow(gen_s), limits)
    await pool.start()
    in_flight = InFlight(8, stats)
    out = GroupExecutor(
        [env], pool=pool, policy=Slow(gen_s), limits=limits, group_timeout=None, in_flight=in_flight,
        capacity=[Capacity(None)], gate=Gate(), stats=stats, stopping=asyncio.Event(), on_rollout_end=in_flight.ended,
    )  # fmt: skip
    out.turn_posters = lambda group_id, k, prefix: TurnPoster(groups, group_id, k, prefix)
    try:
        yield out
    finally:
        await pool.close()


async def sealed(c: httpx.AsyncClient, groups: OpenGroups, stats: RunnerStats, rollout: Rollout) -> list[int]:
    await Poster(groups, "g1", stats, 0)(0, rollout)
    batch = (await c.get("/batch")).json()["batch"]
    assert batch is not None
    tokens: list[int] = batch[0]["tokens"][0]
    return tokens


@pytest.mark.parametrize("env_type", [Walk, SnapshotWalk, RestartWalk])
async def test_a_worker_killed_mid_episode_leaves_its_turns_and_the_slot_continues_token_exact(
    env_type: type[Walk],
) -> None:
    env = env_type()
    env.turns, env.group_size = TURNS, 1
    whole = await run_rollout(env, TASK, ScriptedPolicy(walk_script), 0, group_key="g1")
    resumes = env.resumes != "restart"
    async with app() as c:
        p1, stats = producer(c, "p1"), RunnerStats()
        await p1.open("g1", 1, env_id=0, deadline_s=600.0, task=task_to_wire(env.name, TASK))
        async with pooled(env, p1, stats, gen_s=0.1) as executor:
            assert executor.pool is not None
            [worker] = executor.pool.workers
            run = asyncio.create_task(executor._slot_surviving_deaths(0, TASK, "g1", 0, None))
            while (await turns_in(c, "g1") < 2) if resumes else not worker.jobs:
                assert not run.done()
                await asyncio.sleep(0.02)
            acked = await turns_in(c, "g1")
            assert worker.process.pid is not None
            os.kill(worker.process.pid, signal.SIGKILL)
            rollout = await run
        assert executor.pool.deaths == 1, "the worker was replaced"
        assert (stats.slots_resumed, stats.slots_restarted) == ((1, 0) if resumes else (0, 0))
        assert (rollout.resumed_tokens > 0) == resumes and stats.tokens_resumed == rollout.resumed_tokens
        assert acked < TURNS - 1, "killed mid-episode"
        assert await sealed(c, p1, stats, rollout) == whole.tokens, "the sealed rollout is the uninterrupted one"
        totals = (await c.get("/rollouts")).json()
        assert totals.get("turns", 0) == (TURNS - 1 if resumes else 0), "each turn acknowledged once"
        await p1.aclose()


async def test_a_worker_posts_its_turns_through_the_runner_as_they_end() -> None:
    env = Walk()
    env.turns, env.group_size = TURNS, 1
    whole = await run_rollout(env, TASK, ScriptedPolicy(walk_script), 0, group_key="g1")
    async with app() as c:
        p1, stats = producer(c, "p1"), RunnerStats()
        await p1.open("g1", 1, env_id=0, deadline_s=600.0, task=task_to_wire(env.name, TASK))
        async with pooled(env, p1, stats, gen_s=0.0) as executor:
            rollout = await executor.run_slot(0, TASK, "g1", 0)
            assert executor.pool is not None and executor.pool.turns.sinks == {}, "its poster let go"
        assert rollout.acked_turns == TURNS - 1, "the worker's rollout knows what the runner's poster acknowledged"
        assert await sealed(c, p1, stats, rollout) == whole.tokens
        assert (await c.get("/rollouts")).json()["turns"] == TURNS - 1
        await p1.aclose()


async def test_a_worker_that_speaks_for_a_job_it_does_not_hold_is_answered_so_and_one_out_of_protocol_is_killed() -> (
    None
):
    env = Walk()
    env.turns, env.group_size = TURNS, 1
    piece = TurnPiece(0, [1, 2], [-100, 2], [1.0, -0.5], None, [], None)
    async with app() as c:
        p1, stats = producer(c, "p1"), RunnerStats()
        await p1.open("g1", 1, env_id=0, deadline_s=600.0, task=task_to_wire(env.name, TASK))
        async with pooled(env, p1, stats, gen_s=0.2) as executor:
            pool = executor.pool
            assert pool is not None
            [worker] = pool.workers
            pool.heard(worker, ("turn", 10_000, piece))  # a job no worker runs
            pool.heard(worker, ("turn_flush", 10_001))
            pool.heard(worker, ("turn_close", 10_002))  # nothing to answer
            assert pool.turns.refused == 2 and worker in pool.workers
            run = asyncio.create_task(executor.run_slot(0, TASK, "g1", 0))
            while not pool.turns.sinks:
                await asyncio.sleep(0.01)
            [job] = pool.turns.sinks
            other = await pool_with_second_worker(pool)
            pool.heard(other, ("turn", job, piece))  # the job is the first worker's
            assert pool.turns.refused == 3 and await turns_in(c, "g1") < 1, "nothing of it posted"
            for forged in [("turn", "7", piece), ("turn", job, "not a piece"), ("turn",), ["ready"], (), "x"]:
                victim = pool.workers[-1]
                pool.heard(victim, forged)
                while victim in pool.workers:
                    await asyncio.sleep(0.01)
            rollout = await run
        assert pool.deaths >= 1
        whole = await run_rollout(env, TASK, ScriptedPolicy(walk_script), 0, group_key="g1")
        assert await sealed(c, p1, stats, rollout) == whole.tokens, "the forged turns changed nothing"
        await p1.aclose()


async def pool_with_second_worker(pool: WorkerPool) -> Any:
    """A second worker in the pool (started now), which runs nothing."""
    await pool._spawn()
    return pool.workers[-1]


async def test_a_worker_whose_slot_passed_to_another_producer_stops_at_its_next_turn() -> None:
    """The runner stops heartbeating the group (a partition); another producer takes the slot; the worker's next
    turn is refused by the server, and SlotLost is raised in the worker's rollout and comes back to the runner."""
    env = Walk()
    env.turns, env.group_size = TURNS, 1
    async with app() as c:
        p1, stats = producer(c, "p1"), RunnerStats()
        await p1.open("g1", 1, env_id=0, deadline_s=600.0, task=task_to_wire(env.name, TASK))
        async with pooled(env, p1, stats, gen_s=0.3) as executor:
            run = asyncio.create_task(executor.run_slot(0, TASK, "g1", 0))
            while await turns_in(c, "g1") < 1:
                await asyncio.sleep(0.01)
            p1.let_go("g1")
            p2 = producer(c, "p2")
            lease = await lease_of(p2)
            assert lease.prefix is not None
            with pytest.raises(SlotLost, match="another producer"):
                await run
        assert await turns_in(c, "g1") == lease.prefix.turns, "nothing of p1's acknowledged after p2 took over"
        await p1.aclose()
        await p2.aclose()
