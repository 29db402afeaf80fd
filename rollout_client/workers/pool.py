"""Worker processes: each runs groups on its own event loop, so CPU-heavy rollouts and scoring in one never
stall the others or the runner's loop. The runner feeds the least-busy worker.

Messages (pickled tuples over a `Channel`, which never blocks either event loop, whatever their size).
Parent to worker: ("run", job, env_index, task, group_key), ("run_one", job, env_index, task, group_key,
index, turns, prefix, mode) (one rollout of a group whose env scores each rollout alone; with `turns`, its
turns go to the parent, which posts them, continuing from `prefix` in `mode`: `rollout_client.workers.turns`
lists those messages), ("cancel", job), ("pause", token,
timeout), ("resume",), ("weights", version) (the weights its requests are served by from now on: the gate's
`weights`), ("stop",). Worker to parent: ("setup", env_index) as it starts entering that env's
`worker_setup` (the parent bounds it too: a setup that blocks the worker's event loop cannot time itself out),
("ready",) once its policy is built and its envs' `worker_setup` entered, ("fatal", exception) when they
cannot be (then it exits), ("acquired", job) once a
group whose env takes turns to acquire holds all its resources (`resources.Turns`: the next group's turn),
("ended", job) when one rollout of a group ends (its slot is free), ("done", job, GroupOutcome | Rollout),
("error", job, exception),
("dropped", job, reason), ("cancelled", job), ("paused", token, drained), ("inference", reachable) when its
policy's circuit breaker changes, ("retire", reason) when it must be replaced (`recycling.RecyclePolicy`: a
MemoryError, an RSS cap; the pool itself retires a worker once it placed `max_groups` groups on it). A worker
being replaced gets no new group; after a MemoryError it is killed at once (its groups run again elsewhere),
otherwise it finishes what it holds and stops. A worker exits on "stop" or when the channel closes, which is
also what happens when its parent dies: no orphans; either way it cancels its groups and exits its envs'
`worker_setup` (bounded by `release_timeout`) before it closes its policy. It ignores SIGINT and SIGTERM (a
Ctrl-C or a `kill` of the process group reaches the runner too, which stops its workers in order).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

from rollout_client.env import Environment, Task
from rollout_client.episodes import Prefix, Resumes, TurnSink
from rollout_client.errors import GroupDropped, SetupTimeout, WorkerDied
from rollout_client.group import GroupOutcome, Limits, Rollout
from rollout_client.workers.ipc import Channel, ChannelClosed
from rollout_client.workers.process import CANCEL_GRACE_S, PolicySpec, ignoring_stop_signals, worker_main
from rollout_client.workers.recycling import MAX_GROUPS, MEMORY_ERROR, RecyclePolicy
from rollout_client.workers.turns import REQUESTS, ProtocolError, TurnRelay

log = logging.getLogger("rollout_client.workers")

STOP_GRACE_S = 5.0
"""How long a stopping worker may take before it is killed (by its pid)."""
STARTUP_S = 60.0
"""How long the pool's start waits for its workers to build their policies."""
STARTUP_FAILURES = 3
"""Workers in a row that fail to start (their policy factory raises, a `worker_setup` times out) before the
pool gives up: the run ends with that error instead of spawning forever."""
SETUP_GRACE_S = 5.0
"""Past an env's `setup_timeout`, how long more (at most; the bound itself for bounds under it) the pool waits
for a worker entering its `worker_setup` to answer before it kills the worker: its own timeout fires first
unless the setup blocks its event loop."""


