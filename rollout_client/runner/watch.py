"""`Watch`: the runner's loop over the server's view of the run, beside its dispatch loop.

Every `poll_interval` it reads each env's /status-env, feeds the backpressure (queue depth, the trainer's step)
and the follower (weights the trainer announced), heartbeats in between, and applies the `Monitor`'s verdict:
envs held back, groups cancelled as stale, the run ended. It shares the runner's collaborators (backpressure,
follower, in-flight groups, stats) and the `Weights` now generating, and speaks back only through `changed`
(dispatch may move) and `end` (the run must end); so the runner keeps no watch state of its own.

It also holds generation for a weight sync the trainer has begun (`weights_pending`): once the drain envs'
episodes are over it shuts the generation gate (this process's and every worker's), waits until no request is
at the inference server, and reports drained for the sync; it opens the gate when it reads the announcement,
the gate's `weights` set to the new version first. So a request is never at the inference server while the
trainer pushes, and every turn knows which weights sampled it (`rollout_client.runner.following`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from api.wire.schema import EnvStatus
from rollout_client.breaker import Breaker
from rollout_client.client import RolloutClient
from rollout_client.env import Gate
from rollout_client.errors import RetriesExhausted
from rollout_client.runner.backpressure import Backpressure
from rollout_client.runner.following import REPLY_S, Beats, Follower
from rollout_client.runner.inflight import InFlight
from rollout_client.runner.stats import RunnerStats
from rollout_client.runner.watching import Monitor, Sight, held_back
from rollout_client.workers.pool import WorkerPool

log = logging.getLogger("rollout_client.runner")


class StatusSource(Protocol):
    """Where each env's /status-env is read (`Registrations`: through its client, re-registering as needed)."""

    async def status(self, i: int) -> EnvStatus: ...


@dataclass
class Weights:
    """The weights now generating: their step, stamped on every group started from now on, and whether the
    runner has been told of new weights at least once (`resume()`, or the trainer announcing them)."""

    stats: RunnerStats
    step: int | None = None
    resumed: bool = False
    gate: Gate | None = None
    """The generation gate whose `weights` follows the step (set once the runner has one)."""
    pool: Callable[[], WorkerPool | None] = lambda: None
    """The worker pool, whose workers' gates follow the step too."""

    @property
    def now(self) -> int:
        return self.step or 0

    def set(self, step: int) -> None:
        self.step = step
        self.stats.policy_step = step
        self.serve(step)

    def serve(self, step: int) -> None:
        """Requests let through from now on are served by the weights of `step` (the gates' `weights`)."""
        if self.gate is not None:
            self.gate.weights = step
        if (pool := self.pool()) is not None:
            pool.set_weights(step)


