"""How the runner runs one group: its attempts (again on another worker when a worker died, again up to the
env's `group_retries` after other failures), each bounded by `group_timeout` (paused time excluded; a worker
stuck past it is replaced), in this process, on one worker, or spread rollout by rollout over the workers
for an environment that scores each rollout alone."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import TYPE_CHECKING, Any

from rollout_client.errors import GroupDropped, GroupTimeout, PromptTooLong, WorkerDied
from rollout_client.group import (
    PROMPT_TOO_LONG,
    GroupOutcome,
    Limits,
    Rollout,
    assemble,
    needed,
    run_group,
    run_rollout,
    survive,
)
from rollout_client.recycling import STUCK

if TYPE_CHECKING:
    from rollout_client.env import Environment, Gate, Task
    from rollout_client.inflight import InFlight
    from rollout_client.resources import Capacity
    from rollout_client.stats import RunnerStats
    from rollout_client.workers import WorkerPool


def spread_hint(env: Environment, max_in_flight: int, num_workers: int) -> str | None:
    """What to tell the user when a group run whole on one worker leaves workers idle: fewer of its groups
    fit in `max_in_flight` than there are workers (G=64, 64 slots, 2 workers: one works, one waits). A
    group's rollouts spread over the workers only when its env scores each rollout alone, which the runner
    cannot see: the env must say so (`scores_each_rollout`)."""
    if num_workers < 2 or env.scores_each_rollout:
        return None
    fit = max_in_flight // env.group_size
    if fit >= num_workers:
        return None
    return (f"env {env.name!r}: a group of {env.group_size} rollouts runs on one worker and {fit} fit in "
            f"max_in_flight={max_in_flight}, so {num_workers - fit} of {num_workers} workers wait; if score() reads "
            "each rollout alone, set scores_each_rollout = True to spread a group's rollouts over the workers "
            "(or raise max_in_flight)")  # fmt: skip


WORKER_RETRIES = 3
"""A group whose worker died is run again on another worker this many times before it counts as failed."""


class Execution:
    """Mixed into `RolloutRunner`: running a group, and the state it reads (declared here for the types)."""

    envs: list[Environment]
    stats: RunnerStats
    pool: WorkerPool | None
    limits: Limits
    group_timeout: float | None
    _policy: Any
    _gate: Gate
    _in_flight: InFlight
    _capacity: list[Capacity]
    _stopping: asyncio.Event

    @property
    def paused(self) -> bool:
        raise NotImplementedError

    def _hold_deadlines(self) -> None:
        raise NotImplementedError

    def _rollout_ended(self, group_id: str) -> None:
        raise NotImplementedError

    async def _execute(self, i: int, task: Task, group_id: str) -> GroupOutcome:
        """Run the group, again where it is safe: on another worker if its worker died, and up to the env's
        `group_retries` times after any other failure."""
        retries = self.envs[i].group_retries
        worker_deaths = 0
        while True:
            await self._in_flight.refill(group_id)  # a retry's rollouts take their slots again
            try:
                return await self._attempt(i, task, group_id)
            except (asyncio.CancelledError, GroupDropped, GroupTimeout):
                raise
            except WorkerDied:
                assert self.pool is not None
                self.stats.worker_deaths = self.pool.deaths
                worker_deaths += 1
                if worker_deaths > WORKER_RETRIES or self._stopping.is_set():
                    raise
            except Exception:
                if retries <= 0 or self._stopping.is_set():
                    raise
                retries -= 1
                self.stats.retried += 1

    async def _attempt(self, i: int, task: Task, group_id: str) -> GroupOutcome:
        """One run of the group within `group_timeout` (paused time excluded): past it the group fails, and a
        worker running it is replaced (a verifier that never returns may still hold it)."""
        g = self._in_flight.groups.get(group_id)
        try:
            async with asyncio.timeout(self.group_timeout) as deadline:
                if g is not None:
                    g.deadline = deadline
                    if self.paused:
                        self._hold_deadlines()
                if self.envs[i].scores_each_rollout:
                    return await self._spread(i, task, group_id)
                if self.pool is None:
                    return await run_group(self.envs[i], task, self._policy, gate=self._gate, group_key=group_id,
                                           on_rollout_end=lambda: self._rollout_ended(group_id),
                                           **self.limits.kwargs())  # fmt: skip
                return await self.pool.run(i, task, group_id, lambda: self._rollout_ended(group_id))
        except TimeoutError:
            if not deadline.expired():
                raise
            if self.pool is not None:
                for worker in self.pool.placed(group_id):
                    await self.pool.retire(worker, STUCK, now=True)
                self.stats.workers_recycled = Counter(self.pool.recycled)
            raise GroupTimeout(f"group took more than group_timeout={self.group_timeout} s") from None
        finally:
            if self.pool is not None:
                self.pool.forget(group_id)
            if g is not None:
                g.deadline = None

    async def _spread(self, i: int, task: Task, group_id: str) -> GroupOutcome:
        """The group's rollouts one by one, each on the least-busy worker (or here), each taking a unit of the
        env's pool as it starts and giving it and its slot back as it ends; then the group of the survivors."""
        env, capacity = self.envs[i], self._capacity[i]
        owner = asyncio.current_task()  # the group's: what a pause that runs out of time cancels

        async def one(k: int) -> Rollout:
            try:
                await capacity.take(1)
                try:
                    if self.pool is None:
                        return await run_rollout(env, task, self._policy, k, gate=self._gate, group_key=group_id,
                                                 owner=owner, **self.limits.kwargs())  # fmt: skip
                    return await self.pool.run_one(i, task, group_id, k)
                finally:
                    capacity.give(1)
            finally:
                self._rollout_ended(group_id)

        try:
            kept, failures = await survive([one(k) for k in range(env.group_size)], needed(env))
        except PromptTooLong:
            return GroupOutcome(None, PROMPT_TOO_LONG)
        return assemble(env, task, [r for _, r in kept], failures)
