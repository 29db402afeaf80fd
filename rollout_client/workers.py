"""Worker processes: each runs groups on its own event loop, so CPU-heavy rollouts and scoring in one never
stall the others or the runner's loop. The runner feeds the least-busy worker.

Protocol over one pipe per worker (pickled tuples). Parent to worker: ("run", job, env_index, task,
group_key), ("cancel", job), ("pause", token), ("resume",), ("stop",). Worker to parent: ("done", job,
GroupOutcome), ("error", job, description), ("cancelled", job), ("paused", token). A worker exits on
"stop" or when the pipe closes, which is also what happens when its parent dies: no orphans.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from rollout_client.env import Environment, Gate, Task
from rollout_client.errors import RolloutClientError
from rollout_client.group import GroupOutcome, run_group
from rollout_client.policy import Policy

log = logging.getLogger("rollout_client.workers")

STOP_GRACE_S = 5.0
"""How long a stopping worker may take before it is terminated (by its pid)."""


class WorkerDied(RolloutClientError):
    """The worker running a group exited; the group was never submitted and can be run again."""


class WorkerFailed(RolloutClientError):
    """A group raised inside a worker; the message carries the worker's traceback."""


PolicySpec = Policy | Callable[[], Policy]


def make_policy(spec: PolicySpec) -> Policy:
    """A policy instance from an instance or a zero-argument factory (workers need something that pickles)."""
    return spec if hasattr(spec, "generate") else spec()  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------- worker side


def worker_main(conn: Connection, envs: Sequence[Environment], policy: PolicySpec, token_limit: int | None) -> None:
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the runner, which stops workers in order
    asyncio.run(_serve(conn, envs, make_policy(policy), token_limit))


