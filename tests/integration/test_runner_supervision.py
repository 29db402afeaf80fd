"""RolloutRunner against the faults of real runs: a registration that disappears, an inference
server that restarts or rate-limits, verifiers that never return, sandbox closes that hang, workers out of
memory, `exit()` in environment code, defaults that waited forever, curricula, bad inference replies, tasks
that do not pickle and policy factories that raise. Each test names its item; each failed before the fix.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from demos.standin_inference import MODEL
from rollout_client import (
    Curriculum,
    FailurePolicy,
    OpenAIPolicy,
    RecyclePolicy,
    RolloutRunner,
    RunFailed,
    ScriptedPolicy,
    Session,
    Task,
    Tasks,
    Timeouts,
)
from rollout_client.examples import Arithmetic, arithmetic_script, arithmetic_task
from rollout_client.group import Limits
from rollout_client.workers.pool import WorkerPool
from tests.runs import HANG_GUARD_S, drain, finish, run_script, start_trainer, status, until
from tests.servers import ServerProcess, running_server, start_server
from tests.standin import running_standin

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


def index(task: Task) -> int:
    return int(task.id.rsplit("-", 1)[1])


# ------------------------------------------------------------------------------------------- 1. registration


@pytest.mark.parametrize("how", ["reset", "restart"])
async def test_a_lost_registration_is_registered_again_and_the_run_goes_on(tmp_path: Path, how: str) -> None:
    """Item 1: the trainer starts a new run mid-run (/reset_data then /register), or a memory store restarts:
    the runner registers its env again, stamps the new run's step and goes on; nothing ends bare."""
    log = tmp_path / "s.log"
    server: ServerProcess = start_server("memory://", log)
    try:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            num_workers=1,
        )
        run = asyncio.create_task(runner.run(max_groups=40))
        await until(lambda: runner.stats.accepted >= 5, "first groups")
        if how == "reset":
            assert httpx.get(server.url + "/reset_data").status_code == 200
        else:
            server.kill()
            server = start_server("memory://", log, server.port)
        start_trainer(server.url, batch_size=8)
        stats = await asyncio.wait_for(run, HANG_GUARD_S)
        assert stats.reregistered >= 1
        assert not stats.failed and stats.skipped["rejected"] == 0
        assert stats.accepted + stats.duplicates + sum(stats.skipped.values()) == 40
        after = drain(server.url)
        assert len(after) + status(server.url)["queue_size"] > 0, "groups stored under the new registration"
        assert runner.pool is not None and runner.pool.workers == [], "the shutdown ran: no worker left"
    finally:
        server.kill()


# ------------------------------------------------------------------------------------------- 2. inference


def openai_default(url: str) -> partial[OpenAIPolicy]:
    """OpenAIPolicy with its defaults: retries by deadline."""
    return partial(OpenAIPolicy, url, MODEL)


@pytest.mark.parametrize("workers", [0, 1])
async def test_an_inference_restart_holds_dispatch_and_counts_one_outage(tmp_path: Path, workers: int) -> None:
    """Item 2: the inference server killed, then started again on its port: requests retry by deadline, the
    breaker opens (visible in health()) and holds dispatch, the outage counts once, no group fails."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(arithmetic_task))],
            openai_default(vllm.url),
            max_in_flight=8,
            num_workers=workers,
        )
        run = asyncio.create_task(runner.run(max_groups=30))
        await until(lambda: runner.stats.accepted >= 5, "first groups")
        vllm.kill()
        await until(lambda: not runner.health().inference_reachable, "the breaker to open")
        held = runner.stats.dispatched
        assert runner.health().inference_outages == 1
        vllm.revive()
        stats = await asyncio.wait_for(run, HANG_GUARD_S)
        assert held < 30, "dispatch went on after the server came back"
        assert not stats.failed and stats.accepted == 30
        assert stats.inference_outages == 1 and stats.inference_reachable


async def test_429_is_retried_after_its_retry_after(tmp_path: Path) -> None:
    """Item 2: one completion request in three answers 429 with Retry-After: every group still succeeds."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        vllm.control(rate_limit_every=3)
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url, [(Arithmetic(), Tasks(arithmetic_task))], openai_default(vllm.url), max_in_flight=8
        )
        stats = await asyncio.wait_for(runner.run(max_groups=8), HANG_GUARD_S)
        assert vllm.stats()["429"] > 0
        assert not stats.failed and stats.accepted == 8


