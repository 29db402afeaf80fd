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

A task source hears how each group without a score ended (`rollout_client.tasks.ended_unscored`): a failure
with its reason, or, for a group stopped, gone stale, dropped by a pause, restarted or not sent, that its task
was never tried to its end, so that a leased task goes back to its dataset untried. A group whose task lease
was lost (`LeasedTasks`: another producer may hold the task now) is dropped, never sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

from api.wire.schema import EnvRegistered, Info
from rollout_client.aio import bounded_close, wait_first
from rollout_client.breaker import Breaker
from rollout_client.client import RolloutClient
from rollout_client.env import Environment, Gate, Task, enter_worker_setup
from rollout_client.errors import GroupDropped, Rejected, RetriesExhausted, RunFailed, exited, failure_reason
from rollout_client.leases.open_groups import OpenGroups
from rollout_client.leases.tasks import lease_token
from rollout_client.resources import Capacity
from rollout_client.runner.accounting import Tally
from rollout_client.runner.backpressure import Backpressure
from rollout_client.runner.coalescing import Coalescer
from rollout_client.runner.deprecated import resolve
from rollout_client.runner.execution import GroupExecutor, check_env, spread_hint, units_at_start
from rollout_client.runner.failures import FailurePolicy
from rollout_client.runner.following import Follower, producer_id
from rollout_client.runner.inflight import Group, InFlight
from rollout_client.runner.lifecycle import disconnect_all, stop_on_signals, unless_stopped
from rollout_client.runner.pacing import pick_env
from rollout_client.runner.per_rollout import Poster, Posting
from rollout_client.runner.registration import Registrations, register
from rollout_client.runner.siblings import SiblingSlots
from rollout_client.runner.sources import holds, lose, producer_of, sending
from rollout_client.runner.stats import RunnerHealth, RunnerStats
from rollout_client.runner.timeouts import Timeouts
from rollout_client.runner.turns import TurnPoster
from rollout_client.runner.watch import Watch, Weights
from rollout_client.runner.watching import Monitor
from rollout_client.tasks import TaskSource, ended_unscored, next_task_unless
from rollout_client.workers.pool import WorkerPool, check_picklable
from rollout_client.workers.process import CANCEL_GRACE_S, PAUSE_TIMEOUT, PolicySpec, close_policy, make_policy
from rollout_client.workers.recycling import RecyclePolicy

log = logging.getLogger("rollout_client.runner")

POLL_S = 0.2
"""How often /status-env is read per env: backpressure reacts within this, at 5 cheap requests/s per env."""
STEP_READ_S = 2.0
"""Bound on the trainer-step read at the end of `pause()`."""
QUARANTINED_IN_A_ROW = 1000
"""A source that hands out only quarantined tasks this many times in a row is treated as exhausted."""
STALL_WARN_S = 60.0
"""With `max_staleness`: held back `ahead_of_trainer` this long without a `resume()` is reported (a log line
every this often, and `health().stalled`): the runner waits for `resume()` to learn of new weights."""
LEASE_LOST = "lease_lost"
"""`skipped` reason of a group dropped because its task's lease was lost (`LeasedTasks.holds`)."""
UNTRIED: None = None
"""The reason of a group that ended without trying its task to the end (`ended_unscored`)."""


def task_failure(exc: BaseException) -> str | None:
    """Why a group's failure fails its task, in the words the task's source records (`env_error: ValueError:
    ...`); None where the task is not to blame and goes back untried: the inference server was unreachable
    (an outage fails every group it meets, whatever its task)."""
    reason = failure_reason(exc)
    if reason == "inference_unreachable":
        return UNTRIED
    return f"{reason}: {type(exc).__name__}: {exc}"


def lease_refused(task: Task, exc: Rejected) -> bool:
    """The server refused a leased task's group because the lease is not this producer's (a 409: it lapsed
    and went to another producer): the lease is lost, not the group bad."""
    return exc.status == 409 and lease_token(task) is not None


