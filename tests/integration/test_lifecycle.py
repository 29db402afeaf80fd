"""What a stop, a crash and a lost worker do to the work a runner has in flight, against real server processes
(docs/lifecycle.md cites these tests): a worker that dies takes no rollout of a spread group with it."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from rollout_client import RolloutRunner, ScriptedPolicy, Tasks
from rollout_client.examples import Synthetic, arithmetic_script, arithmetic_task
from tests.runs import HANG_GUARD_S, start_trainer, until
from tests.servers import running_server

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_a_worker_death_runs_the_rollouts_of_a_spread_group_again_instead_of_shrinking_it(
    tmp_path: Path,
) -> None:
    """A group whose rollouts are spread over the workers (`scores_each_rollout`) loses none to a worker killed
    under it: each rollout it held runs again on another worker, as a whole group's would, and every group is
    submitted whole (not with the survivors `min_group_size` would keep)."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=16)
        env = Synthetic(group_size=8, steps=3, wait_s=0.2)
        env.scores_each_rollout = True
        runner = RolloutRunner(
            server.url,
            [(env, Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=16,
            num_workers=2,
        )
        run = asyncio.create_task(runner.run(max_groups=6))
        await until(lambda: runner.stats.accepted >= 1, "a first group")
        assert runner.pool is not None
        pool = runner.pool
        await until(lambda: any(w.jobs for w in pool.workers), "rollouts running on a worker")
        victim = next(w for w in pool.workers if w.jobs)
        assert victim.process.pid is not None
        os.kill(victim.process.pid, signal.SIGKILL)
        stats = await asyncio.wait_for(run, HANG_GUARD_S)
    assert stats.worker_deaths >= 1, "the worker was killed under a group"
    assert stats.accepted == 6 and stats.failed_total == 0
    assert stats.partial_groups == 0 and not stats.rollouts_failed, (stats.partial_groups, stats.rollouts_failed)