# ------------------------------------------------------------------------------------------- parent side


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    channel: Channel
    reader: asyncio.Task[None] | None = None
    jobs: dict[int, int] = field(default_factory=dict)
    """Job id -> rollouts of it still running (its group size, less the rollouts that ended; 1 for a rollout
    run on its own): how busy this worker is."""
    placed: int = 0
    """Groups (and rollouts run alone) placed on it: `RecyclePolicy.spent` retires it at `max_groups`."""
    retiring: str | None = None
    """Why it is being replaced (it gets no new group), or None."""
    fatal: BaseException | None = None
    """What it failed to start with (its policy factory's error)."""
    pausing: set[int] = field(default_factory=set)
    """Tokens of the pauses sent to it and not yet answered."""
    started: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once its policy is built (or it failed to start, or it exited)."""
    setup: asyncio.TimerHandle | None = None
    """While it enters an env's `worker_setup` with a bound: the watchdog that kills it past the env's
    `setup_timeout` and a grace."""

    @property
    def load(self) -> int:
        return sum(self.jobs.values())


def check_picklable(envs: Sequence[Environment], policy: PolicySpec) -> None:
    """Refuse, before any process starts, what cannot be sent to a worker, saying what to pass instead: the
    spawn's own error ("cannot pickle '_thread.RLock' object") named neither the object nor the fix."""
    for what, obj, fix in [
        *(
            (
                f"env {e.name!r}",
                e,
                "keep live clients and pools out of its attributes (build them in "
                "worker_setup), or run with num_workers=0",
            )
            for e in envs
        ),
        (
            "the policy",
            policy,
            "pass a zero-argument factory instead, e.g. functools.partial(OpenAIPolicy, ...): "
            "each worker builds its own",
        ),
    ]:
        try:
            pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - what pickle raises varies by object (TypeError, PicklingError...)
            raise TypeError(
                f"with num_workers > 0, {what} is sent to each worker process and must pickle, but it "
                f"does not ({exc}): {fix}"
            ) from exc


