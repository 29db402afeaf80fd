"""`RolloutRunner`: turns environments into a steady, well-behaved producer for rollbuf.

Many groups run at once under a bound on in-flight rollouts (a group's G rollouts start together); with
`num_workers` they run in worker processes. The runner holds production back while the server's queue is
full or the trainer is too far behind, cancels groups that became too stale, pauses around weight updates,
and stops within a bounded time on SIGINT/SIGTERM or `stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import uuid
from collections import Counter
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from api.schema import EnvStatus
from rollout_client.client import RolloutClient
from rollout_client.env import Environment, Gate, Task
from rollout_client.errors import Rejected, RetriesExhausted
from rollout_client.group import GroupOutcome, run_group
from rollout_client.pacing import is_stale, pause_reason, pick_env
from rollout_client.tasks import TaskSource
from rollout_client.workers import PolicySpec, WorkerDied, WorkerPool, make_policy

log = logging.getLogger("rollout_client.runner")

POLL_S = 0.2
"""How often /status-env is read per env: backpressure reacts within this, at 5 cheap requests/s per env."""
SHUTDOWN_S = 10.0
"""Bound on `stop()`: groups still submitting after this are cancelled (their group ids keep a later retry
from storing them twice)."""
MAX_REJECTED_IN_A_ROW = 10
"""One rejected group (say, a transcript over max_token_len) is logged and counted; this many in a row mean
something systematic (the env or the run is misconfigured) and end the run with the server's verdict."""
WORKER_RETRIES = 3
"""A group whose worker died is run again on another worker this many times before the run fails."""


@dataclass
class RunnerStats:
    """What the runner did. `accepted` counts groups the server acknowledged and stored."""

    dispatched: int = 0
    produced: int = 0
    """Groups fully rolled out and scored."""
    accepted: int = 0
    duplicates: int = 0
    """Acknowledged as already stored (a retry of something the server had): never stored twice."""
    skipped: Counter[str] = field(default_factory=Counter)
    """Groups not submitted or not stored, by reason: prompt_too_long, stale, stopped, unsent, rejected."""
    accepted_by_env: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    """Rollouts running now."""
    max_in_flight: int = 0
    """Most rollouts that ever ran at once."""
    paused: dict[str, str] = field(default_factory=dict)
    """Env name -> why it is held back now (queue_full, ahead_of_trainer)."""
    trainer_step: int = 0
    policy_step: int = 0
    worker_deaths: int = 0
    mean_score: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class _InFlight:
    task: asyncio.Task[None]
    env: int
    size: int
    policy_step: int
    submitting: bool = False
    released: bool = False
    cancelled: bool = False


