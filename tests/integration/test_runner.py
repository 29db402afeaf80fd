"""RolloutRunner against real rollbuf server processes: concurrency bound, exact accounting, worker processes
and worker death, shutdown under load, pause/resume, staleness, a server restart, no orphan workers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_client import (
    Environment,
    Rejected,
    RolloutRunner,
    RunFailed,
    ScriptedPolicy,
    Session,
    Task,
    Tasks,
    Timeouts,
)
from rollout_client.examples import Arithmetic, Synthetic, arithmetic_script, arithmetic_task
from rollout_client.runner.pacing import AHEAD, QUEUE_FULL
from tests.factories import group
from tests.runs import HANG_GUARD_S, drain, exited, start_trainer, status, until
from tests.servers import ServerProcess, running_server, start_server

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


@dataclass
class Tracked(Environment):
    """Counts rollouts running at once (in this process) to check the runner's bound independently."""

    name: str = "tracked"
    group_size: int = 4

    async def rollout(self, task: Task, session: Session) -> None:
        TRACK["now"] += 1
        TRACK["max"] = max(TRACK["max"], TRACK["now"])
        if TRACK["now"] > self.group_size:
            OVERLAP.set()
        try:
            await session.observe(task.prompt)
            # The first groups wait (bounded) for another group's rollouts to run beside them: that the runner
            # runs more than one group at once is then shown whatever the machine's load, not by luck.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(OVERLAP.wait(), OVERLAP_WAIT_S)
            await session.generate()
        finally:
            TRACK["now"] -= 1

    def score(self, task: Task, session: Session) -> float:
        return float((session.seed or 0) % 2)


TRACK = {"now": 0, "max": 0}
OVERLAP = asyncio.Event()  # set once more than one group of Tracked runs at once
OVERLAP_WAIT_S = 20.0


async def test_bound_held_and_accounting_exact(tmp_path: Path) -> None:
    global OVERLAP
    OVERLAP = asyncio.Event()
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=16)
        envs = [(Tracked(), Tasks(arithmetic_task)), (Arithmetic(group_size=8, weight=2.0), Tasks(arithmetic_task))]
        runner = RolloutRunner(server.url, envs, ScriptedPolicy(arithmetic_script), max_in_flight=12)
        stats = await asyncio.wait_for(runner.run(max_groups=60), HANG_GUARD_S)
        assert 4 < TRACK["max"] <= 12 and stats.max_in_flight <= 12
        assert stats.produced == stats.accepted == 60 and stats.duplicates == 0 and not stats.skipped
        assert stats.accepted_by_env.keys() == {"tracked", "arithmetic"}
        served = drain(server.url)
        g0 = served[-1]["group_id"]
        st = status(server.url)
        dropped = sum(n for reasons in st["dropped"].values() for n in reasons.values())
        assert len(served) + st["queue_size"] + dropped == stats.accepted
        assert len({g["group_id"] for g in served}) == len(served)
        assert [p["producer_id"] for p in st["producers"]] == [runner.producer_id]  # its heartbeats' id, and
        with httpx.Client(base_url=server.url) as http:  # the ledger names it as the producer of its groups
            rows = http.get("/ledger/steps/0").json()["groups"] + http.get(f"/ledger/groups/{g0}").json()["groups"]
        assert rows and {r["producer_id"] for r in rows} == {runner.producer_id}
        g = served[0]
        assert all(
            len(t) == len(m) == len(lp)
            for t, m, lp in zip(g["tokens"], g["masks"], g["inference_logprobs"], strict=True)
        )