class WorkerPool:
    """`n` worker processes started with `spawn` (no inherited threads or event loop state)."""

    def __init__(
        self,
        n: int,
        envs: Sequence[Environment],
        policy: PolicySpec,
        limits: Limits,
        recycle: RecyclePolicy = RecyclePolicy(),  # noqa: B008 (frozen)
    ) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._args = (list(envs), policy, limits, recycle)
        self._recycle = recycle
        self._envs = list(envs)
        self._n = n
        self.workers: list[_Worker] = []
        self._futures: dict[int, asyncio.Future[Any]] = {}
        self._ended: dict[int, Callable[[], None]] = {}
        """Job id -> what to call as each of its rollouts ends."""
        self._acquired: dict[int, Callable[[], None]] = {}
        """Job id -> what to call once its group holds all its resources."""
        self._paused: dict[int, asyncio.Future[bool]] = {}
        self.turns = TurnRelay()
        """The turn posters of the rollouts whose turns their workers hand over."""
        self._ids = itertools.count()
        self.deaths = 0
        """Workers that exited on their own (and were replaced)."""
        self.spawned = 0
        """Worker processes started, replacements included."""
        self.exitcodes: list[int | None] = []
        """Exit codes of the workers that ended (0: stopped in order; negative: killed by that signal)."""
        self.paused = False
        self.weights: int | None = None
        """The weights version requests are served by (`Gate.weights`), sent to every worker as it changes and
        to each new one as it starts."""
        self.closing = False
        """Set when the run is stopping: a worker that exits now is not replaced."""
        self.recycled: Counter[str] = Counter()
        """Workers replaced on purpose, by reason (memory_error, max_groups, rss, stuck)."""
        self.unreachable: set[int] = set()
        """Pids of workers whose policy reports the inference server unreachable."""
        self.startup_failures = 0
        """Workers in a row that failed to start."""
        self.failed: WorkerDied | None = None
        """Set (its `__cause__` the factory's error) once STARTUP_FAILURES workers in a row failed to start."""
        self.on_change: Callable[[], None] = lambda: None
        """Called when the pool's state the runner acts on changes (reachability, a fatal failure)."""
        self._background: set[asyncio.Task[None]] = set()
        self._keys: dict[str, set[int]] = {}
        """Group key -> its job ids (one, or one per rollout), while they run."""
        self._placed: dict[str, list[_Worker]] = {}
        """Group key -> the workers it was placed on, until the runner forgets it (after its deadline)."""
        self._changed = asyncio.Event()
        """Set when a worker is added, or the pool fails or closes: what a group waiting for one waits on."""

    async def start(self, timeout: float = STARTUP_S) -> None:
        """Start the workers and wait (up to `timeout`) until each has built its policy: the first groups'
        deadlines do not pay for a worker's imports."""
        for _ in range(self._n):
            await self._spawn()
        waits = [asyncio.ensure_future(w.started.wait()) for w in self.workers]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=timeout)
            for t in pending:
                t.cancel()

    async def _spawn(self) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=worker_main, args=(child, *self._args), daemon=True, name="rollout-worker")
        with ignoring_stop_signals():  # inherited through exec: a worker still importing ignores them too
            proc.start()
        self.spawned += 1
        child.close()  # only the worker holds its end: its exit shows here as EOF
        channel = await Channel.open(parent.fileno())
        parent.close()
        if self.closing:  # the pool began closing meanwhile: this one is not needed
            channel.send(("stop",))
            await asyncio.to_thread(proc.join, STOP_GRACE_S)
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.join)
            self.exitcodes.append(proc.exitcode)
            await channel.aclose()
            return
        worker = _Worker(proc, channel)
        self.workers.append(worker)
        self._changed.set()
        worker.reader = asyncio.create_task(self._read(worker), name=f"rollout-worker-{proc.pid}")
        if self.weights is not None:
            channel.send(("weights", self.weights))
        if self.paused:  # a replacement started during a weight update starts paused too
            channel.send(("pause", next(self._ids), None))

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process.pid is not None]

    async def _read(self, worker: _Worker) -> None:
        while True:
            try:
                msg = await worker.channel.recv()
            except ChannelClosed:
                await self._died(worker)
                return
            self.heard(worker, msg)

    def heard(self, worker: _Worker, msg: Any) -> None:
        """One message from `worker`; one it cannot have sent by the protocol (a worker's bug, a corrupted
        stream) kills it: its channel closes, its jobs fail with WorkerDied and run again (a rollout that
        posted turns continues from them), and a new worker replaces it."""
        try:
            self._on_message(worker, msg)
        except (ProtocolError, LookupError, TypeError, ValueError) as exc:
            log.error("rollout worker pid %s sent %.200r (%s): killing it", worker.process.pid, msg, exc)
            self._kill(worker)

    def _on_message(self, worker: _Worker, msg: tuple[Any, ...]) -> None:
        if not isinstance(msg, tuple) or not msg:
            raise ProtocolError(f"a {type(msg).__name__}, not a message")
        kind = msg[0]
        if kind in REQUESTS:
            self.turns.handle(worker.jobs.__contains__, msg, worker.channel.send)
            return
        if kind == "setup":
            self._watch_setup(worker, msg[1])
            return
        if kind == "ready":
            self._watch_setup(worker, None)
            self.startup_failures = 0
            worker.started.set()
            return
        if kind == "fatal":
            self._watch_setup(worker, None)
            if worker.fatal is None:  # the watchdog's verdict, if it killed the worker first, stands
                worker.fatal = msg[1]
            worker.started.set()
            return
        if kind == "inference":
            pid = worker.process.pid or 0
            (self.unreachable.discard if msg[1] else self.unreachable.add)(pid)
            self.on_change()
            return
        if kind == "retire":
            self._in_background(self.retire(worker, msg[1], now=msg[1] == MEMORY_ERROR))
            return
        if kind == "paused":
            worker.pausing.discard(msg[1])
            fut = self._paused.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result(bool(msg[2]))
            return
        if kind == "acquired":
            if (acquired := self._acquired.pop(msg[1], None)) is not None:
                acquired()
            return
        if kind == "ended":
            if msg[1] in worker.jobs:
                worker.jobs[msg[1]] = max(0, worker.jobs[msg[1]] - 1)
            if (ended := self._ended.get(msg[1])) is not None:
                ended()
            return
        job = msg[1]
        worker.jobs.pop(job, None)
        if worker.retiring and not worker.jobs:
            self._stop_worker(worker)
        fut_o = self._futures.pop(job, None)
        if fut_o is None or fut_o.done():
            return
        if kind == "done":
            fut_o.set_result(msg[2])
        elif kind == "error":
            fut_o.set_exception(msg[2])
        elif kind == "dropped":
            fut_o.set_exception(GroupDropped(msg[2]))
        else:
            fut_o.cancel()

    def _watch_setup(self, worker: _Worker, env_index: int | None) -> None:
        """The worker begins entering env `env_index`'s `worker_setup` (None: it is done with them): bound it
        from here too. A setup that awaits forever meets its own `setup_timeout` in the worker, which reports
        it ("fatal"); one that blocks the worker's event loop (a synchronous call that never returns) cannot,
        so past the bound and a grace the worker is killed here, with a SetupTimeout naming the hook, the env,
        the worker, the bound and the setting, as its reason for not starting."""
        if worker.setup is not None:
            worker.setup.cancel()
            worker.setup = None
        if env_index is None or (bound := self._envs[env_index].setup_timeout) is None:
            return
        after = bound + min(SETUP_GRACE_S, bound)
        worker.setup = asyncio.get_running_loop().call_later(after, self._setup_overdue, worker, env_index, after)

    def _setup_overdue(self, worker: _Worker, env_index: int, waited: float) -> None:
        worker.setup = None
        if worker not in self.workers or worker.started.is_set():
            return
        env = self._envs[env_index]
        worker.fatal = SetupTimeout(
            f"worker_setup() of env {env.name!r} did not return within setup_timeout={env.setup_timeout} s in "
            f"rollout worker pid {worker.process.pid}, whose event loop then stopped answering for {waited:.1f} s "
            f"(a synchronous call in worker_setup() blocks it, so the worker's own timeout cannot cut it): the "
            f"worker was killed. Await the setup's I/O (or run a blocking call in a thread), or raise "
            f"{type(env).__name__}.setup_timeout if it needs longer"
        )
        self._kill(worker)  # its death is logged with this error, and counted as a start that failed

    def _in_background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _stop_worker(self, worker: _Worker) -> None:
        try:
            worker.channel.send(("stop",))
        except ChannelClosed:
            pass

    async def retire(self, worker: _Worker, reason: str, *, now: bool = False) -> None:
        """Replace `worker` (counted in `recycled[reason]`): it gets no new group; `now` kills it at once (its
        groups run again elsewhere), else it stops once its groups are done. A worker already being replaced
        (finishing its last groups) is killed when `now`: a MemoryError or a stuck group on it never answers."""
        if worker not in self.workers or self.closing:
            return
        if worker.retiring:
            if now:
                log.warning(
                    "killing rollout worker pid %s, being replaced (%s), at once (%s)",
                    worker.process.pid,
                    worker.retiring,
                    reason,
                )
                self._kill(worker)
            return
        worker.retiring = reason
        self.recycled[reason] += 1
        log.warning("replacing rollout worker pid %s (%s)", worker.process.pid, reason)
        if now:
            self._kill(worker)
        elif not worker.jobs:
            self._stop_worker(worker)
        await self._spawn()

    @staticmethod
    def _kill(worker: _Worker) -> None:
        if worker.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid, signal.SIGKILL)

    def placed(self, key: str) -> list[_Worker]:
        """The workers the group `key` (or one of its rollouts) was placed on, still running, until `forget`."""
        return [w for w in self._placed.get(key, []) if w in self.workers]

    def forget(self, key: str) -> None:
        self._placed.pop(key, None)

    async def _died(self, worker: _Worker) -> None:
        self._watch_setup(worker, None)
        if worker not in self.workers or self.closing:
            return  # close() stops, reaps and accounts for every worker it found
        self.workers.remove(worker)
        worker.started.set()
        self.unreachable.discard(worker.process.pid or 0)
        await worker.channel.aclose()
        await asyncio.to_thread(worker.process.join, 1.0)
        self.exitcodes.append(worker.process.exitcode)
        what = f"worker pid {worker.process.pid} exited ({worker.process.exitcode})"
        if worker.fatal is not None:
            what += f": it could not start: {type(worker.fatal).__name__}: {worker.fatal}"
        for job in worker.jobs:
            fut = self._futures.pop(job, None)
            if fut is not None and not fut.done():
                died = WorkerDied(what)
                died.__cause__ = worker.fatal
                fut.set_exception(died)
        for token in worker.pausing:  # its own pauses only: the others' workers still answer theirs
            fut_p = self._paused.pop(token, None)
            if fut_p is not None and not fut_p.done():
                fut_p.set_result(True)  # a dead worker generates nothing
        self.on_change()
        if self.closing or worker.retiring:
            return  # a retired worker's replacement is already started
        self.deaths += 1
        if worker.fatal is not None:
            self.startup_failures += 1
            if self.startup_failures >= STARTUP_FAILURES:
                self.failed = WorkerDied(f"{self.startup_failures} rollout workers in a row could not start: {what}")
                self.failed.__cause__ = worker.fatal
                self._changed.set()
                log.error("%s", self.failed)
                self.on_change()
                return
            log.error(
                "rollout worker pid %s could not start (%d of %d in a row end the run): %s: %s; starting a new one",
                worker.process.pid,
                self.startup_failures,
                STARTUP_FAILURES,
                type(worker.fatal).__name__,
                worker.fatal,
            )
        else:
            log.warning(
                "rollout worker pid %s died (exit %s); starting a new one", worker.process.pid, worker.process.exitcode
            )
        await self._spawn()

    async def run(
        self,
        env_index: int,
        task: Task,
        key: str,
        on_rollout_end: Callable[[], None] | None = None,
        on_acquired: Callable[[], None] | None = None,
    ) -> GroupOutcome:
        """Run one group on the least-busy worker; cancelling this cancels it in the worker. `on_rollout_end()`
        is called as each of its rollouts ends, `on_acquired()` once it holds all its resources (told only for
        an env that takes turns to acquire)."""
        outcome: GroupOutcome = await self._job(
            ("run", env_index, task, key), env_index, key, on_rollout_end, on_acquired
        )
        return outcome

    async def run_one(
        self,
        env_index: int,
        task: Task,
        key: str,
        index: int,
        *,
        turns: TurnSink | None = None,
        prefix: Prefix | None = None,
        mode: Resumes = "restart",
    ) -> Rollout:
        """Run rollout `index` of the group `key` on its own, on the least-busy worker (the env scores each
        rollout alone): a group's rollouts spread over the workers. With `turns`, the turns it ends are posted
        there (`rollout_client.workers.turns`); it continues from `prefix` in `mode`."""
        what = ("run_one", env_index, task, key, index, turns is not None, prefix, mode)
        rollout: Rollout = await self._job(what, env_index, key, None, turns=turns)
        return rollout

    async def _job(
        self,
        what: tuple[Any, ...],
        env_index: int,
        key: str,
        on_rollout_end: Callable[[], None] | None,
        on_acquired: Callable[[], None] | None = None,
        *,
        turns: TurnSink | None = None,
    ) -> Any:
        while not (ready := [w for w in self.workers if not (w.retiring or self._recycle.spent(w.placed))]):
            if self.failed is not None:
                raise self.failed
            if self.closing:
                raise WorkerDied("no rollout worker is running")
            self._changed.clear()  # one is being replaced: wait for it rather than fail the group
            await self._changed.wait()
        if self.failed is not None:
            raise self.failed
        worker = min(ready, key=lambda w: w.load)
        job = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            worker.channel.send((what[0], job, *what[1:]))  # pickles here: a task may not pickle
        except ChannelClosed:
            raise WorkerDied(f"worker pid {worker.process.pid} is gone") from None
        self._futures[job] = fut
        if turns is not None:
            self.turns.add(job, turns)
        worker.jobs[job] = self._envs[env_index].group_size if what[0] == "run" else 1
        self._keys.setdefault(key, set()).add(job)
        self._placed.setdefault(key, []).append(worker)
        worker.placed += 1
        if self._recycle.spent(worker.placed):  # it takes no more from now (above); its replacement starts
            self._in_background(self.retire(worker, MAX_GROUPS))
        if on_rollout_end is not None:
            self._ended[job] = on_rollout_end
        if on_acquired is not None:
            self._acquired[job] = on_acquired
        try:
            return await fut
        except asyncio.CancelledError:
            if job in worker.jobs and worker in self.workers:
                try:
                    worker.channel.send(("cancel", job))
                except ChannelClosed:
                    pass
            raise
        finally:
            self._futures.pop(job, None)
            self.turns.remove(job)
            self._ended.pop(job, None)
            self._acquired.pop(job, None)
            worker.jobs.pop(job, None)
            if (jobs := self._keys.get(key)) is not None:
                jobs.discard(job)
                if not jobs:
                    del self._keys[key]
            if worker.retiring and not worker.jobs and worker in self.workers:
                self._stop_worker(worker)

    async def pause(self, timeout: float | None = None) -> bool:
        """Returns once every worker has no generation request in flight and starts none. With `timeout`:
        past it, each worker cancels the groups still generating (they fail with GroupDropped) and this
        returns False within about `timeout` + CANCEL_GRACE_S, answered or not."""
        self.paused = True
        waits = []
        for w in self.workers:
            token = next(self._ids)
            fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._paused[token] = fut
            w.pausing.add(token)
            try:
                w.channel.send(("pause", token, timeout))
            except ChannelClosed:
                self._paused.pop(token, None)
                continue
            waits.append(fut)
        if not waits:
            return True
        if timeout is None:
            return all(await asyncio.gather(*waits))
        done, pending = await asyncio.wait(waits, timeout=timeout + CANCEL_GRACE_S + 1.0)
        for fut in pending:
            fut.cancel()
        return not pending and all(f.result() for f in done)

    def set_weights(self, version: int) -> None:
        """The weights version every worker's requests are served by from now on (sent before a resume)."""
        if version == self.weights:
            return
        self.weights = version
        for w in self.workers:
            try:
                w.channel.send(("weights", version))
            except ChannelClosed:
                pass

    def resume(self) -> None:
        self.paused = False
        for w in self.workers:
            try:
                w.channel.send(("resume",))
            except ChannelClosed:
                pass

    def kill(self) -> None:
        """Kill every worker by pid at once, without awaiting: the last resort of a shutdown that was itself
        cancelled (a worker ignores SIGTERM, so multiprocessing's exit hook would wait for it forever)."""
        self.closing = True
        for w in list(self.workers):
            self._watch_setup(w, None)
            if w.process.is_alive() and w.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.process.pid, signal.SIGKILL)
            w.process.join(1.0)
            self.exitcodes.append(w.process.exitcode)
            if w.reader is not None:
                w.reader.cancel()
            self.workers.remove(w)

    async def close(self, timeout: float = STOP_GRACE_S) -> None:
        """Stop every worker: ask, wait up to `timeout`, then kill by pid (workers ignore SIGTERM)."""
        self.closing = True
        self._changed.set()
        loop = asyncio.get_running_loop()
        for t in self._background:
            t.cancel()
        self.turns.close()
        workers = list(self.workers)
        for w in workers:
            self._watch_setup(w, None)
            try:
                w.channel.send(("stop",))
            except ChannelClosed:
                pass  # already gone
        deadline = loop.time() + timeout
        for w in workers:
            await asyncio.to_thread(w.process.join, max(0.0, deadline - loop.time()))
            if w.process.is_alive() and w.process.pid is not None:
                log.warning("rollout worker pid %s did not stop in %.1f s; killing it", w.process.pid, timeout)
                os.kill(w.process.pid, signal.SIGKILL)
                await asyncio.to_thread(w.process.join)
        for w in workers:
            self.exitcodes.append(w.process.exitcode)
            if w.reader is not None:
                w.reader.cancel()
            await w.channel.aclose()
            if w in self.workers:
                self.workers.remove(w)
