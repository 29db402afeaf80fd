"""How the runner runs one group: its attempts (again on another worker when a worker died, again up to the
env's `group_retries` after other failures), each bounded by `group_timeout` (paused time excluded; a worker
stuck past it is replaced), in this process, on one worker, or spread rollout by rollout over the workers
for an environment that scores each rollout alone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rollout_client.episodes import ReplayDiverged, RestoreFailed, SlotLost, resume_mode
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
from rollout_client.resources import Turns, takes_turns
from rollout_client.workers.recycling import STUCK

log = logging.getLogger("rollout_client.runner")

if TYPE_CHECKING:
    from rollout_client.env import Environment, Gate, Task
    from rollout_client.episodes import Prefix, Resumes
    from rollout_client.resources import Capacity
    from rollout_client.runner.inflight import InFlight
    from rollout_client.runner.per_rollout import Poster
    from rollout_client.runner.stats import RunnerStats
    from rollout_client.runner.turns import TurnPoster
    from rollout_client.workers.pool import WorkerPool


class SlotDied(WorkerDied):
    """The worker running a rollout that posts its turns died: `prefix` is what the server holds of the slot
    (the turns the worker handed over included), None when no turn is in."""

    def __init__(self, message: str, prefix: Prefix | None) -> None:
        super().__init__(message)
        self.prefix = prefix


def check_env(env: Environment, max_in_flight: int) -> None:
    """Settings of `env` that could never run, as a ValueError naming them."""
    if env.group_size > max_in_flight:
        raise ValueError(
            f"max_in_flight {max_in_flight} < group_size {env.group_size} of {env.name!r}: "
            "a group's rollouts start together, so it could never start"
        )
    if env.min_group_size is not None and not 1 <= env.min_group_size <= env.group_size:
        raise ValueError(f"min_group_size of {env.name!r} must be between 1 and group_size {env.group_size}")
    if env.posts_each_rollout:
        if not env.scores_each_rollout:
            raise ValueError(
                f"posts_each_rollout of {env.name!r} needs scores_each_rollout: the server seals the "
                "group with the scores posted with its rollouts"
            )
        if env.on_new_weights == "restart":
            raise ValueError(
                f"posts_each_rollout of {env.name!r} with on_new_weights='restart': a restart would "
                "redo rollouts the server already acknowledged"
            )
    if env.resumes not in ("restart", "snapshot", "replay"):
        raise ValueError(f"resumes of {env.name!r} must be 'restart', 'snapshot' or 'replay', not {env.resumes!r}")
    if env.resumes != "restart" and not env.posts_each_rollout:
        raise ValueError(
            f"resumes={env.resumes!r} of {env.name!r} needs posts_each_rollout: turns are posted, and slots "
            "resumed, only for rollouts posted one by one"
        )
    if env.max_resources is not None:
        least = 1 if env.scores_each_rollout else env.group_size
        if env.max_resources < least:
            why = "a group's rollouts hold theirs together" if least > 1 else "a rollout holds one"
            raise ValueError(
                f"max_resources {env.max_resources} of {env.name!r} < {least}: {why}, so it could never start"
            )


def units_at_start(env: Environment) -> int:
    """Units of the env's pool a group takes when it starts: all G when its rollouts run together (a group
    that held part of the pool and waited for the rest could deadlock with another); none when they run one
    by one (each takes its own as it starts)."""
    return 0 if env.scores_each_rollout else env.group_size


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
    return (
        f"env {env.name!r}: a group of {env.group_size} rollouts runs on one worker and {fit} fit in "
        f"max_in_flight={max_in_flight}, so {num_workers - fit} of {num_workers} workers wait; if score() reads "
        "each rollout alone, set scores_each_rollout = True to spread a group's rollouts over the workers "
        "(or raise max_in_flight)"
    )


WORKER_RETRIES = 3
"""A group whose worker died is run again on another worker this many times before it counts as failed."""


class GroupExecutor:
    """Runs the groups the runner dispatches: `run()` takes a group to its outcome (or raises why it failed),
    calling `on_rollout_end(group_id)` as each of its rollouts ends (its slot is free). Built once the run has
    started: groups run on `pool`'s workers, or here with `policy` when there is no pool."""

    def __init__(
        self,
        envs: Sequence[Environment],
        *,
        pool: WorkerPool | None,
        policy: Any,
        limits: Limits,
        group_timeout: float | None,
        in_flight: InFlight,
        capacity: Sequence[Capacity],
        gate: Gate,
        stats: RunnerStats,
        stopping: asyncio.Event,
        on_rollout_end: Callable[[str], None],
    ) -> None:
        self.envs = envs
        self.pool = pool
        self.policy = policy
        self.limits = limits
        self.group_timeout = group_timeout
        self.in_flight = in_flight
        self.capacity = capacity
        self.gate = gate
        self.stats = stats
        self.stopping = stopping
        """Set once the run stops: a failed group is not run again."""
        self.on_rollout_end = on_rollout_end
        self.turns = Turns()
        """Groups that take several units of a pool of unknown size acquire them one group at a time."""
        self.turn_posters: Callable[[str, int, Prefix | None], TurnPoster] | None = None
        """Where a rollout run here posts its turns (`TurnPoster`), for an env that posts each rollout and
        resumes: set by the runner once it posts rollouts (None: no turn is posted)."""

    async def run(self, i: int, task: Task, group_id: str, poster: Poster | None = None) -> GroupOutcome:
        """Run the group, again where it is safe: on another worker if its worker died, and up to the env's
        `group_retries` times after any other failure. With `poster` (a per-rollout group), each rollout is posted
        as it ends, and a run again redoes only the slots not acknowledged."""
        retries = self.envs[i].group_retries
        worker_deaths = 0
        while True:
            await self.in_flight.refill(group_id)  # a retry's rollouts take their slots again
            try:
                return await self._attempt(i, task, group_id, poster)
            except (asyncio.CancelledError, GroupDropped, GroupTimeout):
                raise
            except WorkerDied:
                assert self.pool is not None
                self.stats.count_workers(self.pool)
                worker_deaths += 1
                if worker_deaths > WORKER_RETRIES or self.stopping.is_set():
                    raise
            except Exception:
                if retries <= 0 or self.stopping.is_set():
                    raise
                retries -= 1
                self.stats.retried += 1

    async def _attempt(self, i: int, task: Task, group_id: str, poster: Poster | None) -> GroupOutcome:
        """One run of the group within `group_timeout` (paused time excluded): past it the group fails, and a
        worker running it is replaced (a verifier that never returns may still hold it)."""
        g = self.in_flight.groups.get(group_id)
        try:
            async with asyncio.timeout(self.group_timeout) as deadline:
                if g is not None:
                    g.deadline = deadline
                    if not self.gate.is_open:  # started during a pause: its clock waits like the others'
                        self.in_flight.hold_deadlines(asyncio.get_running_loop().time())
                if self.envs[i].scores_each_rollout:
                    return await self._spread(i, task, group_id, poster)
                return await self._whole(i, task, group_id)
        except TimeoutError:
            if not deadline.expired():
                raise
            if self.pool is not None:
                for worker in self.pool.placed(group_id):
                    await self.pool.retire(worker, STUCK, now=True)
                self.stats.count_workers(self.pool)
            raise GroupTimeout(f"group took more than group_timeout={self.group_timeout} s") from None
        finally:
            if self.pool is not None:
                self.pool.forget(group_id)
            if g is not None:
                g.deadline = None

    async def _whole(self, i: int, task: Task, group_id: str) -> GroupOutcome:
        """The group's rollouts together, here or on one worker; in turn with the runner's other groups while it
        acquires, when its env takes several units of a pool of unknown size (`takes_turns`)."""

        def ended() -> None:
            self.on_rollout_end(group_id)

        if not takes_turns(self.envs[i]):
            if self.pool is None:
                return await run_group(
                    self.envs[i],
                    task,
                    self.policy,
                    gate=self.gate,
                    group_key=group_id,
                    on_rollout_end=ended,
                    **self.limits.kwargs(),
                )
            return await self.pool.run(i, task, group_id, ended)
        async with self.turns.turn() as acquired:
            if self.pool is None:
                return await run_group(
                    self.envs[i],
                    task,
                    self.policy,
                    gate=self.gate,
                    group_key=group_id,
                    on_rollout_end=ended,
                    on_acquired=acquired,
                    **self.limits.kwargs(),
                )
            return await self.pool.run(i, task, group_id, ended, on_acquired=acquired)

    async def _spread(self, i: int, task: Task, group_id: str, poster: Poster | None = None) -> GroupOutcome:
        """The group's rollouts one by one, each on the least-busy worker (or here), each taking a unit of the
        env's pool as it starts and giving it and its slot back as it ends (then posted, with `poster`); then
        the group of the survivors."""
        env = self.envs[i]
        done = dict(poster.done) if poster is not None else {}
        for _ in done:  # acknowledged by an earlier attempt: its slot is not needed
            self.on_rollout_end(group_id)
        lost = poster.handed_over if poster is not None else set()
        todo = [k for k in range(env.group_size) if k not in done and k not in lost]
        owner = asyncio.current_task()  # the group's: what a pause that runs out of time cancels

        async def one(k: int) -> Rollout:
            try:
                rollout = await self._slot_surviving_deaths(i, task, group_id, k, owner)
            except SlotLost:
                lost.add(k)  # another producer continues it: never run again here, nor sealed without
                raise
            finally:
                self.on_rollout_end(group_id)
            if poster is not None:
                await poster(k, rollout)
            return rollout

        try:
            kept, failures = await survive([one(k) for k in todo], max(0, needed(env) - len(done) - len(lost)))
        except PromptTooLong:
            return GroupOutcome(None, PROMPT_TOO_LONG)
        rollouts = sorted([*done.items(), *((todo[n], r) for n, r in kept)], key=lambda x: x[0])
        return assemble(env, task, [r for _, r in rollouts], failures, judged=poster is None)

    async def _slot_surviving_deaths(
        self, i: int, task: Task, group_id: str, k: int, owner: asyncio.Task[Any] | None
    ) -> Rollout:
        """Rollout `k`, run again on another worker when its worker died (up to WORKER_RETRIES times, as a whole
        group is): a death is the worker's, not the rollout's, so it must not shrink the group. A rollout whose
        turns were acknowledged continues from them as its env resumes (docs/episodes.md), else from the prompt."""
        deaths = 0
        prefix: Prefix | None = None
        mode: Resumes = "restart"
        turns = True
        while True:
            try:
                rollout = await self.run_slot(i, task, group_id, k, owner, prefix=prefix, mode=mode, turns=turns)
            except (ReplayDiverged, RestoreFailed) as exc:
                log.warning("slot %d of group %s restarts from the prompt: %s", k, group_id, exc)
                prefix, mode, turns = None, "restart", False  # its turns stay; it is posted whole
                self.stats.slots_restarted += 1
            except WorkerDied as exc:
                assert self.pool is not None
                self.stats.count_workers(self.pool)
                deaths += 1
                if deaths > WORKER_RETRIES or self.stopping.is_set():
                    raise
                if isinstance(exc, SlotDied) and exc.prefix is not None:
                    env = self.envs[i]
                    prefix = exc.prefix
                    mode = resume_mode(env.resumes, env.on_new_weights, prefix, self.gate.weights)
                    if mode == "restart":
                        prefix, turns = None, False
                        self.stats.slots_restarted += 1
            else:
                if mode != "restart":
                    self.stats.slots_resumed += 1
                    self.stats.tokens_resumed += rollout.resumed_tokens
                return rollout

    async def run_slot(
        self,
        i: int,
        task: Task,
        group_id: str,
        k: int,
        owner: asyncio.Task[Any] | None = None,
        *,
        prefix: Prefix | None = None,
        mode: Resumes = "restart",
        turns: bool = True,
    ) -> Rollout:
        """Rollout `k` of the group on its own, on the least-busy worker (or here), holding a unit of the env's
        pool while it runs. A pause that runs out of time cancels `owner` (default: the calling task). Run here,
        it posts its turns as they end when its env resumes (docs/episodes.md), continuing from `prefix` in
        `mode` (a restarted slot that has turns in posts none: it is posted whole; so does `turns=False`). Run
        on a worker, its turns are handed to this process, which posts them; if the worker dies, SlotDied carries
        the prefix the server then holds."""
        env = self.envs[i]
        sink = None
        if turns and self.turn_posters is not None and env.posts_each_rollout:
            if env.resumes != "restart" and (prefix is None or mode != "restart"):
                sink = self.turn_posters(group_id, k, prefix)
        capacity = self.capacity[i]
        await capacity.take(1)
        try:
            if self.pool is None:
                return await run_rollout(
                    self.envs[i],
                    task,
                    self.policy,
                    k,
                    gate=self.gate,
                    group_key=group_id,
                    owner=owner or asyncio.current_task(),
                    turn_sink=sink,
                    prefix=prefix,
                    mode=mode,
                    **self.limits.kwargs(),
                )
            try:
                return await self.pool.run_one(i, task, group_id, k, turns=sink, prefix=prefix, mode=mode)
            except WorkerDied as exc:
                if sink is None:
                    raise
                try:
                    held = await sink.posted()
                except SlotLost:
                    raise
                except Exception as read:  # the server's turns could not be read: from the prompt
                    log.warning("turns of slot %d of group %s not read: %s", k, group_id, read)
                    held = None
                raise SlotDied(str(exc), held) from exc
            finally:
                if sink is not None:
                    sink.close()
        finally:
            capacity.give(1)