async def _serve(conn: Connection, envs: Sequence[Environment], policy: Policy, token_limit: int | None) -> None:
    loop = asyncio.get_running_loop()
    gate = Gate()
    jobs: dict[int, asyncio.Task[None]] = {}
    done = asyncio.Event()

    def send(msg: tuple[Any, ...]) -> None:
        try:
            conn.send(msg)
        except (BrokenPipeError, OSError):
            done.set()  # the parent is gone

    async def run(job: int, env_index: int, task: Task, key: str) -> None:
        try:
            outcome = await run_group(envs[env_index], task, policy, gate=gate, token_limit=token_limit, group_key=key)
        except asyncio.CancelledError:
            send(("cancelled", job))
            raise
        except Exception as exc:  # process boundary: report to the parent, which re-raises it there
            send(("error", job, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        else:
            send(("done", job, outcome))
        finally:
            jobs.pop(job, None)

    async def pause(token: int) -> None:
        await gate.close()
        send(("paused", token))

    def on_readable() -> None:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            done.set()
            return
        kind = msg[0]
        if kind == "run":
            jobs[msg[1]] = loop.create_task(run(*msg[1:]))
        elif kind == "cancel" and msg[1] in jobs:
            jobs[msg[1]].cancel()
        elif kind == "pause":
            loop.create_task(pause(msg[1]))
        elif kind == "resume":
            gate.open()
        elif kind == "stop":
            done.set()

    loop.add_reader(conn.fileno(), on_readable)
    await done.wait()
    loop.remove_reader(conn.fileno())
    for t in list(jobs.values()):
        t.cancel()
    await asyncio.gather(*jobs.values(), return_exceptions=True)


# ------------------------------------------------------------------------------------------- parent side


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection
    jobs: dict[int, int] = field(default_factory=dict)
    """Job id -> rollouts it holds (its group size): how busy this worker is."""

    @property
    def load(self) -> int:
        return sum(self.jobs.values())


class WorkerPool:
    """`n` worker processes started with `spawn` (no inherited threads or event loop state)."""

    def __init__(self, n: int, envs: Sequence[Environment], policy: PolicySpec, token_limit: int | None) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._args = (list(envs), policy, token_limit)
        self._envs = list(envs)
        self._n = n
        self.workers: list[_Worker] = []
        self._futures: dict[int, asyncio.Future[GroupOutcome]] = {}
        self._paused: dict[int, asyncio.Future[None]] = {}
        self._ids = itertools.count()
        self.deaths = 0
        self.paused = False
        self._closing = False

    def start(self) -> None:
        for _ in range(self._n):
            self._spawn()

    def _spawn(self) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=worker_main, args=(child, *self._args), daemon=True, name="rollout-worker")
        proc.start()
        child.close()  # only the worker holds its end: its exit shows here as EOF
        worker = _Worker(proc, parent)
        self.workers.append(worker)
        asyncio.get_running_loop().add_reader(parent.fileno(), self._on_readable, worker)
        if self.paused:  # a replacement started during a weight update starts paused too
            parent.send(("pause", next(self._ids)))

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process.pid is not None]

    def _on_readable(self, worker: _Worker) -> None:
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            self._died(worker)
            return
        kind = msg[0]
        if kind == "paused":
            fut = self._paused.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result(None)
            return
        job = msg[1]
        worker.jobs.pop(job, None)
        fut_o = self._futures.pop(job, None)
        if fut_o is None or fut_o.done():
            return
        if kind == "done":
            fut_o.set_result(msg[2])
        elif kind == "error":
            fut_o.set_exception(WorkerFailed(msg[2]))
        else:
            fut_o.cancel()

    def _died(self, worker: _Worker) -> None:
        asyncio.get_running_loop().remove_reader(worker.conn.fileno())
        worker.conn.close()
        worker.process.join(timeout=1.0)
        self.workers.remove(worker)
        for job in worker.jobs:
            fut = self._futures.pop(job, None)
            if fut is not None and not fut.done():
                fut.set_exception(WorkerDied(f"worker pid {worker.process.pid} exited ({worker.process.exitcode})"))
        for token, fut_p in list(self._paused.items()):
            if not fut_p.done():
                fut_p.set_result(None)  # a dead worker generates nothing
            self._paused.pop(token, None)
        if not self._closing:
            self.deaths += 1
            log.warning("rollout worker pid %s died (exit %s); starting a new one", worker.process.pid,
                        worker.process.exitcode)  # fmt: skip
            self._spawn()

    async def run(self, env_index: int, task: Task, key: str) -> GroupOutcome:
        """Run one group on the least-busy worker; cancelling this cancels it in the worker."""
        worker = min(self.workers, key=lambda w: w.load)
        job = next(self._ids)
        fut: asyncio.Future[GroupOutcome] = asyncio.get_running_loop().create_future()
        self._futures[job] = fut
        worker.jobs[job] = self._envs[env_index].group_size
        worker.conn.send(("run", job, env_index, task, key))
        try:
            return await fut
        except asyncio.CancelledError:
            if job in worker.jobs and worker in self.workers:
                worker.conn.send(("cancel", job))
            raise

    async def pause(self) -> None:
        """Returns once every worker has no generation request in flight and starts none."""
        self.paused = True
        waits = []
        for w in self.workers:
            token = next(self._ids)
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._paused[token] = fut
            w.conn.send(("pause", token))
            waits.append(fut)
        await asyncio.gather(*waits)

    def resume(self) -> None:
        self.paused = False
        for w in self.workers:
            w.conn.send(("resume",))

    async def close(self, timeout: float = STOP_GRACE_S) -> None:
        """Stop every worker: ask, wait up to `timeout`, then terminate by pid."""
        self._closing = True
        loop = asyncio.get_running_loop()
        for w in list(self.workers):
            try:
                w.conn.send(("stop",))
            except OSError:
                pass  # already gone
        deadline = loop.time() + timeout
        for w in list(self.workers):
            await asyncio.to_thread(w.process.join, max(0.0, deadline - loop.time()))
            if w.process.is_alive():
                log.warning("rollout worker pid %s did not stop in %.1f s; terminating it", w.process.pid, timeout)
                w.process.terminate()
                await asyncio.to_thread(w.process.join, 2.0)
            if w.process.is_alive() and w.process.pid is not None:
                os.kill(w.process.pid, signal.SIGKILL)
                await asyncio.to_thread(w.process.join)
            if w in self.workers:
                loop.remove_reader(w.conn.fileno())
                w.conn.close()
                self.workers.remove(w)