# ------------------------------------------------------------------------------------------- 3. verifiers


@dataclass
class Spinning(Arithmetic):
    """A verifier that never returns (model code exec'd in score()) on tasks whose index is a multiple of 8."""

    name: str = "spinning"

    def score(self, task: Task, session: Session) -> float:
        if index(task) % 8 == 0:
            while True:
                pass
        return super().score(task, session)


async def test_a_verifier_that_never_returns_fails_its_group_and_its_worker_is_replaced(tmp_path: Path) -> None:
    """Item 3: the group deadline fails the group (group_timeout), the watchdog replaces the worker it holds
    and counts it, and the run goes on."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Spinning(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            num_workers=1,
            timeouts=Timeouts(group=5.0),
        )
        stats = await asyncio.wait_for(runner.run(max_groups=8), HANG_GUARD_S)
        assert stats.failed == {"spinning": {"group_timeout": 1}}
        assert stats.workers_recycled["stuck"] == 1 and stats.worker_deaths == 0
        assert stats.accepted == 7


IN_PROCESS_SPIN = """
import asyncio, sys
from rollout_client import RolloutRunner, ScriptedPolicy, Tasks, Timeouts
from rollout_client.examples import arithmetic_script, arithmetic_task
from tests.integration.test_runner_supervision import Spinning

async def main():
    runner = RolloutRunner(sys.argv[1], [(Spinning(), Tasks(arithmetic_task))], ScriptedPolicy(arithmetic_script),
                           max_in_flight=8, timeouts=Timeouts(group=2.0))
    run = asyncio.create_task(runner.run())
    while not runner.stats.failed:
        await asyncio.sleep(0.02)
    print("spinning", flush=True)
    stats = await run
    print(dict(stats.failed["spinning"]), stats.accepted > 0, flush=True)

if __name__ == "__main__":
    asyncio.run(main())