class RolloutRunner:
    """Run `envs` (each with its task source) against the rollbuf server at `base_url`.

    Use `await runner.run()` (until `stop()`, a signal or `max_groups`), with `pause()`/`resume()` around
    weight updates; or `rollout_client.runner.handle.run_in_thread(runner)` for a blocking handle from synchronous
    code. `policy` is a Policy or a zero-argument factory; with `num_workers > 0` it must pickle (each worker
    builds its own from it), and so must the environments and tasks.

    `timeouts` bounds every wait (`Timeouts`), `failures` says which failures end the run (`FailurePolicy`;
    it keeps this run's counts, so give each runner its own), `recycle` when a worker is replaced
    (`RecyclePolicy`). The keywords these replace (`turn_timeout=`, `max_error_rate=`,
    `recycle_after_groups=`...) still work for one release, with a DeprecationWarning.
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
        register_wait: float | None = None,
        client_options: dict[str, Any] | None = None,
        stall_warning: float | None = STALL_WARN_S,
        timeouts: Timeouts | None = None,
        failures: FailurePolicy | None = None,
        recycle: RecyclePolicy | None = None,
        **deprecated: Any,
    ) -> None:
        if not envs:
            raise ValueError("envs: give at least one (environment, task source) pair")
        for env, _ in envs:
            check_env(env, max_in_flight)
            if (hint := spread_hint(env, max_in_flight, num_workers)) is not None:
                log.warning("%s", hint)
        if num_workers > 0:  # at once, naming what does not pickle and the fix (not at the first spawn, in run())
            check_picklable([e for e, _ in envs], policy)
        self.base_url = base_url
        self.envs = [e for e, _ in envs]
        self.sources = [s for _, s in envs]
        self.producer_id = producer_id()
        """This run's id as a producer: its heartbeats carry it, and so does every group it submits (the ledger
        names the producer of each group); a leasing source takes its leases for it, unless it was given its own."""
        for source in self.sources:  # a leasing source says when a lease is lost: its group is dropped
            if callable(on_lost := getattr(source, "on_lost", None)):
                on_lost(self._lease_lost)
            if callable(for_producer := getattr(source, "for_producer", None)):
                for_producer(self.producer_id)
        self._names = [e.name for e in self.envs]
        self.policy_spec = policy
        self.max_in_flight = max_in_flight
        self.num_workers = num_workers
        self.max_staleness = max_staleness
        self.poll_interval = poll_interval
        self.register_wait = register_wait
        self.client_options = client_options or {}
        self.timeouts, self.failures, self.recycle = resolve(timeouts, failures, recycle, deprecated)
        self.limits = self.timeouts.limits()
        """What bounds a group's rollouts; the token limit is the server's, read when the run starts."""
        self.stats = RunnerStats()
        self._tally = Tally(self._names, self.stats, self.failures)
        self.clients: list[RolloutClient] = []
        self.pool: WorkerPool | None = None
        self.ready = asyncio.Event()
        """Set once every env is registered and workers are started."""
        self._weights = Weights(self.stats)
        """The weights now generating (`policy_step`), shared with the watch, which follows announcements."""
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
        self._policy: Any = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._inference = Breaker()
        """Reachability of the inference server, over every policy (this process's, the workers')."""
        self._policy_down = False
        self._registrations = Registrations(self.envs, self.clients, register_wait, self._registered_again)
        self._submits = Coalescer(
            self._registrations.submit, self._registrations.submit_list, linger=self.timeouts.submit_linger
        )
        """Each env's groups that finish together go in one /scored_data_list (`rollout_client.runner.coalescing`)."""
        self._executor: GroupExecutor | None = None
        """What runs the groups, once the run has started (`_start`)."""
        self._follow = Follower(self.envs)
        """The weights the trainer announces, followed (`rollout_client.runner.following`)."""
        self._watch = Watch(
            names=self._names,
            statuses=self._registrations,
            backpressure=self._backpressure,
            follow=self._follow,
            monitor=Monitor(max_staleness, stall_warning, self.timeouts.inference_outage),
            in_flight=self._in_flight,
            inference=self._inference,
            stats=self.stats,
            weights=self._weights,
            poll_interval=poll_interval,
            changed=self._changed,
            end=self._end,
            paused=lambda: self.paused,
            pool=lambda: self.pool,
            gate=self._gate,
            user_paused=lambda: not self._dispatch_open.is_set(),
        )
        """Reads the server and applies what it says, beside dispatch (`rollout_client.runner.watch`)."""
        self.groups: OpenGroups | None = None
        """Per-rollout groups (`Environment.posts_each_rollout`), once the run has started, if an env posts so."""
        self._posting: Posting | None = None
        """Opens and seals this runner's own per-rollout groups (with `groups`)."""

    # ------------------------------------------------------------------------------------------- control

    @property
    def policy_step(self) -> int:
        """The step of the weights now generating; stamped on every group started from now on."""
        return self._weights.now

    def stop(self) -> None:
        """Stop dispatching and shut down (returns at once; `run()` returns within `timeouts.shutdown`).
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

        It returns within about `timeout` s (default: the runner's `timeouts.pause`, 60 s; `math.inf` waits as
        long as the requests take) whatever the inference server does: groups whose requests are still in
        flight then are cancelled, dropped and counted as `skipped["pause_timeout"]`, and it returns False
        (True when everything stopped in time). It then reads the trainer's step (within 2 s), for
        `resume()` to stamp."""
        if timeout is None:
            timeout = self.timeouts.pause
        timeout = None if math.isinf(timeout) else timeout
        self._dispatch_open.clear()
        if self._loop is not None:
            self._in_flight.hold_deadlines(self._loop.time())

        async def here() -> bool:
            if await self._gate.close(timeout):
                return True
            self._in_flight.cancel_holders(self._gate.holders(), PAUSE_TIMEOUT)
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
        if (step := await self._registrations.trainer_step(STEP_READ_S)) is not None:
            self.stats.trainer_step = max(self.stats.trainer_step, step)

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
        self._weights.resumed = True
        if self._loop is not None:
            self._in_flight.release_deadlines(self._loop.time())
        self._weights.set(policy_step)
        if self._watch.holding is None:  # held for a weight sync: generation goes on once it is announced
            if self.pool is not None:
                self.pool.resume()
            self._gate.open()
        self._dispatch_open.set()
        self._changed.set()

    def health(self) -> RunnerHealth:
        """What a trainer checks between steps: alive workers, in flight, failures, lag. Call it on the
        runner's loop (or through `RunnerHandle.health()` from another thread)."""
        self.stats.count_workers(self.pool)
        error = None if self._error is None else str(self._error)
        return self.stats.health(running=self._running, paused=self.paused, policy_step=self.policy_step, error=error)

    # ------------------------------------------------------------------------------------------- run

    async def run(self, max_groups: int | None = None) -> RunnerStats:
        """Register, produce until `stop()` / SIGINT / SIGTERM / `max_groups` dispatched groups are done, shut
        down within `timeouts.shutdown` (workers stopped, envs disconnected) and return the stats.

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
                    beats = self._watch.beats(self.clients, self.producer_id, self.timeouts.server_reply)
                    siblings = None
                    if self.groups is not None:  # an env posts each rollout: take sibling slots too, when due
                        slots = self._siblings(self.groups)
                        beats.sibling_envs, beats.on_siblings = slots.asked_for, slots.heard
                        siblings = asyncio.create_task(slots.run())
                    monitor = asyncio.create_task(self._watch.run(beats))
                    try:
                        await self._dispatch(max_groups)
                        if not self._stopping.is_set():
                            await unless_stopped(self._stopping, self._in_flight.wait(None))
                    finally:
                        for t in (monitor, siblings):
                            if t is not None:
                                t.cancel()
                                with contextlib.suppress(asyncio.CancelledError):
                                    await t
            except Exception as exc:  # whatever ends the run ends it through RunFailed and the shutdown
                self._end(f"the runner failed: {type(exc).__name__}", exc)
            except asyncio.CancelledError:  # wait_for(run(), T), a TaskGroup ended by an error beside it:
                cancelled = True  # the same bounded shutdown, then the cancellation goes on
                if (me := asyncio.current_task()) is not None:
                    me.uncancel()  # the shutdown's own timeouts must not read as this cancellation
                self._on_stop()
            deadline = self._loop.time() + self.timeouts.shutdown
            await self._shutdown(deadline)
        finally:
            if self.pool is not None and self.pool.workers:  # the shutdown itself was cancelled: no orphan
                self.pool.kill()
            for sig in handled:
                self._loop.remove_signal_handler(sig)
            if deadline is None:
                deadline = self._loop.time() + self.timeouts.shutdown
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
            if self._weights.step is None:
                self._weights.step = reg.starting_step
        info = await self.clients[0].info()
        self._backpressure.batch_size = info.batch_size
        self.limits = self.timeouts.limits(info.max_token_len)
        self.stats.policy_step = self.policy_step
        if self.num_workers > 0:
            self.pool = WorkerPool(self.num_workers, self.envs, self.policy_spec, self.limits, self.recycle)
            self.pool.on_change = self._pool_changed
            if self._stopping.is_set():
                self.pool.closing = True
            await self.pool.start()
            self.stats.count_workers(self.pool)
        else:
            self._policy = make_policy(self.policy_spec)
            for env in self.envs:  # what this process's rollouts share, as a worker would set it up
                await enter_worker_setup(self._shared, env)
            if hasattr(self._policy, "on_reachability"):  # OpenAIPolicy's circuit breaker

                def changed(up: bool) -> None:
                    self._policy_down = not up
                    self._reachability()

                self._policy.on_reachability = changed
        if any(e.posts_each_rollout for e in self.envs):
            self.groups = OpenGroups(
                self.base_url, api_key=self.client_options.get("api_key"), producer_id=self.producer_id
            )
            self._posting = Posting(
                self.groups,
                self.envs,
                lambda i: self.clients[i].env_id,
                self.stats,
                self._tally,
                self._end,
                self.timeouts.group,
            )
        self._executor = GroupExecutor(
            self.envs,
            pool=self.pool,
            policy=self._policy,
            limits=self.limits,
            group_timeout=self.timeouts.group,
            in_flight=self._in_flight,
            capacity=self._capacity,
            gate=self._gate,
            stats=self.stats,
            stopping=self._stopping,
            on_rollout_end=self._rollout_ended,
        )
        if (groups := self.groups) is not None:  # rollouts of envs that resume post their turns as they end
            self._executor.turn_posters = lambda group_id, k, prefix: TurnPoster(groups, group_id, k, prefix)
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
        changed = self._inference.observe(down, time.monotonic())
        self.stats.inference_reachable = self._inference.closed
        self.stats.inference_outages = self._inference.outages
        if changed:
            self._changed.set()

    def _registered_again(self, reg: EnvRegistered, info: Info) -> None:
        """An env registered again: the weights generating from now on are stamped with the new run's step."""
        self.stats.reregistered = self._registrations.reregistered
        self._follow.weights_step = None  # a new run announces its own weights
        self._weights.set(reg.starting_step)
        self._backpressure.batch_size = info.batch_size
        self._changed.set()

    # ------------------------------------------------------------------------------------------- dispatch

    async def _dispatch(self, max_groups: int | None) -> None:
        quarantined_in_a_row = [0] * len(self.envs)
        while not self._stopping.is_set() and (max_groups is None or self.stats.dispatched < max_groups):
            if not self._dispatch_open.is_set():
                await wait_first(self._changed, self._dispatch_open.wait())
                continue
            if not self._inference.closed:  # new groups would only fail: wait for the server
                await wait_first(self._changed)  # until a group ends, a status read, a signal
                continue
            self._watch.refresh_blocked()
            eligible = [
                b is None and not x and not self._follow.holds(i)
                for i, (b, x) in enumerate(zip(self._backpressure.held, self._exhausted, strict=True))
            ]
            credit = list(self._credit)  # committed only if the pick launches: a wait must not cost an env its turn
            i = pick_env(credit, [e.weight / e.group_size for e in self.envs], eligible)
            if i is None:
                if all(self._exhausted):
                    return
                await wait_first(self._changed)
                continue
            fits = self._capacity[i].fits(units_at_start(self.envs[i]))  # its pool's units, if it has one
            if self._in_flight.free < self.envs[i].group_size or not fits:
                await wait_first(self._changed)
                continue
            task = self._follow.restart(i) or await next_task_unless(self.sources[i], self._stopping)
            if task is None:
                self._exhausted[i] = True
                continue
            if not holds(self.sources[i], task):  # a restart whose lease was lost while it waited: another's now
                continue
            if self.failures.is_quarantined(i, task.id):
                self.stats.skipped["quarantined"] += 1
                self._discard(i, task, "quarantined: its groups failed too often in a row")
                quarantined_in_a_row[i] += 1
                if quarantined_in_a_row[i] >= QUARANTINED_IN_A_ROW:
                    log.error(
                        "env %s: its task source hands out only quarantined tasks; no more from it", self.envs[i].name
                    )
                    self._exhausted[i] = True
                await asyncio.sleep(0)
                continue
            quarantined_in_a_row[i] = 0
            self._credit = credit
            self._launch(i, task)

    def _launch(self, i: int, task: Task) -> None:
        group_id = lease_token(task) or uuid.uuid4().hex  # a leased task's group is its lease's submission
        taken = units_at_start(self.envs[i])
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
        why: str | None = UNTRIED  # why its task failed, if it did: only a failure of its own rollout fails a task
        poster: Poster | None = None
        try:
            try:
                try:
                    assert self._executor is not None  # groups are launched once the run started
                    if env.posts_each_rollout:
                        assert self._posting is not None  # built in _start, with self.groups
                        if (poster := await self._posting.open(i, task, group_id, step)) is None:
                            return
                    outcome = await self._executor.run(i, task, group_id, poster)
                finally:
                    if taken:
                        self._capacity[i].give(taken)
            except GroupDropped as exc:
                self.stats.skipped[exc.reason] += 1
                if poster is not None and self.groups is not None:
                    self.groups.let_go(group_id)  # its acknowledged rollouts kept: siblings finish it
                return
            except asyncio.CancelledError:
                if poster is not None and self.groups is not None:
                    self.groups.let_go(group_id)  # stopped, stale: siblings finish it
                raise
            except Exception as exc:  # a group boundary: the group fails, the run goes on (unless too many do)
                why = task_failure(exc)
                self._failed(i, task, group_id, exc)
                return
            except BaseException as exc:  # exit() in env code: the group fails; a real Ctrl-C is a signal
                why = task_failure(exited(exc))
                self._failed(i, task, group_id, exited(exc))
                return
            self._release(group_id)
            if (produced := self._tally.finished(i, outcome, env.group_size)) is None:
                why = f"skipped: {outcome.skipped or 'skipped'}"
                return
            if not sending(self.sources[i], task):  # another producer may have its task: sending would train it twice
                self._in_flight.drop(self._in_flight.groups[group_id], LEASE_LOST)
                return
            self._in_flight.groups[group_id].submitting = True
            if poster is not None and self._posting is not None:
                if not await self._posting.sealed(i, group_id, poster):
                    why = "not acknowledged: its per-rollout group was not sealed"
                    return
                self._backpressure.acked(i, len(produced.tokens))
                self.sources[i].report(task, self._tally.stored(i, task.id, produced, False))
                reported = True
                return
            producer = producer_of(self.sources[i], task, self.producer_id)
            update = {"group_id": group_id, "policy_step": step, "producer_id": producer}
            group = produced.model_copy(update=update)
            group = self._follow.stamp(group_id, group, step)
            try:
                reply = await self._submits.submit(i, group)
            except RetriesExhausted as exc:
                log.warning("group %s of %s not submitted: %s", group_id, env.name, exc)
                self.stats.skipped["unsent"] += 1
                return
            except Rejected as exc:
                if lease_refused(task, exc):
                    lose(self.sources[i], task)
                    self.stats.skipped[LEASE_LOST] += 1
                    return
                why = f"rejected: {exc}"
                if stop := self._tally.rejected(i, group_id, exc):
                    self._end(stop, exc)
                return
            self._backpressure.acked(i, len(group.tokens))
            self.sources[i].report(task, self._tally.stored(i, task.id, group, bool(reply.duplicate)))
            reported = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the runner's own bookkeeping failed (a task source's report...): end the run
            self._end(f"group {group_id} of {env.name}: the runner failed", exc)
        finally:
            if not self._follow.ended(group_id) and not reported:  # a restarted task runs again: not discarded
                self._discard(i, task, why)
            self._in_flight.remove(group_id)
            self._changed.set()

    # ------------------------------------------------------------------------------------------- per rollout

    def _siblings(self, groups: OpenGroups) -> SiblingSlots:
        assert self._executor is not None
        return SiblingSlots(
            groups,
            self.envs,
            self._executor,
            self._in_flight,
            self.stats,
            poll_s=self.poll_interval,
            may_take=lambda: self._dispatch_open.is_set() and self._inference.closed,
            policy_step=lambda: self.policy_step,
            rollout_ended=self._rollout_ended,
            changed=self._changed.set,
        )

    # ------------------------------------------------------------------------------------------- failures

    def _failed(self, i: int, task: Task, group_id: str, exc: BaseException) -> None:
        if (stop := self._tally.failed(i, task.id, group_id, exc)) is not None:
            self._end(stop, exc)

    def _end(self, reason: str, exc: BaseException | None) -> None:
        """End the run with RunFailed (the first cause wins), after the usual shutdown."""
        if self._error is None:
            error = RunFailed(reason, exc, self._tally.failed_counts())
            error.__cause__ = exc
            self._error = error
            log.error("ending the run: %s", error)
        self._stopping.set()
        self._changed.set()

    def _discard(self, i: int, task: Task, reason: str | None) -> None:
        """Tell a task source that wants to know that `task` will never be reported: its rollout failed for
        `reason`, or (None) it was never tried to its end (stopped, stale, restarted, not sent)."""
        ended_unscored(self.sources[i], task, reason)

    def _lease_lost(self, token: str) -> None:
        """A source found a lease lost: the group rolling out under it (its group id is the token) is cancelled,
        unless it is being sent already (the server decides that one) or it is the group asking (it drops
        itself)."""
        g = self._in_flight.groups.get(token)
        if g is None or g.submitting:
            return
        try:
            asking = asyncio.current_task()
        except RuntimeError:  # found by a caller outside the event loop: no group is asking
            asking = None
        if g.task is not asking:
            self._in_flight.cancel(g, LEASE_LOST)

    def _release(self, group_id: str) -> None:
        """Give back a group's rollout slots when its rollouts end (before its submit): a group may start."""
        if self._in_flight.release(group_id):
            self._changed.set()

    # ------------------------------------------------------------------------------------------- shutdown

    async def _shutdown(self, deadline: float) -> None:
        """Cancel rollouts still generating (their data is not needed), let submits in progress finish, cancel
        what is left, stop the workers: all by `deadline`, keeping a little for the disconnects after it."""
        loop = asyncio.get_running_loop()
        if self.pool is not None:
            self.pool.closing = True
        reserve = min(1.0, 0.2 * self.timeouts.shutdown)
        await self._in_flight.stop(deadline - reserve, deadline - reserve / 2)
        await self._submits.aclose(max(0.0, deadline - reserve / 2 - loop.time()))  # groups have ended by now
        for i, task in self._follow.drop_restarts():  # cancelled by new weights, never run again
            self._discard(i, task, UNTRIED)
        if self.groups is not None:  # what it still holds lapses to siblings
            await self.groups.aclose()
        self._gate.open()
        try:
            await bounded_close(self._shared, self.timeouts.release)
        except Exception:  # a teardown that fails must not keep the run from shutting down
            log.exception("an environment's worker_setup failed to exit")
        if self._policy is not None and self._policy is not self.policy_spec:  # built here from a factory
            await close_policy(self._policy)
        if self.pool is not None:
            await self.pool.close(timeout=max(0.0, deadline - reserve / 2 - loop.time()))
            self.stats.count_workers(self.pool)
