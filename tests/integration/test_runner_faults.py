"""RolloutRunner against what real environments and inference servers do: large payloads through workers,
flaky and hanging inference (the stand-in inference server as a process, `demos/standin_inference.py`),
environments that raise, a server that stops answering, sandboxes that fail to close, episodes past the token
budget, trainers that sync weights every k steps, SIGTERM to the process group, and a synchronous trainer driving
the runner.

Each test names the defect it guards; each failed before its fix.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
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
    InferenceError,
    OpenAIPolicy,
    RolloutRunner,
    RunFailed,
    ScriptedPolicy,
    Session,
    Task,
    Tasks,
    Timeouts,
)
from rollout_client.examples import Arithmetic, Calculator, arithmetic_script, arithmetic_task
from rollout_client.runner.handle import run_in_thread
from tests.runs import HANG_GUARD_S, drain, finish, run_script, start_trainer, status, until
from tests.servers import running_server
from tests.standin import running_standin

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

ROOT = Path(__file__).resolve().parents[2]


def openai(url: str) -> partial[OpenAIPolicy]:
    """A picklable policy factory for the fake vLLM at `url`, with fast retries."""
    return partial(OpenAIPolicy, url, MODEL, max_attempts=6, retry_deadline=20.0)


# ------------------------------------------------------------------------------------------- 1. worker IPC

LARGE_PAYLOADS = """
import asyncio, sys
from dataclasses import dataclass
from rollout_client import RolloutRunner, ScriptedPolicy, Task, Tasks
from rollout_client.examples import Arithmetic

@dataclass
class Big(Arithmetic):
    name: str = "big"
    group_size: int = 4
    max_tokens: int = 16384

    async def rollout(self, task, session):  # rollouts end at different times: results flow while tasks go out
        await session.observe(task.prompt)
        await asyncio.sleep(0.01 * (int(task.id[1:]) % 7))
        await session.generate()

def task(i):
    return Task(f"t{i}", f"Q: {i} + 1 =", str(i + 1), meta={"blob": "x" * 100_000})

def script(prompt, seed):
    return " A: " + "7" * 16000

async def main():
    runner = RolloutRunner(sys.argv[1], [(Big(), Tasks(task))], ScriptedPolicy(script), max_in_flight=64,
                           num_workers=1)
    stats = await runner.run(max_groups=int(sys.argv[2]))
    print(stats.accepted, stats.failed_total, flush=True)

if __name__ == "__main__":
    asyncio.run(main())
"""


async def test_large_payloads_through_a_worker_do_not_deadlock(tmp_path: Path) -> None:
    """Defect 1: 100 KB tasks one way and 16k-token completions the other, 64 rollouts in flight, one worker."""
    script = tmp_path / "large.py"
    script.write_text(LARGE_PAYLOADS)
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=64, max_token_len=20000)
        code, out, err = await asyncio.to_thread(finish, run_script(script, server.url, "32"), HANG_GUARD_S)
        assert code == 0, err[-3000:]
        assert out.split() == ["32", "0"]
        served = drain(server.url)
        assert len(served) == 32 and all(len(t) > 16000 for g in served for t in g["tokens"]), "16k-token completions"


# ------------------------------------------------------------------------------------------- 2. errors


def marked_task(i: int, marker: str = "", every: int = 0) -> Task:
    task = arithmetic_task(i)
    if every and i % every == 0:
        return Task(task.id, f"{marker} {task.prompt}", task.answer)
    return task


@pytest.mark.parametrize("workers", [0])  # the worker path runs the same policy code; its errors: see below
async def test_inference_5xx_is_retried_and_4xx_fails_only_its_group(tmp_path: Path, workers: int) -> None:
    """Defect 2: a fake vLLM answering 503 on 1 call in 7 costs nothing; a 400 is never retried and fails its
    group alone (counted as inference_error), and the run goes on."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        vllm.control(fail_every=7, reject_marker="REJECT")
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(partial(marked_task, marker="REJECT", every=5)))],
            openai(vllm.url),
            max_in_flight=16,
            num_workers=workers,
        )
        stats = await asyncio.wait_for(runner.run(max_groups=40), HANG_GUARD_S)
        v = vllm.stats()
        assert v["503"] > 0, "the fake server did fail"
        assert stats.failed == {"arithmetic": {"inference_error": 8}} and stats.accepted == 32
        rejected = {p: n for p, n in v["prompts"].items() if "REJECT" in p}
        assert len(rejected) == 8 and sum(rejected.values()) == v["400"], "every REJECT request got its 400"
        assert all(n <= 4 for n in rejected.values()), "a 4xx is never retried (at most one per rollout)"
        assert status(server.url)["queue_size"] == 32