async def test_workers_survive_a_worker_death(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=16)
        env = Synthetic(group_size=4, steps=3, wait_s=0.03)
        runner = RolloutRunner(
            server.url,
            [(env, Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=16,
            num_workers=2,
        )
        run = asyncio.create_task(runner.run(max_groups=40))
        await until(lambda: runner.stats.accepted >= 5, "first groups")
        assert runner.pool is not None
        victim = runner.pool.pids[0]
        os.kill(victim, signal.SIGKILL)
        stats = await asyncio.wait_for(run, HANG_GUARD_S)
        assert stats.worker_deaths >= 1 and stats.accepted == 40 and stats.duplicates == 0
        assert runner.pool.workers == [], "every worker was stopped"
        served = drain(server.url)
        assert len(served) + status(server.url)["queue_size"] == 40
        assert len({g["group_id"] for g in served}) == len(served)


async def test_shutdown_under_load_on_a_full_queue(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "s.log", "--max-queue-groups", "5", "--retry-after", "1") as server:
        start_trainer(server.url, batch_size=64)
        env = Synthetic(group_size=4, steps=1, wait_s=0.01)
        runner = RolloutRunner(
            server.url,
            [(env, Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=16,
            timeouts=Timeouts(shutdown=0.5),
        )
        run = asyncio.create_task(runner.run())
        await until(lambda: runner.stats.paused.get(env.name) == QUEUE_FULL, "the runner to see the full queue")
        runner.stop()
        stats = await asyncio.wait_for(run, HANG_GUARD_S)
        assert status(server.url)["queue_size"] == stats.accepted == 5
        assert stats.in_flight == 0 and stats.dispatched == stats.produced + stats.skipped["stopped"]


class Recording(ScriptedPolicy):
    """Appends "start" and "end" around every generation request to a file (shared with worker processes)."""

    def __init__(self, log: Path) -> None:
        super().__init__(arithmetic_script)
        self.log = log

    def _mark(self, what: str) -> None:
        with self.log.open("a") as f:
            f.write(what + "\n")

    async def generate(self, prompt_ids: list[int], **kw: Any) -> Any:
        self._mark("start")
        await asyncio.sleep(0.005)
        out = await super().generate(prompt_ids, **kw)
        self._mark("end")
        return out


@pytest.mark.parametrize("workers", [0, 1])
async def test_pause_holds_every_request_and_resume_stamps_the_new_step(tmp_path: Path, workers: int) -> None:
    events = tmp_path / "events"
    events.touch()
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8, starting_step=3)
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(arithmetic_task))],
            Recording(events),
            max_in_flight=8,
            num_workers=workers,
        )
        run = asyncio.create_task(runner.run())
        await until(lambda: runner.stats.accepted >= 3, "first groups")
        assert runner.policy_step == 3, "starts at the trainer's step"
        await runner.pause()
        seen = events.read_text().split()
        assert seen.count("start") == seen.count("end"), "nothing in flight once pause() returns"
        for _ in range(20):  # give a slipping request every chance to start
            await asyncio.sleep(0.01)
        assert events.read_text().split() == seen, "no request started while paused"
        with httpx.Client(base_url=server.url) as http:  # the trainer takes batch 3 and trains: weights of step 4
            assert http.get("/batch").json()["batch"]
        await until(lambda: runner.stats.trainer_step == 4, "the runner to read the trainer's step")
        at_resume = runner.stats.accepted
        runner.resume()  # stamps the trainer's step
        assert runner.policy_step == 4
        # 8 groups of step 4: whole batches are drained below and what is left is under one batch (8
        # sequences), so some of them are in a drained batch however many groups of step 3 came first.
        await until(lambda: runner.stats.accepted >= at_resume + 8, "groups after resume")
        runner.stop()
        await asyncio.wait_for(run, HANG_GUARD_S)
        steps = {g["policy_step"] for g in drain(server.url)}
        assert steps <= {3, 4} and 4 in steps