class Watch:
    """Reads the server every `poll_interval` and applies what it says; `run()` until cancelled or the run
    must end (`end` is called: the server stayed unreachable, the monitor's verdict, a bug of its own)."""

    def __init__(
        self,
        *,
        names: Sequence[str],
        statuses: StatusSource,
        backpressure: Backpressure,
        follow: Follower,
        monitor: Monitor,
        in_flight: InFlight,
        inference: Breaker,
        stats: RunnerStats,
        weights: Weights,
        poll_interval: float,
        changed: asyncio.Event,
        end: Callable[[str, BaseException | None], None],
        paused: Callable[[], bool],
        pool: Callable[[], WorkerPool | None],
        gate: Gate | None = None,
        user_paused: Callable[[], bool] = lambda: False,
    ) -> None:
        self.names = list(names)
        self.statuses = statuses
        self.backpressure = backpressure
        self.follow = follow
        self.monitor = monitor
        self.in_flight = in_flight
        self.inference = inference
        self.stats = stats
        self.weights = weights
        self.poll_interval = poll_interval
        self.changed = changed
        self.end = end
        self.paused = paused
        self.pool = pool
        self.beat_now = asyncio.Event()
        """Set to heartbeat at once (drained for a sync: the trainer waits for that beat)."""
        self.drained_for: int | None = None
        """The pending sync's step this runner is drained for (no drain env's episode, no request in flight)."""
        self.gate = gate or Gate()
        """The generation gate of this process, held shut for a pending weight sync."""
        self.user_paused = user_paused
        """Whether `pause()` holds generation (then a sync's end leaves the gates shut for `resume()`)."""
        self.holding: int | None = None
        """The pending sync's step generation is held for, or None."""
        self._hold: asyncio.Task[None] | None = None
        weights.gate, weights.pool = self.gate, pool

    def beats(self, clients: Sequence[RolloutClient], producer_id: str, reply_within: float | None = REPLY_S) -> Beats:
        """The heartbeat to run beside the watch: it carries the step generating and the drain state, and tells a
        server that leaves it unanswered past `reply_within` (`Timeouts.server_reply`)."""
        return Beats(
            list(clients),
            self.names,
            self.stats,
            lambda: self.weights.now,
            lambda: (self.follow.drains, self.drained_for),
            self.beat_now,
            producer_id,
            reply_within=reply_within,
        )

    async def run(self, beats: Beats | None = None) -> None:
        """Watch (and heartbeat meanwhile) until cancelled; whatever goes wrong here ends the run through `end`,
        never as a bare error."""
        beating = None if beats is None else asyncio.create_task(beats.run())
        try:
            await self.watch()
        except RetriesExhausted as exc:
            self.end("the rollbuf server stayed unreachable", exc)
        except Exception as exc:
            self.end(f"the runner's monitor failed: {type(exc).__name__}", exc)
        finally:
            if beating is not None:
                beating.cancel()
            if self._hold is not None:
                self._hold.cancel()

    async def watch(self) -> None:
        """The loop itself: returns when the monitor ends the run; raises what a status read raises."""
        while True:
            mark = self.backpressure.mark()
            statuses: Sequence[EnvStatus] = await asyncio.gather(
                *(self.statuses.status(i) for i in range(len(self.names)))
            )
            trainer_step = self.backpressure.observed(list(statuses), mark)
            self._weights_observed(statuses)
            self._hold_for_sync()
            held = self.backpressure.refresh(self.in_flight.pending(), self.weights.now)
            self._drained_now()
            self.stats.trainer_step = trainer_step
            sight = Sight(
                held,
                self.draining(),
                [(k, g.policy_step, g.submitting) for k, g in self.in_flight.groups.items()],
                self.weights.now,
                trainer_step,
                paused=self.paused(),
                resumed=self.weights.resumed,
                weights_step=self.follow.weights_step,
                blocked_reason=next((st.blocked_reason for st in statuses if st.blocked_reason), None),
                inference_down_for=self.inference.down_for(time.monotonic()),
            )
            tick = self.monitor.tick(sight, time.monotonic())
            self.stats.hold(self.names, tick.held)
            self.stats.stalled, self.stats.server_blocked = tick.stalled, tick.server_blocked
            if tick.end is not None:
                self.end(tick.end, None)
                return
            self.stats.count_workers(self.pool())
            for key in tick.stale:
                if (g := self.in_flight.groups.get(key)) is not None:
                    self.in_flight.cancel(g, "stale")
            self.changed.set()
            await asyncio.sleep(self.poll_interval)

    def draining(self) -> list[bool]:
        """Per env: held for a weight sync's drain."""
        return [self.follow.holds(i) for i in range(len(self.names))]

    def refresh_blocked(self) -> None:
        """Which envs must wait, from the last status read and what the runner has in flight now."""
        held = self.backpressure.refresh(self.in_flight.pending(), self.weights.now)
        self.stats.hold(self.names, held_back(held, self.draining()))

    def _weights_observed(self, statuses: Sequence[EnvStatus]) -> None:
        """New weights announced: stamped on the groups started from now on (groups in flight meet them by their
        env's `on_new_weights`), and what `max_staleness` is judged against."""
        step = self.follow.observed(statuses, self.in_flight)
        if step is not None and (self.weights.step is None or step > self.weights.step):
            self.weights.set(step)
            self.weights.resumed = True
            self.changed.set()

    def _drained_now(self) -> None:
        """Drained for a pending sync (or no longer): heartbeat at once, the trainer waits for it."""
        drained = self.follow.drained_for(self.in_flight)
        if drained != self.drained_for:
            self.drained_for = drained
            self.beat_now.set()
            if drained is not None:
                log.info(
                    "drained for the weight sync to step %d: no drain env's episode and no generation "
                    "request in flight",
                    drained,
                )

    def _hold_for_sync(self) -> None:
        """Hold generation for a pending sync once the drain envs' episodes are over; let it go on once the sync
        is announced (or called off)."""
        if self.weights.step is not None:  # the first pass, a worker pool started since: the gates learn it
            self.weights.serve(self.weights.step)
        step = self.follow.syncing()
        if step is None:
            if self.holding is not None:
                self._let_go()
            return
        if self.holding == step or not self.follow.episodes_over(self.in_flight):
            return
        if self._hold is not None:
            self._hold.cancel()
        self.holding = step
        self.follow.quiesced = None
        self._hold = asyncio.create_task(self._quiesce(step), name=f"hold-for-sync-{step}")

    async def _quiesce(self, step: int) -> None:
        """Shut every generation gate and wait until no request is in flight; then drained for `step`."""
        self.gate.shut()
        pool = self.pool()
        await asyncio.gather(self.gate.drained(), *([] if pool is None else [pool.pause(None)]))
        self.follow.quiesced = step
        self._drained_now()

    def _let_go(self) -> None:
        """The sync is over: generation goes on with the new weights (unless `pause()` holds it)."""
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
        self.holding = None
        self.follow.quiesced = None
        self.weights.serve(self.weights.now)
        if not self.user_paused():
            self.gate.open()
            if (pool := self.pool()) is not None:
                pool.resume()