@dataclass
class Flaky(Arithmetic):
    """Raises mid-episode (after its first turn) on tasks whose index is a multiple of `every`."""

    name: str = "flaky"
    every: int = 4

    async def rollout(self, task: Task, session: Session) -> None:
        await super().rollout(task, session)
        if int(task.id.rsplit("-", 1)[1]) % self.every == 0:
            raise ValueError(f"tool crashed on {task.id}")


@pytest.mark.parametrize("workers", [0, 1])
async def test_an_env_that_raises_fails_its_group_and_a_task_that_keeps_failing_is_quarantined(
    tmp_path: Path, workers: int
) -> None:
    """Defect 2: an environment raising mid-episode fails its group only; the failing task, handed out again
    and again by a cycling source, is quarantined after 3 failures."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        tasks = Tasks([arithmetic_task(i) for i in range(4)], cycle=True)  # task 0 always fails
        runner = RolloutRunner(
            server.url, [(Flaky(), tasks)], ScriptedPolicy(arithmetic_script), max_in_flight=4, num_workers=workers
        )
        stats = await asyncio.wait_for(runner.run(max_groups=40), HANG_GUARD_S)
        assert stats.failed == {"flaky": {"env_error": 3}}
        assert stats.quarantined == {"flaky": {"+2-0"}} and stats.skipped["quarantined"] >= 1
        assert "ValueError: tool crashed on +2-0" in stats.last_error["flaky"]
        assert stats.dispatched == 40 and stats.accepted == 37, "a quarantined task is never dispatched"


@pytest.mark.parametrize("workers", [0, 1])
async def test_past_the_error_rate_the_run_ends_with_run_failed_carrying_the_original_error(
    tmp_path: Path, workers: int
) -> None:
    """Defect 2: `except` on the env's own error type works, in process and through a worker."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Flaky(every=2), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=4,
            num_workers=workers,
            failures=FailurePolicy(max_error_rate=0.4, error_window=10),
        )
        with pytest.raises(RunFailed, match="max_error_rate") as info:
            await asyncio.wait_for(runner.run(), HANG_GUARD_S)
        assert isinstance(info.value.__cause__, ValueError) and info.value.error is info.value.__cause__
        assert "tool crashed" in str(info.value.__cause__)
        assert info.value.failed["flaky"]["env_error"] >= 5
        assert runner.stats.in_flight == 0 and (runner.pool is None or runner.pool.workers == [])


async def test_retried_inference_that_keeps_failing_ends_the_run_with_the_inference_error(tmp_path: Path) -> None:
    """Defect 2: an inference server answering 503 to everything: bounded retries, then RunFailed from
    InferenceError (not an ExceptionGroup)."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        vllm.control(fail_every=1)
        start_trainer(server.url, batch_size=8)
        policy = partial(OpenAIPolicy, vllm.url, MODEL, max_attempts=2)
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(arithmetic_task))],
            policy,
            max_in_flight=8,
            failures=FailurePolicy(error_window=4),
        )
        with pytest.raises(RunFailed) as info:
            await asyncio.wait_for(runner.run(), HANG_GUARD_S)
        cause = info.value.__cause__
        assert isinstance(cause, InferenceError) and cause.status == 503
        assert vllm.stats()["requests"] >= 2 * 4, "each request was tried twice"


# ------------------------------------------------------------------------------------------- 3. timeouts


@pytest.mark.parametrize("workers", [0])  # a worker runs the same Session code; pause covers worker hangs
async def test_a_hanging_generate_times_out_and_frees_its_slot(tmp_path: Path, workers: int) -> None:
    """Defect 3: one hanging generate no longer keeps run(max_groups=10) from returning."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        vllm.control(hang_marker="HANG")
        start_trainer(server.url, batch_size=8)
        # turn_timeout leaves a healthy turn room on a loaded machine (one took over 0.5 s in CI)
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(partial(marked_task, marker="HANG", every=4)))],
            openai(vllm.url),
            max_in_flight=8,
            num_workers=workers,
            timeouts=Timeouts(turn=2.0),
        )
        stats = await asyncio.wait_for(runner.run(max_groups=10), HANG_GUARD_S)
        assert stats.failed == {"arithmetic": {"turn_timeout": 3}} and stats.accepted == 7
        assert stats.in_flight == 0