"""


async def test_an_in_process_verifier_that_never_returns_leaves_sigterm_working(tmp_path: Path) -> None:
    """Item 3: in process, scoring runs off the event loop: the group fails at its deadline, and SIGTERM
    still stops the run in order (before, only SIGKILL did)."""
    script = tmp_path / "spin.py"
    script.write_text(IN_PROCESS_SPIN)
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        proc = run_script(script, server.url)
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), HANG_GUARD_S)
        assert line.strip() == b"spinning"
        os.kill(proc.pid, signal.SIGTERM)
        code, out, err = await asyncio.to_thread(finish, proc, HANG_GUARD_S)
        assert code == 0, err[-3000:]
        assert "'group_timeout'" in out and out.split()[-1] == "True"


# ------------------------------------------------------------------------------------------- 4. release


@dataclass
class HangingClose(Arithmetic):
    """A sandbox whose close never returns; with `hang_rollout`, rollouts wait until cancelled too."""

    name: str = "sandboxed"
    hang_rollout: bool = False

    def resource(self, task: Task) -> AbstractAsyncContextManager[Any]:
        @asynccontextmanager
        async def sandbox() -> AsyncIterator[str]:
            try:
                yield "box"
            finally:
                await asyncio.Event().wait()  # the close hangs

        return sandbox()

    async def rollout(self, task: Task, session: Session) -> None:
        await super().rollout(task, session)
        if self.hang_rollout:
            await asyncio.Event().wait()


async def test_a_hanging_sandbox_close_is_abandoned_and_stop_still_returns(tmp_path: Path) -> None:
    """Item 4: every release is bounded (release_timeout), counted, and the group is still submitted; a stop
    while closes hang returns within shutdown_timeout."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(HangingClose(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            timeouts=Timeouts(release=0.5),
        )
        stats = await asyncio.wait_for(runner.run(max_groups=6), HANG_GUARD_S)
        assert stats.accepted == 6 and stats.release_timeouts == 6

        runner = RolloutRunner(
            server.url,
            [(HangingClose(hang_rollout=True), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            timeouts=Timeouts(shutdown=2.0),
        )
        run = asyncio.create_task(runner.run())
        await until(lambda: runner.stats.in_flight == 8, "rollouts to hang")
        runner.stop()
        stats = await asyncio.wait_for(run, HANG_GUARD_S)
        assert stats.skipped["stopped"] == 2


# ------------------------------------------------------------------------------------------- 5. recycling

ROLLOUTS_HERE = [0]
"""Rollouts run in this process: a fake heap that fills up."""


@dataclass
class Leaky(Arithmetic):
    """Every rollout after the 12th in one process raises MemoryError, as a leaking environment would."""

    name: str = "leaky"

    async def rollout(self, task: Task, session: Session) -> None:
        ROLLOUTS_HERE[0] += 1
        if ROLLOUTS_HERE[0] > 12:
            raise MemoryError()
        await super().rollout(task, session)


async def test_a_worker_out_of_memory_is_recycled_and_its_groups_run_again(tmp_path: Path) -> None:
    """Item 5: a MemoryError replaces its worker; its groups run again on the new one; nothing fails."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Leaky(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=4,
            num_workers=1,
        )
        stats = await asyncio.wait_for(runner.run(max_groups=10), HANG_GUARD_S)
        assert not stats.failed and stats.accepted == 10
        assert stats.workers_recycled["memory_error"] >= 2 and stats.worker_deaths == 0


async def test_workers_are_recycled_after_n_groups(tmp_path: Path) -> None:
    """Item 5: `recycle_after_groups` replaces a worker after that many groups, in order (no group lost)."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=4,
            num_workers=1,
            recycle=RecyclePolicy(max_groups=4),
        )
        stats = await asyncio.wait_for(runner.run(max_groups=10), HANG_GUARD_S)
        assert not stats.failed and stats.accepted == 10 and stats.worker_deaths == 0
        assert stats.workers_recycled["max_groups"] == 2
        assert runner.pool is not None and runner.pool.spawned == 3


async def test_a_worker_being_recycled_that_runs_out_of_memory_is_killed_and_its_group_runs_again(
    tmp_path: Path,
) -> None:
    """A worker that took its `max_groups` is being replaced while it finishes them; a MemoryError in one of them
    (which never answers) still kills it at once, and the group runs again on its replacement: no hang."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Leaky(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=4,
            num_workers=1,
            recycle=RecyclePolicy(max_groups=4),
        )
        stats = await asyncio.wait_for(runner.run(max_groups=10), HANG_GUARD_S)
        assert not stats.failed and stats.accepted == 10 and stats.worker_deaths == 0
        assert stats.workers_recycled["max_groups"] >= 1


# ------------------------------------------------------------------------------------------- 6. exit()

EXITING = """
import asyncio, sys
from dataclasses import dataclass
from rollout_client import FailurePolicy, RolloutRunner, ScriptedPolicy, Tasks
from rollout_client.examples import Arithmetic, arithmetic_script, arithmetic_task

@dataclass
class Exiting(Arithmetic):
    name: str = "exiting"

    async def rollout(self, task, session):
        if int(task.id.rsplit("-", 1)[1]) % 4 == 0:
            exit(3)
        await super().rollout(task, session)

    def score(self, task, session):
        if int(task.id.rsplit("-", 1)[1]) % 4 == 1:
            sys.exit(4)
        return super().score(task, session)

async def main():
    runner = RolloutRunner(sys.argv[1], [(Exiting(), Tasks(arithmetic_task))], ScriptedPolicy(arithmetic_script),
                           max_in_flight=8, failures=FailurePolicy(max_error_rate=None))
    stats = await runner.run(max_groups=12)
    print(dict(stats.failed["exiting"]), stats.accepted, flush=True)

if __name__ == "__main__":
    asyncio.run(main())
"""


async def test_exit_in_environment_code_fails_its_group_not_the_runner(tmp_path: Path) -> None:
    """Item 6: exit() in a rollout or a verifier fails its group (env_error); the run goes on and ends in
    order (before, the process exited with the env's code, with no shutdown and no disconnect)."""
    script = tmp_path / "exiting.py"
    script.write_text(EXITING)
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        code, out, err = await asyncio.to_thread(finish, run_script(script, server.url), HANG_GUARD_S)
        assert code == 0, err[-3000:]
        assert out.split() == ["{'env_error':", "6}", "6"]
        assert httpx.get(server.url + "/status-env", params={"env_id": 0}).status_code in (404, 200)


# ------------------------------------------------------------------------------------------- 7. defaults


async def test_pause_without_a_timeout_is_bounded_by_the_runners_default(tmp_path: Path) -> None:
    """Item 7: pause() with no argument returns within `pause_timeout` while inference hangs."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(arithmetic_task))],
            openai_default(vllm.url),
            max_in_flight=8,
            timeouts=Timeouts(pause=0.5),
        )
        vllm.control(hang_all=True)
        run = asyncio.create_task(runner.run())
        await until(lambda: vllm.stats().get("hung", 0) >= 4, "requests to hang")
        drained = await asyncio.wait_for(runner.pause(), HANG_GUARD_S)
        assert drained is False and runner.stats.skipped["pause_timeout"] >= 1
        runner.stop()
        await asyncio.wait_for(run, HANG_GUARD_S)


async def test_a_runner_held_ahead_of_the_trainer_without_resume_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 7: with max_staleness and nobody calling resume(), the stall is logged and shown in health()."""
    caplog.set_level(logging.WARNING, logger="rollout_client.runner")
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            max_staleness=1,
            stall_warning=0.5,
        )
        run = asyncio.create_task(runner.run())
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            deadline = asyncio.get_running_loop().time() + HANG_GUARD_S
            while runner.health().stalled is None:  # the trainer consumes what it gets
                assert asyncio.get_running_loop().time() < deadline, "no stall reported"
                await http.get("/batch")
                await asyncio.sleep(0.05)  # polling interval
        assert "resume()" in (runner.health().stalled or "")
        assert any("stalled" in r.getMessage() for r in caplog.records)
        runner.stop()
        await asyncio.wait_for(run, HANG_GUARD_S)


# ------------------------------------------------------------------------------------------- 8. curriculum


@dataclass
class Graded(Arithmetic):
    """Scores every rollout `grade`: a curriculum's promotions depend on nothing else."""

    name: str = "graded"
    grade: float = 1.0

    def score(self, task: Task, session: Session) -> float:
        return self.grade


def repeated(level: int, i: int) -> Task:
    task = arithmetic_task(i)
    return Task(f"t{i % 4}", task.prompt, task.answer)  # ids repeat: the same four tasks again and again


class InStep(ScriptedPolicy):
    """Generates a group's rollouts only once every group started before it is acknowledged. The runner gives a
    group's slots back before its submit, so on a loaded machine it may hand out many groups (at the level then
    current) before the first reports arrive: a curriculum's promotions would then depend on the server's speed."""

    runner: RolloutRunner | None = None

    async def generate(self, prompt_ids: list[int], **kw: Any) -> Any:
        runner = self.runner
        assert runner is not None
        await until(lambda: runner.stats.dispatched - runner.stats.accepted <= 1, "the groups before acknowledged")
        return await super().generate(prompt_ids, **kw)


async def test_a_curriculum_promotes_with_repeated_ids_and_uses_every_level(tmp_path: Path) -> None:
    """Item 8: with task ids that repeat, every report counts (the curriculum reaches its last level); a
    level that runs out hands over to the next instead of ending the run."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        levels = [Tasks([repeated(k, i) for i in range(40)]) for k in range(3)]
        cur = Curriculum(levels, window=4)
        policy = InStep(arithmetic_script)  # one group of 4 at a time (max_in_flight), each after the last's report
        runner = RolloutRunner(server.url, [(Graded(), cur)], policy, max_in_flight=4)
        policy.runner = runner
        await asyncio.wait_for(runner.run(max_groups=40), HANG_GUARD_S)
        assert cur.level == 2, "promoted to the last level by its scores"

        cur = Curriculum([Tasks([arithmetic_task(i) for i in range(6)]) for _ in range(3)], window=4)
        runner = RolloutRunner(
            server.url, [(Graded(grade=0.5), cur)], ScriptedPolicy(arithmetic_script), max_in_flight=4
        )
        stats = await asyncio.wait_for(runner.run(), HANG_GUARD_S)
        assert stats.dispatched == 18 and stats.accepted == 18, "every level's tasks used"


# ------------------------------------------------------------------------------------------- 9. replies


def marked(i: int) -> Task:
    task = arithmetic_task(i)
    marker = {1: "NULLLP", 2: "NANLP", 3: "LONG"}.get(i % 8, "")
    return Task(task.id, f"{marker} {task.prompt}", task.answer)


@dataclass
class NanScore(Arithmetic):
    name: str = "checked"

    def score(self, task: Task, session: Session) -> float:
        return math.nan if index(task) % 8 == 4 else super().score(task, session)


async def test_inference_replies_are_validated_and_nan_scores_fail_as_env_errors(tmp_path: Path) -> None:
    """Item 9: a null or NaN logprob and a completion past max_tokens fail their group as inference errors
    with a clear reason (never stored as 0.0, never sent to the server); a NaN score is an env error."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        vllm.control(null_logprob_marker="NULLLP", nan_logprob_marker="NANLP", overlong_marker="LONG")
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(NanScore(), Tasks(marked))],
            openai_default(vllm.url),
            max_in_flight=8,
            failures=FailurePolicy(max_error_rate=None, quarantine_after=None),
        )
        stats = await asyncio.wait_for(runner.run(max_groups=16), HANG_GUARD_S)
        assert stats.failed == {"checked": {"inference_error": 6, "env_error": 2}}
        assert stats.accepted == 8 and stats.skipped["rejected"] == 0
        served = drain(server.url)
        assert all(lp != 0.0 for g in served for row in g["inference_logprobs"] for lp in row)