async def test_stale_groups_cancelled_and_production_held_back(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=4)
        # Rollouts outlast the test's steps (they end by being cancelled): on a loaded machine the blocking
        # requests below took longer than a 0.3 s rollout, which then finished and was submitted, not stale.
        env = Synthetic(group_size=4, steps=1, wait_s=30.0)
        runner = RolloutRunner(
            server.url,
            [(env, Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            max_staleness=0,
            poll_interval=0.05,
        )
        run = asyncio.create_task(runner.run())
        await until(lambda: runner.stats.in_flight == 8, "rollouts in flight")
        with httpx.Client(base_url=server.url) as http:  # another producer lets the trainer move on two steps
            other = http.post(
                "/register-env", json={"max_token_length": 512, "desired_name": "other", "group_size": 4}
            ).json()["env_id"]
            for i in range(2):
                assert http.post("/scored_data", json=group(4, env_id=other, seed=i)).status_code == 200
                assert http.get("/batch").json()["batch"]
        await until(lambda: runner.stats.skipped["stale"] >= 2, "stale groups to be cancelled")
        await until(lambda: runner.stats.paused.get(env.name) == AHEAD, "the runner to hold back")
        runner.stop()
        stats = await asyncio.wait_for(run, HANG_GUARD_S)
        assert stats.accepted == 0, "nothing stale was submitted"


async def test_server_restart_mid_run_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'b.db'}"
    log = tmp_path / "s.log"
    server: ServerProcess = start_server(store, log)
    try:
        start_trainer(server.url, batch_size=16)
        env = Synthetic(group_size=4, steps=1, wait_s=0.02)
        runner = RolloutRunner(
            server.url, [(env, Tasks(arithmetic_task))], ScriptedPolicy(arithmetic_script), max_in_flight=16
        )
        run = asyncio.create_task(runner.run(max_groups=80))
        await until(lambda: runner.stats.accepted >= 15, "first groups")
        server.kill()  # SIGKILL mid-run
        server = start_server(store, log, server.port)
        stats = await asyncio.wait_for(run, HANG_GUARD_S)
        assert stats.accepted + stats.duplicates == 80 and not stats.skipped
        served = drain(server.url)
        ids = [g["group_id"] for g in served]
        assert len(ids) == len(set(ids)), "nothing stored twice"
        assert len(ids) + status(server.url)["queue_size"] == 80, "nothing lost"
    finally:
        server.kill()


ORPHAN_SCRIPT = """
import asyncio, sys
from rollout_client import RolloutRunner, ScriptedPolicy, Tasks
from rollout_client.examples import Synthetic, arithmetic_script, arithmetic_task

async def main():
    runner = RolloutRunner(sys.argv[1], [(Synthetic(group_size=4, wait_s=0.05), Tasks(arithmetic_task))],
                           ScriptedPolicy(arithmetic_script), max_in_flight=8, num_workers=1)
    run = asyncio.create_task(runner.run())
    while runner.stats.accepted < 2:
        await asyncio.sleep(0.02)
    print(*runner.pool.pids, flush=True)
    await run

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_no_worker_outlives_the_runner(tmp_path: Path, sig: int) -> None:
    """SIGTERM: the runner shuts down in order and exits 0. SIGKILL: its worker notices and exits by itself."""
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=16)
        proc = subprocess.Popen(
            [sys.executable, "-c", ORPHAN_SCRIPT, server.url],
            stdout=subprocess.PIPE,
            start_new_session=True,
            cwd=Path(__file__).parents[2],
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), HANG_GUARD_S)
            [worker] = [int(p) for p in line.split()]
            assert not exited(worker)
            os.kill(proc.pid, sig)  # the runner's process only, never its group
            code = await asyncio.to_thread(proc.wait, HANG_GUARD_S)
            assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
            await until(lambda: exited(worker), "the worker to exit")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


async def test_stop_while_waiting_for_the_trainer(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "s.log") as server:  # no trainer ever registers
        runner = RolloutRunner(server.url, [(Arithmetic(), Tasks(arithmetic_task))], ScriptedPolicy(arithmetic_script))
        run = asyncio.create_task(runner.run())
        await until(lambda: bool(runner.clients), "the runner to start registering")
        runner.stop()
        stats = await asyncio.wait_for(run, HANG_GUARD_S)
        assert stats.dispatched == 0 and not runner.ready.is_set()


def padded_task(i: int) -> Task:
    """Every third prompt is too long for a trainer with max_token_len 40 (byte-level tokens)."""
    task = arithmetic_task(i)
    return Task(task.id, task.prompt + " " * 60, task.answer) if i % 3 == 0 else task


async def test_prompts_over_the_token_budget_are_skipped_and_counted(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8, max_token_len=40)
        runner = RolloutRunner(
            server.url, [(Arithmetic(), Tasks(padded_task))], ScriptedPolicy(arithmetic_script), max_in_flight=8
        )
        stats = await asyncio.wait_for(runner.run(max_groups=30), HANG_GUARD_S)
        assert stats.skipped == {"prompt_too_long": 10} and stats.accepted == 20
        assert all(len(t) <= 40 for g in drain(server.url) for t in g["tokens"])


@dataclass
class Overflowing(Arithmetic):
    """Appends a long epilogue after the answer on tasks where `overflow(i)`: the group exceeds max_token_len."""

    name: str = "overflowing"
    every: int = 3

    async def rollout(self, task: Task, session: Session) -> None:
        await super().rollout(task, session)
        if int(task.id.rsplit("-", 1)[1]) % self.every == 0:
            session.observe_ids([32] * 60)  # past the budget: observe() would clip it, observe_ids() does not


async def test_rejected_groups_are_counted_and_a_run_of_them_ends_the_run(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8, max_token_len=40)
        runner = RolloutRunner(
            server.url, [(Overflowing(), Tasks(arithmetic_task))], ScriptedPolicy(arithmetic_script), max_in_flight=4
        )
        stats = await asyncio.wait_for(runner.run(max_groups=30), HANG_GUARD_S)
        assert stats.skipped == {"rejected": 10} and stats.accepted == 20

        always = RolloutRunner(
            server.url,
            [(Overflowing(every=1), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=4,
        )
        with pytest.raises(RunFailed, match="in a row rejected") as info:
            await asyncio.wait_for(always.run(), HANG_GUARD_S)
        assert isinstance(info.value.__cause__, Rejected) and "tokens" in str(info.value.__cause__)
        assert always.stats.accepted == 0 and always.stats.skipped["rejected"] >= 10
