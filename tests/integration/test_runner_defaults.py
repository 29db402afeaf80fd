"""RolloutRunner on its defaults: a cancelled run stops its workers and its process exits, a worker
replaced during a pause follows the latest gate state, a cancelled sandbox acquire leaks no unit. Each test
failed before its fix; each runs real worker processes against a real server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from client_core import outage
from client_core.errors import RetriesExhausted
from demos.standin_inference import MODEL
from rollout_client import OpenAIPolicy, RolloutRunner, RunFailed, ScriptedPolicy, Tasks
from rollout_client.client import RolloutClient
from rollout_client.errors import InferenceError, SetupTimeout, WorkerDied
from rollout_client.examples import Synthetic, arithmetic_script, arithmetic_task
from tests.runs import HANG_GUARD_S, exited, start_trainer, until
from tests.servers import running_server
from tests.standin import running_standin

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

ROOT = Path(__file__).resolve().parents[2]

CANCELLED_RUN = """
import asyncio, sys
from client_core import outage
from client_core.errors import RetriesExhausted
from rollout_client import OpenAIPolicy, RolloutRunner, RunFailed, ScriptedPolicy, Tasks
from rollout_client.client import RolloutClient
from rollout_client.errors import InferenceError, SetupTimeout
from rollout_client.examples import Synthetic, arithmetic_script, arithmetic_task

async def beside(runner):
    while runner.stats.accepted < 2:
        await asyncio.sleep(0.02)
    print(*runner.pool.pids, flush=True)
    raise RuntimeError("an error beside the run")

async def main(how):
    runner = RolloutRunner(sys.argv[1], [(Synthetic(group_size=4, wait_s=0.05), Tasks(arithmetic_task))],
                           ScriptedPolicy(arithmetic_script), max_in_flight=8, num_workers=2)
    if how == "wait_for":  # wait_for cancels the run when its time is up
        run = asyncio.create_task(runner.run())
        while runner.stats.accepted < 2:
            await asyncio.sleep(0.02)
        print(*runner.pool.pids, flush=True)
        try:
            await asyncio.wait_for(run, 0.2)
        except TimeoutError:
            pass
    else:  # the error ends the TaskGroup, which cancels the run
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(runner.run())
                tg.create_task(beside(runner))
        except* RuntimeError:
            pass
    print("returned", runner.pool.pids, flush=True)

if __name__ == "__main__":
    asyncio.run(main(sys.argv[2]))
"""


@pytest.mark.parametrize("how", ["wait_for", "task_group"])
async def test_a_cancelled_run_stops_its_workers_and_the_process_exits(tmp_path: Path, how: str) -> None:
    """Before: the shutdown ran only after `except Exception`: a cancelled run() skipped it, 2 of 2 workers
    stayed (they ignore SIGTERM, so multiprocessing's exit hook waited on them forever)."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=16)
        proc = subprocess.Popen(
            [sys.executable, "-c", CANCELLED_RUN, server.url, how],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), HANG_GUARD_S)
            workers = [int(p) for p in line.split()]
            assert len(workers) == 2
            try:
                code = await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                left = [p for p in workers if not exited(p)]
                raise AssertionError(f"the process did not exit; {len(left)} of 2 workers left") from None
            out = proc.stdout.read().decode()
            assert code == 0, proc.stderr.read().decode() if proc.stderr else ""  # type: ignore[union-attr]
            assert "returned []" in out, "the run's shutdown stopped its workers before run() returned"
            await until(lambda: all(exited(p) for p in workers), "the workers to exit")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for f in (proc.stdout, proc.stderr):
                if f is not None:
                    f.close()