class RolloutRunner:
    """Run `envs` (each with its task source) against the rollbuf server at `base_url`.

    Use `await runner.run()` (until `stop()`, a signal or `max_groups`), with `pause()`/`resume()` around
    weight updates. `policy` is a Policy or a zero-argument factory; with `num_workers > 0` it must pickle
    (each worker builds its own from it), and so must the environments and tasks.
    """

    def __init__(
        self,
        base_url: str,
        envs: Sequence[tuple[Environment, TaskSource]],
        policy: PolicySpec,
        *,
        max_in_flight: int = 64,
        num_workers: int = 0,
        max_staleness: int | None = None,
        poll_interval: float = POLL_S,
        shutdown_timeout: float = SHUTDOWN_S,
        register_wait: float | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        if not envs:
            raise ValueError("envs: give at least one (environment, task source) pair")
        for env, _ in envs:
            if env.group_size > max_in_flight:
                raise ValueError(
                    f"max_in_flight {max_in_flight} < group_size {env.group_size} of {env.name!r}: "
                    "a group's rollouts run together, so it could never start"
                )
        self.base_url = base_url
        self.envs = [e for e, _ in envs]
        self.sources = [s for _, s in envs]
        self.policy_spec = policy
        self.max_in_flight = max_in_flight
        self.num_workers = num_workers
        self.max_staleness = max_staleness
        self.poll_interval = poll_interval
        self.shutdown_timeout = shutdown_timeout
        self.register_wait = register_wait
        self.client_options = client_options or {}
        self.stats = RunnerStats()
        self.clients: list[RolloutClient] = []
        self.pool: WorkerPool | None = None
        self.ready = asyncio.Event()
        """Set once every env is registered and workers are started."""
        self._policy_step: int | None = None
        self._gate = Gate()
        self._dispatch_open = asyncio.Event()
        self._dispatch_open.set()
        self._stopping = asyncio.Event()
        self._changed = asyncio.Event()
        self._free = max_in_flight
        self._groups: dict[str, _InFlight] = {}
        self._blocked: list[str | None] = [None] * len(self.envs)
        self._statuses: list[EnvStatus | None] = [None] * len(self.envs)
        self._acked_seqs = [0] * len(self.envs)
        """Sequences acknowledged per env so far; minus `_status_base`: acked since the last status read."""
        self._status_base = [0] * len(self.envs)
        self._exhausted = [False] * len(self.envs)
        self._credit = [0.0] * len(self.envs)
        self._scores: list[list[float]] = [[] for _ in self.envs]
        self._rejected_in_a_row = 0
        self._batch_size = 0
        self._token_limit: int | None = None
        self._policy: Any = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------------------------------- control

    @property
    def policy_step(self) -> int:
        """The step of the weights now generating; stamped on every group started from now on."""
        return self._policy_step or 0

    def stop(self) -> None:
        """Stop dispatching and shut down (returns at once; `run()` returns within `shutdown_timeout`).
        Safe to call from another thread or a signal handler."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._stopping.set()
            return
        loop.call_soon_threadsafe(self._stopping.set)
        loop.call_soon_threadsafe(self._changed.set)

    async def pause(self) -> None:
        """Stop new generation before a weight update. Returns once no generation request is in flight, in
        this process or any worker; none starts until `resume()`."""
        self._dispatch_open.clear()
        await self._gate.close()
        if self.pool is not None:
            await self.pool.pause()

    def resume(self, policy_step: int | None = None) -> None:
        """Restart generation with new weights: `policy_step` (default: the current one + 1) is stamped on what
        follows. Groups begun before stay stamped with their older step."""
        self._policy_step = self.policy_step + 1 if policy_step is None else policy_step
        self.stats.policy_step = self._policy_step
        if self.pool is not None:
            self.pool.resume()
        self._gate.open()
        self._dispatch_open.set()
        self._changed.set()

    # ------------------------------------------------------------------------------------------- run

    async def run(self, max_groups: int | None = None) -> RunnerStats:
        """Register, produce until `stop()` / SIGINT / SIGTERM / `max_groups` dispatched groups are done, shut
        down cleanly (workers stopped, envs disconnected) and return the stats. A group that raised ends the
        run: its error is re-raised after the shutdown."""
        self._loop = asyncio.get_running_loop()
        handled = self._install_signals()
        try:
            if await self._until_stopped(self._start()):
                monitor = asyncio.create_task(self._monitor())
                try:
                    await self._dispatch(max_groups)
                    if not self._stopping.is_set():
                        await self._until_stopped(self._wait_groups(None))
                finally:
                    monitor.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await monitor
            await self._shutdown()
        finally:
            for sig in handled:
                self._loop.remove_signal_handler(sig)
            await self._close_clients()
        if self._error is not None:
            raise self._error
        return self.stats

    async def _until_stopped(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Run `coro` unless `stop()` comes first (then cancel it): True if it finished."""
        work = asyncio.create_task(coro)
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait([work, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if work.cancelled():
            return False
        work.result()  # re-raise its error
        return True

    def _install_signals(self) -> list[int]:
        if threading.current_thread() is not threading.main_thread():
            return []
        assert self._loop is not None
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, self.stop)
        return [signal.SIGINT, signal.SIGTERM]

    async def _start(self) -> None:
        for env in self.envs:
            client = RolloutClient(self.base_url, **self.client_options)
            self.clients.append(client)
            reg = await client.register(
                env.name, env.group_size, weight=env.weight, min_batch_allocation=env.min_batch_allocation,
                wait_timeout=self.register_wait,
            )  # fmt: skip
            if self._policy_step is None:
                self._policy_step = reg.starting_step
        info = await self.clients[0].info()
        self._batch_size, self._token_limit = info.batch_size, info.max_token_len
        self.stats.policy_step = self.policy_step
        if self.num_workers > 0:
            self.pool = WorkerPool(self.num_workers, self.envs, self.policy_spec, self._token_limit)
            self.pool.start()
        else:
            self._policy = make_policy(self.policy_spec)
        self.ready.set()

    async def _close_clients(self) -> None:
        for client in self.clients:
            try:
                await client.disconnect()
            except RetriesExhausted as exc:
                log.warning("disconnecting env %s: %s", client.env_id, exc)
            finally:
                await client.aclose()

    # ------------------------------------------------------------------------------------------- dispatch

    async def _dispatch(self, max_groups: int | None) -> None:
        while not self._stopping.is_set() and (max_groups is None or self.stats.dispatched < max_groups):
            if not self._dispatch_open.is_set():
                await self._wait_change(self._dispatch_open.wait())
                continue
            self._refresh_blocked()
            eligible = [b is None and not x for b, x in zip(self._blocked, self._exhausted, strict=True)]
            sizes = [e.group_size for e in self.envs]
            credit = list(self._credit)  # committed only if the pick launches: a wait must not cost an env its turn
            i = pick_env(credit, [e.weight / e.group_size for e in self.envs], eligible)
            if i is None:
                if all(self._exhausted):
                    return
                await self._wait_change()
                continue
            if self._free < sizes[i]:
                await self._wait_change()
                continue
            task = self.sources[i].next_task()
            if task is None:
                self._exhausted[i] = True
                continue
            self._credit = credit
            self._launch(i, task)

    async def _wait_change(self, *also: Any) -> None:
        """Sleep until something the dispatcher depends on changes (a group ends, a status read, a signal)."""
        self._changed.clear()
        waits = [asyncio.ensure_future(self._changed.wait()), *(asyncio.ensure_future(a) for a in also)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _launch(self, i: int, task: Task) -> None:
        group_id = uuid.uuid4().hex
        size = self.envs[i].group_size
        self._free -= size
        self.stats.dispatched += 1
        self.stats.in_flight += size
        self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
        handle = asyncio.create_task(self._group(i, task, group_id, self.policy_step), name=f"group-{group_id}")
        self._groups[group_id] = _InFlight(handle, i, size, self.policy_step)

    async def _group(self, i: int, task: Task, group_id: str, step: int) -> None:
        env = self.envs[i]
        try:
            outcome = await self._execute(i, task, group_id)
            self._release(group_id)
            if outcome.group is None:
                self.stats.skipped[outcome.skipped or "skipped"] += 1
                return
            self.stats.produced += 1
            self._groups[group_id].submitting = True
            group = outcome.group.model_copy(update={"group_id": group_id, "policy_step": step})
            try:
                reply = await self.clients[i].submit(group)
            except RetriesExhausted as exc:
                log.warning("group %s of %s not submitted: %s", group_id, env.name, exc)
                self.stats.skipped["unsent"] += 1
                return
            except Rejected as exc:
                self._rejected_in_a_row += 1
                self.stats.skipped["rejected"] += 1
                log.error("group %s of %s rejected by the server: %s", group_id, env.name, exc)
                if self._rejected_in_a_row >= MAX_REJECTED_IN_A_ROW:
                    raise
                return
            self._rejected_in_a_row = 0
            self._acked_seqs[i] += len(group.tokens)
            if reply.duplicate:
                self.stats.duplicates += 1
            else:
                self.stats.accepted += 1
                self.stats.accepted_by_env[env.name] += 1
            mean = sum(group.scores) / len(group.scores)
            self._scores[i] = [*self._scores[i][-63:], mean]
            self.stats.mean_score[env.name] = sum(self._scores[i]) / len(self._scores[i])
            self.sources[i].report(task, mean)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # task boundary: the run stops and run() re-raises this error
            if self._error is None:
                self._error = exc
                log.error("group %s of %s failed: %s: %s; stopping", group_id, env.name, type(exc).__name__, exc)
            self._stopping.set()
        finally:
            self._release(group_id)
            self._groups.pop(group_id, None)
            self._changed.set()

    def _release(self, group_id: str) -> None:
        """Give back a group's rollout slots, once: when its rollouts end (before its submit)."""
        g = self._groups.get(group_id)
        if g is None or g.released:
            return
        g.released = True
        self._free += g.size
        self.stats.in_flight -= g.size
        self._changed.set()

    def _cancel(self, g: _InFlight, reason: str) -> None:
        if not g.cancelled:
            g.cancelled = True
            g.task.cancel()
            self.stats.skipped[reason] += 1

    async def _execute(self, i: int, task: Task, group_id: str) -> GroupOutcome:
        if self.pool is None:
            return await run_group(
                self.envs[i], task, self._policy, gate=self._gate, token_limit=self._token_limit, group_key=group_id
            )
        for attempt in range(WORKER_RETRIES + 1):
            try:
                return await self.pool.run(i, task, group_id)
            except WorkerDied:
                self.stats.worker_deaths = self.pool.deaths
                if attempt == WORKER_RETRIES:
                    raise
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------------- monitor

    async def _monitor(self) -> None:
        """Read every env's /status-env: hold back envs that should wait, cancel groups that became stale."""
        while True:
            base = list(self._acked_seqs)  # acks from here on may be missing from the statuses read now
            try:
                statuses: list[EnvStatus] = await asyncio.gather(*(c.status() for c in self.clients))
            except RetriesExhausted as exc:
                self._error = self._error or exc
                self.stop()
                return
            self._statuses, self._status_base = list(statuses), base
            self._refresh_blocked()
            trainer_step = max(st.current_step for st in statuses)
            self.stats.trainer_step = trainer_step
            for g in list(self._groups.values()):
                if not g.submitting and is_stale(g.policy_step, trainer_step, self.max_staleness):
                    self._cancel(g, "stale")
            self._changed.set()
            await asyncio.sleep(self.poll_interval)

    def _refresh_blocked(self) -> None:
        """Which envs must wait, from the last status read and what this runner has in flight now."""
        pending = [acked - base for acked, base in zip(self._acked_seqs, self._status_base, strict=True)]
        for g in self._groups.values():
            pending[g.env] += g.size
        for i, st in enumerate(self._statuses):
            if st is None:
                continue
            reason = pause_reason(
                st, batch_size=self._batch_size, group_size=self.envs[i].group_size, policy_step=self.policy_step,
                max_staleness=self.max_staleness, pending_seqs=pending[i],
            )  # fmt: skip
            self._blocked[i] = reason
            if reason is None:
                self.stats.paused.pop(self.envs[i].name, None)
            else:
                self.stats.paused[self.envs[i].name] = reason

    # ------------------------------------------------------------------------------------------- shutdown

    async def _wait_groups(self, timeout: float | None) -> None:
        tasks = [g.task for g in self._groups.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def _shutdown(self) -> None:
        """Cancel rollouts still generating (their data is not needed), let submits in progress finish within
        `shutdown_timeout`, cancel what is left, stop the workers."""
        for g in list(self._groups.values()):
            if not g.submitting:
                self._cancel(g, "stopped")
        await self._wait_groups(self.shutdown_timeout)
        for g in list(self._groups.values()):
            self._cancel(g, "unsent")
        await self._wait_groups(None)
        self._gate.open()
        if self.pool is not None:
            await self.pool.close()
