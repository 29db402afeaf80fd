"""`RolloutRunner`: turns environments into a steady, well-behaved producer for rollbuf.

Many groups run at once under a bound on in-flight rollouts (a group's G rollouts start together, and each
gives its slot back as it ends); with `num_workers` they run in worker processes, a group on one worker,
or, for an environment that scores each rollout alone, its rollouts spread over the workers. A group keeps
its survivors when `min_group_size` of its rollouts succeed; an environment's shared resource pool
(`max_resources`) admits only what fits whole, and "exhausted" answers are waited out with backoff.

The runner holds production back while the server's queue is full or the trainer is too far behind,
cancels groups that became too stale, pauses around weight updates, and stops within a bounded time on
SIGINT/SIGTERM or `stop()`. A group that fails (an environment's error, an inference error after retries, a
timeout, too few survivors) is dropped and counted; the run ends, with `RunFailed`, only when failures pass
the error rate the user allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

from api.schema import EnvRegistered, EnvStatus, Info
from rollout_client.backpressure import Backpressure
from rollout_client.breaker import Breaker
from rollout_client.client import RolloutClient
from rollout_client.env import Environment, Gate, Task, enter_worker_setup
from rollout_client.errors import (
    GroupDropped,
    Rejected,
    RetriesExhausted,
    RolloutClientError,
    RunFailed,
    failure_reason,
)
from rollout_client.execution import Execution, spread_hint
from rollout_client.failures import (
    ERROR_WINDOW,
    MAX_ERROR_RATE,
    QUARANTINE_AFTER,
    Failed,
    FailurePolicy,
    Refused,
    Stored,
)
from rollout_client.following import Beats, Follower, producer_id
from rollout_client.group import (
    RELEASE_S,
    Limits,
    bounded_close,
    exited,
    failures_of,
)
from rollout_client.inflight import Group, InFlight
from rollout_client.leased_tasks import lease_token
from rollout_client.lifecycle import disconnect_all, stop_on_signals, unless_stopped
from rollout_client.pacing import pick_env
from rollout_client.recycling import RecyclePolicy
from rollout_client.registration import Registrations, register
from rollout_client.resources import Capacity
from rollout_client.stats import RunnerStats
from rollout_client.tasks import TaskSource, next_task
from rollout_client.watching import Watching
from rollout_client.worker_process import CANCEL_GRACE_S, PAUSE_TIMEOUT, PolicySpec, close_policy, make_policy
from rollout_client.workers import WorkerPool

log = logging.getLogger("rollout_client.runner")

POLL_S = 0.2
"""How often /status-env is read per env: backpressure reacts within this, at 5 cheap requests/s per env."""
SHUTDOWN_S = 10.0
"""Bound on `stop()`: groups still submitting after this are cancelled (their group ids keep a later retry
from storing them twice)."""
STEP_READ_S = 2.0
"""Bound on the trainer-step read at the end of `pause()`."""
TURN_TIMEOUT_S = 600.0
"""Default bound on one generation request (retries included), time paused excluded."""
ROLLOUT_TIMEOUT_S = 1800.0
"""Default bound on one rollout (all its turns and tools), time paused excluded."""
QUARANTINED_IN_A_ROW = 1000
"""A source that hands out only quarantined tasks this many times in a row is treated as exhausted."""
GROUP_TIMEOUT_S = 3600.0
"""Default bound on one whole group: its rollouts, scoring and resource release, time paused excluded. Past
it the group fails (`group_timeout`); a worker running it is replaced (it may hold a verifier that never
returns)."""
PAUSE_S = 60.0
"""Default bound on `pause()`: an inference server that hangs must not stall a weight sync forever."""
INFERENCE_OUTAGE_S = 600.0
"""An inference server unreachable this long (the circuit breaker open) ends the run."""
STALL_WARN_S = 60.0
"""With `max_staleness`: held back `ahead_of_trainer` this long without a `resume()` is reported (a log line
every this often, and `health().stalled`): the runner waits for `resume()` to learn of new weights."""


def check_env(env: Environment, max_in_flight: int) -> None:
    """Settings of `env` that could never run, as a ValueError naming them."""
    if env.group_size > max_in_flight:
        raise ValueError(
            f"max_in_flight {max_in_flight} < group_size {env.group_size} of {env.name!r}: "
            "a group's rollouts start together, so it could never start"
        )
    if env.min_group_size is not None and not 1 <= env.min_group_size <= env.group_size:
        raise ValueError(f"min_group_size of {env.name!r} must be between 1 and group_size {env.group_size}")
    if env.max_resources is not None:
        least = 1 if env.scores_each_rollout else env.group_size
        if env.max_resources < least:
            why = "a group's rollouts hold theirs together" if least > 1 else "a rollout holds one"
            raise ValueError(f"max_resources {env.max_resources} of {env.name!r} < {least}: {why}, so it could "
                             "never start")  # fmt: skip


class RolloutRunner(Watching, Execution):
    """Run `envs` (each with its task source) against the rollbuf server at `base_url`.

    Use `await runner.run()` (until `stop()`, a signal or `max_groups`), with `pause()`/`resume()` around
    weight updates; or `rollout_client.handle.run_in_thread(runner)` for a blocking handle from synchronous
    code. `policy` is a Policy or a zero-argument factory; with `num_workers > 0` it must pickle (each worker
    builds its own from it), and so must the environments and tasks.
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
        turn_timeout: float | None = TURN_TIMEOUT_S,
        rollout_timeout: float | None = ROLLOUT_TIMEOUT_S,
        max_error_rate: float | None = MAX_ERROR_RATE,
        error_window: int = ERROR_WINDOW,
        quarantine_after: int | None = QUARANTINE_AFTER,
        group_timeout: float | None = GROUP_TIMEOUT_S,
        release_timeout: float | None = RELEASE_S,
        pause_timeout: float = PAUSE_S,
        inference_outage_timeout: float | None = INFERENCE_OUTAGE_S,
        stall_warning: float | None = STALL_WARN_S,
        recycle_after_groups: int | None = None,
        max_worker_rss_bytes: int | None = None,
    ) -> None:
        if not envs:
            raise ValueError("envs: give at least one (environment, task source) pair")
        for env, _ in envs:
            check_env(env, max_in_flight)
            if (hint := spread_hint(env, max_in_flight, num_workers)) is not None:
                log.warning("%s", hint)
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
        self.limits = Limits(None, turn_timeout, rollout_timeout, release_timeout)
        """What bounds a group's rollouts; the token limit is the server's, read when the run starts."""
        self.group_timeout = group_timeout
        self.pause_timeout = pause_timeout
        self.inference_outage_timeout = inference_outage_timeout
        self.stall_warning = stall_warning
        self.recycle = RecyclePolicy(recycle_after_groups, max_worker_rss_bytes)
        self.failures = FailurePolicy(
            max_error_rate=max_error_rate, error_window=error_window, quarantine_after=quarantine_after
        )
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
        self._in_flight = InFlight(max_in_flight, self.stats)
        self._backpressure = Backpressure([e.group_size for e in self.envs], max_staleness)
        self._capacity = [Capacity(e.max_resources) for e in self.envs]
        """Per env: its shared pool's units (`max_resources`), over every worker."""
        self._shared = contextlib.AsyncExitStack()
        """The envs' `worker_setup`, entered in this process when there are no workers."""
        self._exhausted = [False] * len(self.envs)
        self._credit = [0.0] * len(self.envs)
        self._scores: list[list[float]] = [[] for _ in self.envs]
        self._policy: Any = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._inference = Breaker()
        """Reachability of the inference server, over every policy (this process's, the workers')."""
        self._policy_down = False
        self._registrations = Registrations(self.envs, self.clients, register_wait, self._registered_again)
        self._held_since: float | None = None
        self._stall_logged: float | None = None
        self._resumed = False
        self._follow = Follower(self.envs)
        """The weights the trainer announces, followed (`rollout_client.following`)."""
        self._beat_now = asyncio.Event()
        self._drained_for: int | None = None
        self.producer_id = producer_id()
        """This run's id as a producer: its heartbeats carry it, and so does every group it submits (the ledger
        names the producer of each group)."""

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
        loop.call_soon_threadsafe(self._on_stop)

    def _on_stop(self) -> None:
        self._stopping.set()
        self._changed.set()
        if self.pool is not None:
            self.pool.closing = True  # a worker that exits from now on is not replaced

    async def pause(self, timeout: float | None = None) -> bool:
        """Stop new generation before a weight update. Returns once no generation request is in flight, in
        this process or any worker; none starts until `resume()`.

        It returns within about `timeout` s (default: the runner's `pause_timeout`, 60 s; `math.inf` waits as
        long as the requests take) whatever the inference server does: groups whose requests are still in
        flight then are cancelled, dropped and counted as `skipped["pause_timeout"]`, and it returns False
        (True when everything stopped in time). It then reads the trainer's step (within 2 s), for
        `resume()` to stamp."""
        if timeout is None:
            timeout = self.pause_timeout
        timeout = None if math.isinf(timeout) else timeout
        self._dispatch_open.clear()
        self._hold_deadlines()

        async def here() -> bool:
            if await self._gate.close(timeout):
                return True
            holders = self._gate.holders()
            for g in self._in_flight:
                if g.task in holders:
                    self._in_flight.cancel(g, PAUSE_TIMEOUT)
            await self._gate.close(CANCEL_GRACE_S)
            return False

        if self.pool is None:
            drained = await here()
        else:
            # A worker reports the groups it dropped before it answers the pause, so they are counted (their
            # tasks woken first) by the time this returns.
            drained = all(await asyncio.gather(here(), self.pool.pause(timeout)))
        await self._read_trainer_step()
        return drained

    async def _read_trainer_step(self) -> None:
        """Read the trainer's step now (bounded, best effort), so that a `resume()` right after a pause stamps
        the step the trainer reached while it paused, not one read up to `poll_interval` ago."""
        registered = [c for c in self.clients if c.env_id is not None]
        if not registered:
            return
        try:
            st = await asyncio.wait_for(registered[0].status(), STEP_READ_S)
        except (TimeoutError, RolloutClientError) as exc:
            log.info("reading the trainer's step at pause: %s", exc)
            return
        self.stats.trainer_step = max(self.stats.trainer_step, st.current_step)

    @property
    def paused(self) -> bool:
        return not self._gate.is_open

    def resume(self, policy_step: int | None = None) -> None:
        """Restart generation with new weights. `policy_step` is stamped on what follows; by default the
        trainer's step as last read (at most `poll_interval` old), never lower than the current one: the
        weights a trainer loads are those of its current step, however many steps it takes between syncs.
        Groups begun before stay stamped with their older step."""
        if policy_step is None:
            announced = self._follow.weights_step
            policy_step = max(self.policy_step, self.stats.trainer_step if announced is None else announced)
        self._resumed = True
        self._release_deadlines()
        self._policy_step = policy_step
        self.stats.policy_step = self._policy_step
        if self.pool is not None:
            self.pool.resume()
        self._gate.open()
        self._dispatch_open.set()
        self._changed.set()

    # ------------------------------------------------------------------------------------------- run

    async def run(self, max_groups: int | None = None) -> RunnerStats:
        """Register, produce until `stop()` / SIGINT / SIGTERM / `max_groups` dispatched groups are done, shut
        down within `shutdown_timeout` (workers stopped, envs disconnected) and return the stats.

        Raises RunFailed, after the shutdown, when failures passed `max_error_rate`, ten groups in a row were
        rejected by the server, or the server stayed unreachable; its `__cause__` is the original error."""
        self._loop = asyncio.get_running_loop()
        self._running = True
        handled = stop_on_signals(self._loop, self.stop)
        deadline: float | None = None
        cancelled = False
        try:
            try:
                if await unless_stopped(self._stopping, self._start()):
                    monitor = asyncio.create_task(self._monitor())
                    try:
                        await self._dispatch(max_groups)
                        if not self._stopping.is_set():
                            await unless_stopped(self._stopping, self._in_flight.wait(None))
                    finally:
                        monitor.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await monitor
            except Exception as exc:  # whatever ends the run ends it through RunFailed and the shutdown
                self._end(f"the runner failed: {type(exc).__name__}", exc)
            except asyncio.CancelledError:  # wait_for(run(), T), a TaskGroup ended by an error beside it:
                cancelled = True  # the same bounded shutdown, then the cancellation goes on
                if (me := asyncio.current_task()) is not None:
                    me.uncancel()  # the shutdown's own timeouts must not read as this cancellation
                self._on_stop()
            deadline = self._loop.time() + self.shutdown_timeout
            await self._shutdown(deadline)
        finally:
            if self.pool is not None and self.pool.workers:  # the shutdown itself was cancelled: no orphan
                self.pool.kill()
            for sig in handled:
                self._loop.remove_signal_handler(sig)
            if deadline is None:
                deadline = self._loop.time() + self.shutdown_timeout
            await disconnect_all(self.clients, deadline)
            self._running = False
        if cancelled:
            raise asyncio.CancelledError
        if self._error is not None:
            raise self._error
        return self.stats

    async def _start(self) -> None:
        for env in self.envs:
            client = RolloutClient(self.base_url, **self.client_options)
            self.clients.append(client)
            reg = await register(client, env, self.register_wait)
            if self._policy_step is None:
                self._policy_step = reg.starting_step
        info = await self.clients[0].info()
        self._backpressure.batch_size = info.batch_size
        self.limits = dataclasses.replace(self.limits, token_limit=info.max_token_len)
        self.stats.policy_step = self.policy_step
        if self.num_workers > 0:
            self.pool = WorkerPool(self.num_workers, self.envs, self.policy_spec, self.limits, self.recycle)
            self.pool.on_change = self._pool_changed
            if self._stopping.is_set():
                self.pool.closing = True
            await self.pool.start()
            self.stats.workers_alive = len(self.pool.workers)
        else:
            self._policy = make_policy(self.policy_spec)
            for env in self.envs:  # what this process's rollouts share, as a worker would set it up
                await enter_worker_setup(self._shared, env)
            if hasattr(self._policy, "on_reachability"):  # OpenAIPolicy's circuit breaker

                def changed(up: bool) -> None:
                    self._policy_down = not up
                    self._reachability()

                self._policy.on_reachability = changed
        self.ready.set()

    # ------------------------------------------------------------------------------------------- supervision

    def _pool_changed(self) -> None:
        assert self.pool is not None
        if self.pool.failed is not None:
            self._end("rollout workers cannot start", self.pool.failed)
        self._reachability()

    def _reachability(self) -> None:
        """One circuit breaker over every policy: open while any says the inference server is unreachable.
        Dispatch holds while it is open; one outage is counted once, however many groups it touched."""
        down = self._policy_down or (self.pool is not None and bool(self.pool.unreachable))
        now = time.monotonic()
        changed = self._inference.failure(now) if down else self._inference.success(now)
        self.stats.inference_reachable = self._inference.closed
        self.stats.inference_outages = self._inference.outages
        if changed:
            self._changed.set()

    def _hold_deadlines(self) -> None:
        """A pause stops the groups' deadlines (a weight sync is not the group's time)."""
        if self._loop is None:
            return
        now = self._loop.time()
        for g in self._in_flight:
            if g.deadline is not None and (when := g.deadline.when()) is not None:
                g.remaining = max(0.0, when - now)
                g.deadline.reschedule(None)

    def _release_deadlines(self) -> None:
        if self._loop is None:
            return
        now = self._loop.time()
        for g in self._in_flight:
            if g.deadline is not None and g.remaining is not None:
                g.deadline.reschedule(now + g.remaining)
                g.remaining = None

    def _registered_again(self, reg: EnvRegistered, info: Info) -> None:
        """An env registered again: the weights generating from now on are stamped with the new run's step."""
        self.stats.reregistered = self._registrations.reregistered
        self._follow.weights_step = None  # a new run announces its own weights
        self._policy_step = reg.starting_step
        self.stats.policy_step = reg.starting_step
        self._backpressure.batch_size = info.batch_size
        self._changed.set()

    # ------------------------------------------------------------------------------------------- dispatch

    async def _dispatch(self, max_groups: int | None) -> None:
        quarantined_in_a_row = [0] * len(self.envs)
        while not self._stopping.is_set() and (max_groups is None or self.stats.dispatched < max_groups):
            if not self._dispatch_open.is_set():
                await self._wait_change(self._dispatch_open.wait())
                continue
            if not self._inference.closed:  # new groups would only fail: wait for the server
                await self._wait_change()
                continue
            self._refresh_blocked()
            eligible = [
                b is None and not x and not self._follow.holds(i)
                for i, (b, x) in enumerate(zip(self._backpressure.held, self._exhausted, strict=True))
            ]
            sizes = [e.group_size for e in self.envs]
            credit = list(self._credit)  # committed only if the pick launches: a wait must not cost an env its turn
            i = pick_env(credit, [e.weight / e.group_size for e in self.envs], eligible)
            if i is None:
                if all(self._exhausted):
                    return
                await self._wait_change()
                continue
            if self._in_flight.free < sizes[i] or not self._capacity[i].fits(self._need(i)):
                await self._wait_change()
                continue
            task = self._follow.restart(i) or await self._next_task(i)
            if task is None:
                self._exhausted[i] = True
                continue
            if self.failures.is_quarantined(i, task.id):
                self.stats.skipped["quarantined"] += 1
                self._discard(i, task)
                quarantined_in_a_row[i] += 1
                if quarantined_in_a_row[i] >= QUARANTINED_IN_A_ROW:
                    log.error("env %s: its task source hands out only quarantined tasks; no more from it",
                              self.envs[i].name)  # fmt: skip
                    self._exhausted[i] = True
                await asyncio.sleep(0)
                continue
            quarantined_in_a_row[i] = 0
            self._credit = credit
            self._launch(i, task)

    async def _next_task(self, i: int) -> Task | None:
        """Env `i`'s next task; a source that waits on a server (`anext_task`) is left when the run stops."""
        if getattr(self.sources[i], "anext_task", None) is None:
            return self.sources[i].next_task()
        getter = asyncio.ensure_future(next_task(self.sources[i]))
        await self._wait_change_or(getter, self._stopping.wait())
        if getter.done():
            return getter.result()
        getter.cancel()
        return None

    async def _wait_change_or(self, *waits: Any) -> None:
        futures = [asyncio.ensure_future(w) for w in waits]
        try:
            await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in futures[1:]:
                f.cancel()

    async def _wait_change(self, *also: Any) -> None:
        """Sleep until something the dispatcher depends on changes (a group ends, a status read, a signal)."""
        self._changed.clear()
        waits = [asyncio.ensure_future(self._changed.wait()), *(asyncio.ensure_future(a) for a in also)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _need(self, i: int) -> int:
        """Units of env `i`'s pool a group takes when it starts: all G when its rollouts run together (a group
        that held part of the pool and waited for the rest could deadlock with another); none when they run
        one by one (each takes its own as it starts)."""
        return 0 if self.envs[i].scores_each_rollout else self.envs[i].group_size

    def _launch(self, i: int, task: Task) -> None:
        group_id = lease_token(task) or uuid.uuid4().hex  # a leased task's group is its lease's submission
        taken = self._need(i)
        self._capacity[i].try_take(taken)  # fits: checked just before, nothing awaited since
        handle = asyncio.create_task(self._group(i, task, group_id, self.policy_step, taken), name=f"group-{group_id}")
        self._in_flight.add(group_id, Group(handle, i, self.envs[i].group_size, self.policy_step))
        self._follow.launched(group_id, i, task)

    def _rollout_ended(self, group_id: str) -> None:
        """One rollout of the group ended: its slot is free for the next group."""
        if self._in_flight.ended(group_id):
            self._changed.set()

    async def _group(self, i: int, task: Task, group_id: str, step: int, taken: int = 0) -> None:
        env = self.envs[i]
        reported = False
        try:
            try:
                try:
                    outcome = await self._execute(i, task, group_id)
                finally:
                    if taken:
                        self._capacity[i].give(taken)
            except GroupDropped as exc:
                self.stats.skipped[exc.reason] += 1
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a group boundary: the group fails, the run goes on (unless too many do)
                self._failed(i, task, group_id, exc)
                return
            except BaseException as exc:  # exit() in env code: the group fails; a real Ctrl-C is a signal
                self._failed(i, task, group_id, exited(exc))
                return
            self.stats.release_timeouts += outcome.release_timeouts
            self._release(group_id)
            self._rollouts_failed(i, outcome.rollout_failures)
            if outcome.group is None:
                self.stats.skipped[outcome.skipped or "skipped"] += 1
                return
            self.stats.produced += 1
            if len(outcome.group.tokens) < env.group_size:
                self.stats.partial_groups += 1
            self._in_flight.groups[group_id].submitting = True
            update = {"group_id": group_id, "policy_step": step, "producer_id": self.producer_id}
            group = outcome.group.model_copy(update=update)
            group = self._follow.stamp(group_id, group, step)
            try:
                reply = await self._registrations.submit(i, group)
            except RetriesExhausted as exc:
                log.warning("group %s of %s not submitted: %s", group_id, env.name, exc)
                self.stats.skipped["unsent"] += 1
                return
            except Rejected as exc:
                self.stats.skipped["rejected"] += 1
                log.error("group %s of %s rejected by the server: %s", group_id, env.name, exc)
                if stop := self.failures.record(Refused()).stop:
                    self._end(stop, exc)
                return
            self.failures.record(Stored(i, task.id))
            self.stats.error_rate = self.failures.error_rate
            self._backpressure.acked(i, len(group.tokens))
            if reply.duplicate:
                self.stats.duplicates += 1
            else:
                self.stats.accepted += 1
                self.stats.accepted_by_env[env.name] += 1
            mean = sum(group.scores) / len(group.scores)
            self._scores[i] = [*self._scores[i][-63:], mean]
            self.stats.mean_score[env.name] = sum(self._scores[i]) / len(self._scores[i])
            self.sources[i].report(task, mean)
            reported = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the runner's own bookkeeping failed (a task source's report...): end the run
            self._end(f"group {group_id} of {env.name}: the runner failed", exc)
        finally:
            if not self._follow.ended(group_id) and not reported:  # a restarted task runs again: not discarded
                self._discard(i, task)
            self._in_flight.remove(group_id)
            self._changed.set()

    # ------------------------------------------------------------------------------------------- failures

    def _failed(self, i: int, task: Task, group_id: str, exc: BaseException) -> None:
        """Count a failed group, quarantine its task if it keeps failing, end the run past the error rate."""
        env = self.envs[i].name
        reason = failure_reason(exc)
        self._rollouts_failed(i, failures_of(exc))
        self.stats.failed[env][reason] += 1
        self.stats.last_error[env] = f"{type(exc).__name__}: {exc}"
        log.warning("group %s of %s failed (%s): %s: %s", group_id, env, reason, type(exc).__name__, exc)
        if reason == "inference_unreachable":
            return  # the outage is counted once (inference_outages); neither the task nor the rate is to blame
        verdict = self.failures.record(Failed(i, task.id))
        self.stats.error_rate = self.failures.error_rate
        if verdict.quarantined:
            self.stats.quarantined[env].add(task.id)
            log.error("task %s of %s failed %d times in a row: quarantined", task.id, env, verdict.failures)
        if verdict.stop is not None:
            self._end(f"{verdict.stop}; failed so far: {self._failed_counts()}", exc)

    def _rollouts_failed(self, i: int, failures: dict[str, int]) -> None:
        for reason, n in failures.items():
            self.stats.rollouts_failed[self.envs[i].name][reason] += n

    def _failed_counts(self) -> dict[str, dict[str, int]]:
        return {env: dict(c) for env, c in self.stats.failed.items()}

    def _end(self, reason: str, exc: BaseException | None) -> None:
        """End the run with RunFailed (the first cause wins), after the usual shutdown."""
        if self._error is None:
            error = RunFailed(reason, exc, self._failed_counts())
            error.__cause__ = exc
            self._error = error
            log.error("ending the run: %s", error)
        self._stopping.set()
        self._changed.set()

    def _discard(self, i: int, task: Task) -> None:
        """Tell a task source that wants to know that `task` will never be reported (skipped, failed...)."""
        discard = getattr(self.sources[i], "discard", None)
        if discard is not None:
            discard(task)

    def _release(self, group_id: str) -> None:
        """Give back a group's rollout slots when its rollouts end (before its submit): a group may start."""
        if self._in_flight.release(group_id):
            self._changed.set()

    # ------------------------------------------------------------------------------------------- monitor

    async def _monitor(self) -> None:
        """Read every env's /status-env: hold back envs that should wait, cancel groups that became stale; and
        heartbeat meanwhile."""
        beats = Beats(self.clients, [e.name for e in self.envs], self.stats, lambda: self.policy_step,
                      lambda: (self._follow.drains, self._drained_for), self._beat_now, self.producer_id)  # fmt: skip
        beating = asyncio.create_task(beats.run())
        try:
            await self._watch()
        except RetriesExhausted as exc:
            self._end("the rollbuf server stayed unreachable", exc)
        except Exception as exc:  # never a bare error out of run(), never a skipped shutdown
            self._end(f"the runner's monitor failed: {type(exc).__name__}", exc)
        finally:
            beating.cancel()

    def _weights_observed(self, statuses: Sequence[EnvStatus]) -> None:
        """New weights announced: stamped on the groups started from now on (groups in flight meet them by their
        env's `on_new_weights`), and what `max_staleness` is judged against."""
        step = self._follow.observed(statuses, self._in_flight)
        if step is not None and (self._policy_step is None or step > self._policy_step):
            self._policy_step = step
            self.stats.policy_step = step
            self._resumed = True
            self._changed.set()

    def _drained_now(self) -> None:
        """Drained for a pending sync (or no longer): heartbeat at once, the trainer waits for it."""
        drained = self._follow.drained_for(self._in_flight)
        if drained != self._drained_for:
            self._drained_for = drained
            self._beat_now.set()
            if drained is not None:
                log.info("drained for the weight sync to step %d: no drain env's episode in flight", drained)

    # ------------------------------------------------------------------------------------------- shutdown

    async def _shutdown(self, deadline: float) -> None:
        """Cancel rollouts still generating (their data is not needed), let submits in progress finish, cancel
        what is left, stop the workers: all by `deadline`, keeping a little for the disconnects after it."""
        loop = asyncio.get_running_loop()
        if self.pool is not None:
            self.pool.closing = True
        reserve = min(1.0, 0.2 * self.shutdown_timeout)
        for g in self._in_flight:
            if not g.submitting:
                self._in_flight.cancel(g, "stopped")
        await self._in_flight.wait(max(0.0, deadline - reserve - loop.time()))
        for g in self._in_flight:
            self._in_flight.cancel(g, "unsent")
        await self._in_flight.wait(max(0.0, deadline - reserve / 2 - loop.time()))
        for g in self._in_flight:  # ignored its cancellation (user cleanup that hangs): abandoned, not awaited
            log.warning("group %s did not end within shutdown_timeout: abandoned", g.task.get_name())
        for i, task in self._follow.drop_restarts():  # cancelled by new weights, never run again
            self._discard(i, task)
        self._gate.open()
        try:
            await bounded_close(self._shared, self.limits.release_timeout)
        except Exception:  # a teardown that fails must not keep the run from shutting down
            log.exception("an environment's worker_setup failed to exit")
        if self._policy is not None and self._policy is not self.policy_spec:  # built here from a factory
            await close_policy(self._policy)
        if self.pool is not None:
            await self.pool.close(timeout=max(0.0, deadline - reserve / 2 - loop.time()))
            self.stats.workers_alive = 0
            self.stats.worker_deaths = self.pool.deaths
            self.stats.workers_recycled = Counter(self.pool.recycled)