async def test_a_worker_replaced_during_a_pause_follows_resume(tmp_path: Path) -> None:
    """A worker killed while the runner is paused: its replacement is told "pause" as it starts, and
    `resume()` right after; both wait in its pipe while it imports. Before: "pause" closed its gate only once a
    task ran, after "resume" had opened it, so the gate stayed shut and its groups hung until group_timeout
    (1 h); now the gate follows the messages' order and groups flow again."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=16)
        runner = RolloutRunner(
            server.url,
            [(Synthetic(group_size=4, wait_s=0.02), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            num_workers=1,
        )
        run = asyncio.create_task(runner.run())
        try:
            await until(lambda: runner.stats.accepted >= 2, "first groups")
            assert runner.pool is not None
            assert await runner.pause(timeout=10.0)
            [pid] = runner.pool.pids
            os.kill(pid, signal.SIGKILL)
            pool = runner.pool
            await until(lambda: pool.spawned == 2 and len(pool.workers) == 1, "the replacement to start")
            runner.resume()
            before = runner.stats.accepted
            await until(lambda: runner.stats.accepted >= before + 4, "groups on the replacement after resume()")
            assert runner.pool.deaths == 1
        finally:
            runner.stop()
            await asyncio.wait_for(run, HANG_GUARD_S)


async def test_the_breaker_judges_a_hung_engine_by_completions_not_its_model_list(tmp_path: Path) -> None:
    """An engine that hangs while /v1/models answers: before, each probe of /v1/models closed the breaker and
    the next completion opened it again (many "reachable again"/"unreachable" pairs); now the probe is a
    completion, which hangs too: the breaker stays open, one change, until the engine answers again."""
    with running_standin(tmp_path / "v.log") as server:
        policy = OpenAIPolicy(server.url, MODEL, timeout=0.3, max_attempts=1, retry_deadline=0.5)
        changes: list[bool] = []
        policy.on_reachability = changes.append
        try:
            server.control(hang_all=True)
            with pytest.raises(InferenceError):
                await policy.generate([1, 2, 3], max_tokens=4)
            await until(lambda: policy._probe is not None and policy._probe.done() is False, "the probe")
            deadline = asyncio.get_running_loop().time() + 3.0
            while asyncio.get_running_loop().time() < deadline and len(changes) < 3:
                with contextlib.suppress(InferenceError):
                    await policy.generate([1, 2, 3], max_tokens=4)
            assert changes == [False], f"{changes.count(True)} reachable-again flips while the engine hung"
            server.control(hang_all=False)
            await until(lambda: changes == [False, True], "the probe to find the engine answering again")
        finally:
            await policy.aclose()


@dataclass
class SetupHangs(Synthetic):
    """A tool server that never comes up: `worker_setup()` never returns."""

    name: str = "setup_hangs"
    setup_timeout: float | None = 0.5

    def worker_setup(self) -> AbstractAsyncContextManager[None]:
        @asynccontextmanager
        async def forever() -> AsyncIterator[None]:
            await asyncio.Event().wait()
            yield

        return forever()


async def test_a_worker_setup_that_hangs_ends_the_run_with_an_error_naming_it(tmp_path: Path) -> None:
    """Before: the run stalled with no error, log or timeout. Now `setup_timeout` bounds it and the run ends
    with RunFailed, its cause a SetupTimeout naming the env. (In the runner's process: a worker that fails so
    reports it as a fatal start, and 3 in a row end the run the same way: 25 s more of test for one path.)"""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=16)
        runner = RolloutRunner(
            server.url, [(SetupHangs(), Tasks(arithmetic_task))], ScriptedPolicy(arithmetic_script), max_in_flight=8
        )
        with pytest.raises(RunFailed) as info:
            await asyncio.wait_for(runner.run(max_groups=4), HANG_GUARD_S)
        assert isinstance(info.value.__cause__, SetupTimeout)
        assert "worker_setup() of env 'setup_hangs'" in str(info.value.__cause__)
        assert "raise SetupHangs.setup_timeout if it needs longer" in str(info.value.__cause__)


@dataclass
class SetupBlocks(Synthetic):
    """A tool server's client that connects with a synchronous call that never returns: `worker_setup()`
    blocks its worker's event loop, where the worker's own `setup_timeout` cannot fire."""

    name: str = "setup_blocks"
    setup_timeout: float | None = 0.5

    def worker_setup(self) -> AbstractAsyncContextManager[None]:
        @asynccontextmanager
        async def blocking() -> AsyncIterator[None]:
            time.sleep(3600)  # ends with its worker
            yield

        return blocking()


async def test_a_worker_setup_that_blocks_its_worker_is_cut_and_named_at_each_try(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In a worker process, a `worker_setup()` that blocks the event loop: the runner kills the worker past its
    `setup_timeout` (and a grace), says so at each try naming the hook, the env, the worker, the bound and the
    setting, and after 3 tries in a row ends the run with that error; `worker_deaths` counts them."""
    with caplog.at_level(logging.ERROR), running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=16)
        runner = RolloutRunner(
            server.url,
            [(SetupBlocks(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            num_workers=1,
        )
        with pytest.raises(RunFailed) as info:
            await asyncio.wait_for(runner.run(max_groups=4), HANG_GUARD_S)
    assert isinstance(info.value.__cause__, WorkerDied) and isinstance(info.value.__cause__.__cause__, SetupTimeout)
    named = (
        "worker_setup() of env 'setup_blocks' did not return within setup_timeout=0.5 s in rollout worker pid",
        "raise SetupBlocks.setup_timeout if it needs longer",
    )
    assert all(part in str(info.value) for part in named), str(info.value)
    tries = [r.getMessage() for r in caplog.records if r.name == "rollout_client.workers"]
    for n in (1, 2):
        [line] = [t for t in tries if f"could not start ({n} of 3 in a row end the run)" in t]
        assert all(part in line for part in named), line
    assert runner.stats.worker_deaths == 3


async def test_a_producer_says_what_it_waits_for(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: a producer waited silently for the trainer's first batch request (290 s with no output), and
    retried an unreachable server silently. Now both are logged (rate-limited)."""
    with caplog.at_level(logging.WARNING), running_server("memory://", tmp_path / "s.log") as server:
        runner = RolloutRunner(server.url, [(Synthetic(), Tasks(arithmetic_task))], ScriptedPolicy(arithmetic_script))
        run = asyncio.create_task(runner.run())
        await until(lambda: "waiting to register" in caplog.text, "the waiting line")
        runner.stop()
        await asyncio.wait_for(run, HANG_GUARD_S)
        assert "env synthetic: waiting to register (0 s so far): no trainer has registered yet" in caplog.text
        port = server.port
    outage.AFTER_S, saved = 0.0, outage.AFTER_S
    try:
        client = RolloutClient(f"http://127.0.0.1:{port}", retry_deadline=1.0)  # the server is gone
        with pytest.raises(RetriesExhausted):
            await client.info()
        await client.aclose()
    finally:
        outage.AFTER_S = saved
    assert f"rollbuf server http://127.0.0.1:{port} unreachable for 0 s, retrying: GET /info" in caplog.text
