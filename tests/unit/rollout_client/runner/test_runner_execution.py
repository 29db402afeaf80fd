"""The group executor alone (rollout_client/runner/execution.py): a group run in this process to its outcome, each
rollout's end told, retries where the env allows them, `group_timeout` with paused time excluded."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from rollout_client import Gate, ScriptedPolicy, Session, Task, Timeouts
from rollout_client.errors import GroupTimeout
from rollout_client.examples import Arithmetic, arithmetic_script, arithmetic_task
from rollout_client.group import GroupOutcome
from rollout_client.resources import Capacity
from rollout_client.runner.execution import GroupExecutor, units_at_start
from rollout_client.runner.inflight import Group, InFlight
from rollout_client.runner.stats import RunnerStats

pytestmark = pytest.mark.anyio


@dataclass
class FailsFirst(Arithmetic):
    """Its first `failures` groups fail (every rollout raises); the ones after succeed."""

    group_retries: int = 2
    failures: int = 1
    runs: list[str] = field(default_factory=list)

    async def rollout(self, task: Task, session: Session) -> None:
        self.runs.append(task.id)
        if len(self.runs) <= self.failures * self.group_size:
            raise RuntimeError("a flaky rollout")
        await super().rollout(task, session)


@dataclass
class Hangs(Arithmetic):
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def rollout(self, task: Task, session: Session) -> None:
        self.started.set()
        await session.observe(task.prompt)
        await asyncio.Event().wait()


class Harness:
    """What the runner hands an executor: the in-flight groups, the gate, the stats; one group launched."""

    def __init__(self, env: Arithmetic, group_timeout: float | None = None) -> None:
        self.env = env
        self.stats = RunnerStats()
        self.in_flight = InFlight(16, self.stats)
        self.gate = Gate()
        self.stopping = asyncio.Event()
        self.ended: list[str] = []
        self.executor = GroupExecutor(
            [env],
            pool=None,
            policy=ScriptedPolicy(arithmetic_script),
            limits=Timeouts().limits(),
            group_timeout=group_timeout,
            in_flight=self.in_flight,
            capacity=[Capacity(None)],
            gate=self.gate,
            stats=self.stats,
            stopping=self.stopping,
            on_rollout_end=self.ended.append,
        )

    def launch(self, group_id: str = "g") -> asyncio.Task[GroupOutcome]:
        """Start the group as the runner does: its task, then its entry in flight (before it first runs)."""
        task = asyncio.create_task(self.executor.run(0, arithmetic_task(1), group_id))
        self.in_flight.add(group_id, Group(task, 0, self.env.group_size, 0))  # type: ignore[arg-type]
        return task


async def test_a_group_runs_here_to_its_outcome_and_tells_each_rollouts_end() -> None:
    h = Harness(Arithmetic())
    outcome = await h.launch("g1")
    assert outcome.group is not None and len(outcome.group.tokens) == 4
    assert h.ended == ["g1"] * 4, "one call per rollout, with its group's id"
    assert h.stats.retried == 0


async def test_a_failed_group_runs_again_up_to_the_envs_group_retries() -> None:
    h = Harness(FailsFirst(failures=2))
    outcome = await h.launch()
    assert outcome.group is not None and h.stats.retried == 2
    assert h.ended == ["g"] * 12, "every attempt's rollouts end, each told"

    h = Harness(FailsFirst(failures=3))
    with pytest.raises(RuntimeError, match="a flaky rollout"):
        await h.launch()
    assert h.stats.retried == 2, "no third retry"


async def test_a_stopping_run_runs_no_group_again() -> None:
    h = Harness(FailsFirst(failures=1))
    h.stopping.set()
    with pytest.raises(RuntimeError):
        await h.launch()
    assert h.stats.retried == 0


async def test_past_group_timeout_the_group_fails() -> None:
    h = Harness(Hangs(), group_timeout=0.05)
    with pytest.raises(GroupTimeout, match="group_timeout=0.05"):
        await h.launch()
    assert h.in_flight.groups["g"].deadline is None, "the deadline is gone with its attempt"


async def test_a_group_started_during_a_pause_holds_its_deadline_until_the_resume() -> None:
    env = Hangs()
    h = Harness(env, group_timeout=0.05)
    h.gate.shut()  # paused: what starts now keeps its whole group_timeout for after the resume
    run = h.launch()
    await env.started.wait()
    g = h.in_flight.groups["g"]
    assert g.deadline is not None and g.deadline.when() is None and g.remaining is not None
    h.in_flight.release_deadlines(asyncio.get_running_loop().time())
    h.gate.open()
    with pytest.raises(GroupTimeout):
        await run


@dataclass
class PerRollout(Arithmetic):
    scores_each_rollout = True


async def test_a_group_scored_per_rollout_runs_its_rollouts_one_by_one_within_the_envs_pool() -> None:
    h = Harness(PerRollout())
    pool = Capacity(2)  # room for two of its four rollouts at a time
    h.executor.capacity = [pool]
    outcome = await h.launch()
    assert outcome.group is not None and len(outcome.group.tokens) == 4
    assert h.ended == ["g"] * 4 and pool.used == 0, "each rollout gave its unit back"


def test_a_group_scored_whole_takes_its_g_units_at_start_one_scored_per_rollout_none() -> None:
    assert units_at_start(Arithmetic(group_size=8)) == 8
    assert units_at_start(PerRollout(group_size=8)) == 0


def test_an_env_that_resumes_must_post_each_rollout_and_name_a_known_mode() -> None:
    """An operator's slips are refused when the runner is built, naming the setting."""
    from rollout_client.examples import Walk
    from rollout_client.runner.execution import check_env

    check_env(Walk(), 8)
    alone = Walk()
    alone.posts_each_rollout = False
    with pytest.raises(ValueError, match="needs posts_each_rollout"):
        check_env(alone, 8)
    typo = Walk()
    typo.resumes = "replays"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="must be 'restart', 'snapshot' or 'replay'"):
        check_env(typo, 8)
    alone.resumes = "restart"
    check_env(alone, 8)