def padded(i: int) -> Task:
    task = arithmetic_task(i)
    return Task(task.id, task.prompt + " " * 30, task.answer)  # 44 tokens or so: near the 48-token context


async def test_the_context_is_learned_from_the_first_400_and_truncation_there_is_flagged(tmp_path: Path) -> None:
    """Item 9: a server that does not list its context: the first 400 names it, requests are clipped to it,
    and completions stopped by it are marked truncated."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        vllm.control(context=48, advertise_context=False)
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url, [(Arithmetic(max_tokens=32), Tasks(padded))], openai_default(vllm.url), max_in_flight=8
        )
        stats = await asyncio.wait_for(runner.run(max_groups=4), HANG_GUARD_S)
        assert not stats.failed and stats.accepted == 4
        assert vllm.stats()["400_context"] >= 1
        served = drain(server.url)
        rows = [(len(t), o["truncated"]) for g in served for t, o in zip(g["tokens"], g["overrides"], strict=True)]
        assert rows and all(n == 48 and truncated for n, truncated in rows)


# ------------------------------------------------------------------------------------------- 10. small


def unpicklable(i: int) -> Task:
    task = arithmetic_task(i)
    return Task(task.id, task.prompt, task.answer, meta={"fn": lambda: i})


async def test_an_unpicklable_task_leaves_no_phantom_load() -> None:
    """Item 10: a task that does not pickle fails its group and holds nothing on the worker."""
    pool = WorkerPool(1, [Arithmetic()], ScriptedPolicy(arithmetic_script), Limits())
    await pool.start()
    try:
        for i in range(6):
            with pytest.raises(Exception, match="pickle|lambda"):
                await pool.run(0, unpicklable(i), f"k{i}")
        assert [w.load for w in pool.workers] == [0]
        outcome = await asyncio.wait_for(pool.run(0, arithmetic_task(7), "k7"), HANG_GUARD_S)
        assert outcome.group is not None
    finally:
        await pool.close()


def broken_policy() -> ScriptedPolicy:
    raise ValueError("no GPU here")


async def test_a_policy_factory_that_raises_ends_the_run_with_its_error(tmp_path: Path) -> None:
    """Item 10: the factory's own error is carried in RunFailed (not only on a worker's stderr), after a few
    workers in a row failed to start, not dozens."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url, [(Arithmetic(), Tasks(arithmetic_task))], broken_policy, max_in_flight=4, num_workers=1
        )
        with pytest.raises(RunFailed, match="no GPU here") as info:
            await asyncio.wait_for(runner.run(), HANG_GUARD_S)
        cause: BaseException | None = info.value
        while cause is not None and not isinstance(cause, ValueError):
            cause = cause.__cause__
        assert isinstance(cause, ValueError) and str(cause) == "no GPU here"
        assert runner.pool is not None and runner.pool.spawned <= 4