@dataclass
class Slow(Arithmetic):
    """Its tool takes `tool_s` between two turns."""

    name: str = "slow"
    tool_s: float = 30.0

    async def rollout(self, task: Task, session: Session) -> None:
        await super().rollout(task, session)
        async with session.tool("sleep"):
            await asyncio.sleep(self.tool_s)


async def test_a_rollout_past_rollout_timeout_fails_its_group(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Slow(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            timeouts=Timeouts(rollout=0.3),
        )
        stats = await asyncio.wait_for(runner.run(max_groups=4), HANG_GUARD_S)
        assert stats.failed == {"slow": {"rollout_timeout": 4}} and stats.accepted == 0


@pytest.mark.parametrize("workers", [0, 1])
async def test_pause_with_a_timeout_returns_while_inference_hangs(tmp_path: Path, workers: int) -> None:
    """Defect 3: pause(timeout=...) returns within its bound while every request hangs; the groups still
    generating are cancelled, dropped and counted; resume() carries on."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url, [(Arithmetic(), Tasks(arithmetic_task))], openai(vllm.url), max_in_flight=8, num_workers=workers
        )
        vllm.control(hang_all=True)
        run = asyncio.create_task(runner.run())
        await until(lambda: vllm.stats().get("hung", 0) >= 4, "requests to hang")
        drained = await asyncio.wait_for(runner.pause(timeout=0.5), 10.0)
        assert drained is False and runner.stats.skipped["pause_timeout"] >= 1
        await until(lambda: runner.stats.in_flight == 0, "cancelled groups to let go of their slots")
        vllm.control(hang_all=False)
        before = runner.stats.accepted
        runner.resume()
        await until(lambda: runner.stats.accepted >= before + 4, "groups after resume")
        runner.stop()
        stats = await asyncio.wait_for(run, HANG_GUARD_S)
        assert not stats.failed


# ------------------------------------------------------------------------------------------- 4. shutdown


async def test_run_returns_within_shutdown_timeout_when_the_server_hangs(tmp_path: Path) -> None:
    """Defect 4: SIGSTOP the server, stop a runner with 3 envs: it returns within shutdown_timeout (the
    disconnects go out together, within the time left), not after three read timeouts in a row."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        envs = [(Arithmetic(name=f"e{k}"), Tasks(arithmetic_task)) for k in range(3)]
        runner = RolloutRunner(
            server.url, envs, ScriptedPolicy(arithmetic_script), max_in_flight=12, timeouts=Timeouts(shutdown=2.0)
        )
        run = asyncio.create_task(runner.run())
        await until(lambda: runner.stats.accepted >= 6, "first groups")
        os.killpg(server.proc.pid, signal.SIGSTOP)
        try:
            await until(lambda: runner.stats.in_flight == 0, "rollouts to end and submits to hang")
            t0 = time.monotonic()
            runner.stop()
            await asyncio.wait_for(run, HANG_GUARD_S)
            elapsed = time.monotonic() - t0
        finally:
            os.killpg(server.proc.pid, signal.SIGCONT)
        assert elapsed < runner.timeouts.shutdown + 1.0, f"run() took {elapsed:.1f} s to return"


# ------------------------------------------------------------------------------------------- 5. rollback


class Sandboxes:
    """Sandbox 2 fails to start; sandbox 0 fails to close."""

    def __init__(self) -> None:
        self.n = 0

    @asynccontextmanager
    async def get(self) -> AsyncIterator[int]:
        i, self.n = self.n % 4, self.n + 1
        await asyncio.sleep(0.01 * i)
        if i == 2:
            raise OSError("sandbox 2 failed to start")
        try:
            yield i
        finally:
            if i == 0:
                raise RuntimeError("sandbox 0 close failed")


@dataclass
class Sandboxed(Arithmetic):
    name: str = "sandboxed"

    def __post_init__(self) -> None:
        self.sandboxes = Sandboxes()

    def resource(self, task: Task) -> AbstractAsyncContextManager[Any]:
        return self.sandboxes.get()


@pytest.mark.parametrize("workers", [0, 1])
async def test_a_failed_rollback_keeps_the_original_error(tmp_path: Path, workers: int) -> None:
    """Defect 5: the caller sees the OSError that failed the group, with the close error attached."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Sandboxed(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=4,
            num_workers=workers,
            failures=FailurePolicy(max_error_rate=0.0, error_window=1),
        )
        with pytest.raises(RunFailed) as info:
            await asyncio.wait_for(runner.run(), HANG_GUARD_S)
        cause = info.value.__cause__
        assert isinstance(cause, OSError) and "sandbox 2 failed to start" in str(cause)
        assert any("RuntimeError: sandbox 0 close failed" in note for note in getattr(cause, "__notes__", []))


# ------------------------------------------------------------------------------------------- 6. truncation


@pytest.mark.parametrize("max_token_len", [46, 52])
async def test_multi_turn_episodes_past_the_budget_are_truncated_not_dropped(
    tmp_path: Path, max_token_len: int
) -> None:
    """Defect 6: the calculator env at max_token_len 46-52, where turn 2's tool output fills the budget:
    every group is stored, truncated sequences are marked, none is over the budget."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8, max_token_len=max_token_len)
        runner = RolloutRunner(
            server.url, [(Calculator(), Tasks(arithmetic_task))], ScriptedPolicy(arithmetic_script), max_in_flight=16
        )
        stats = await asyncio.wait_for(runner.run(max_groups=20), HANG_GUARD_S)
        assert stats.accepted == 20 and not stats.skipped and not stats.failed
        served = drain(server.url)
        assert len(served) == 20
        overrides = [o for g in served for o in g["overrides"]]
        assert all(len(t) <= max_token_len for g in served for t in g["tokens"])
        truncated = [o for o in overrides if o["truncated"]]
        assert truncated and all(o["finish_reason"] == "length" for o in truncated)
        assert all(o["num_turns"] == len(o["turns"]) >= 1 for o in overrides)
        assert all(o["tools"]["calculator"]["calls"] >= 1 for o in overrides if o["num_turns"] >= 2)
        assert all(o["tools"]["calculator"]["failures"] == 0 for o in overrides if o["tools"])


# ------------------------------------------------------------------------------------------- 7. resume()


async def test_a_trainer_syncing_every_k_steps_never_deadlocks_with_the_default_resume(tmp_path: Path) -> None:
    """Defect 7: resume() takes the trainer's step, so a trainer that syncs weights every 3 steps keeps
    getting batches (the runner used to stamp old step + 1 and hold the env back forever). The runner's
    `max_staleness` paces by an estimate; the trainer's own `max_staleness` is what guarantees nothing stale is
    served (a loaded CI machine once saw one group 3 steps old without it)."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8, max_staleness=2)
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            max_staleness=2,
            poll_interval=0.05,
        )
        run = asyncio.create_task(runner.run())
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                step = 0
                deadline = time.monotonic() + HANG_GUARD_S
                while step < 12:
                    assert time.monotonic() < deadline, f"stuck at step {step}: {runner.stats.paused}"
                    batch = (await http.get("/batch", params={"step": step})).json()["batch"]
                    if not batch:
                        await asyncio.sleep(0.02)
                        continue
                    step += 1
                    served = [g["policy_step"] for g in batch]
                    assert all(step - 1 - p <= 2 for p in served), f"step {step - 1} served {served}: {runner.stats}"
                    if step % 3 == 0:
                        await runner.pause()
                        await until(lambda: runner.stats.trainer_step >= step, "the runner to read the step")  # noqa: B023
                        runner.resume()
                        assert runner.policy_step == step
        finally:  # a failed assert must not leave the runner (and its connections) running
            runner.stop()
            await asyncio.wait_for(run, HANG_GUARD_S)


# ------------------------------------------------------------------------------------------- 8. minor

GROUP_SIGTERM = """
import asyncio, sys
from rollout_client import RolloutRunner, ScriptedPolicy, Tasks
from rollout_client.examples import Synthetic, arithmetic_script, arithmetic_task

async def main():
    runner = RolloutRunner(sys.argv[1], [(Synthetic(group_size=4, wait_s=0.05), Tasks(arithmetic_task))],
                           ScriptedPolicy(arithmetic_script), max_in_flight=16, num_workers=2)
    run = asyncio.create_task(runner.run())
    while runner.stats.accepted < 4:
        await asyncio.sleep(0.02)
    print("ready", flush=True)
    stats = await run
    print(stats.worker_deaths, runner.pool.spawned, stats.failed_total, len(runner.pool.workers), flush=True)
    print(*runner.pool.exitcodes, flush=True)

if __name__ == "__main__":
    asyncio.run(main())
"""


async def test_sigterm_to_the_process_group_stops_in_order_without_replacing_workers(tmp_path: Path) -> None:
    """Defect 8: `kill -TERM -<pgid>` reaches the workers too; they leave the shutdown to the runner, which
    starts no replacement, and the run ends cleanly."""
    script = tmp_path / "group.py"
    script.write_text(GROUP_SIGTERM)
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=16)
        proc = run_script(script, server.url)
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), HANG_GUARD_S)
        assert line.strip() == b"ready"
        os.killpg(proc.pid, signal.SIGTERM)
        code, out, err = await asyncio.to_thread(finish, proc, HANG_GUARD_S)
        assert code == 0, err[-3000:]
        counts, codes = out.splitlines()
        assert codes.split() == ["0", "0"], "both workers stopped in order, none was killed by the signal"
        deaths, spawned, failed, left = counts.split()
        assert (deaths, spawned) == ("0", "2"), "no worker died of the signal, none was replaced"
        assert (failed, left) == ("0", "0"), "no group failed, every worker stopped"


@dataclass
class Mixed(Arithmetic):
    """Fails on every third task, and pads every fifth past the budget (rejected by the server)."""

    name: str = "mixed"

    async def rollout(self, task: Task, session: Session) -> None:
        await super().rollout(task, session)
        i = int(task.id.rsplit("-", 1)[1])
        if i % 3 == 0:
            raise ValueError("boom")
        if i % 5 == 0:
            session.observe_ids([32] * 600)


async def test_the_curriculum_forgets_groups_that_are_never_reported(tmp_path: Path) -> None:
    """Defect 8: failed, rejected and stopped groups no longer leave an entry behind in Curriculum."""
    curriculum = Curriculum([Tasks(arithmetic_task), Tasks(partial(arithmetic_task, digits=3))])
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Mixed(), curriculum)],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            failures=FailurePolicy(max_error_rate=None),
        )
        stats = await asyncio.wait_for(runner.run(max_groups=30), HANG_GUARD_S)
        assert stats.failed_total > 0 and stats.skipped["rejected"] > 0
        assert curriculum._level_of == {}, "every handed-out task was reported or discarded"


# ------------------------------------------------------------------------------------------- handle


def test_a_synchronous_trainer_drives_the_runner_through_a_blocking_handle(tmp_path: Path) -> None:
    """The trainer's thread pauses and resumes the runner around pretend weight syncs and reads its health."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            num_workers=1,
        )
        with run_in_thread(runner) as handle, httpx.Client(base_url=server.url, timeout=30) as http:
            assert handle.wait_ready(HANG_GUARD_S)
            step, deadline = 0, time.monotonic() + HANG_GUARD_S
            while step < 4:
                assert time.monotonic() < deadline
                if http.get("/batch", params={"step": step}).json()["batch"]:
                    step += 1
                    assert handle.pause(timeout=5.0) is True
                    assert handle.health().paused
                    handle.resume(policy_step=step)
                else:
                    threading.Event().wait(0.02)  # poll interval of this pretend trainer
            health = handle.health()
            assert health.running and health.workers_alive == 1 and health.policy_step == 4
            assert health.failed_total == 0 and not health.paused and health.error is None
        stats = handle.join(HANG_GUARD_S)
        assert stats.accepted >= 8 and not handle.health().running
