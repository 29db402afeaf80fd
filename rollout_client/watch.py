"""`Watch`: the runner's loop over the server's view of the run, beside its dispatch loop.

Every `poll_interval` it reads each env's /status-env, feeds the backpressure (queue depth, the trainer's step)
and the follower (weights the trainer announced), heartbeats in between, and applies the `Monitor`'s verdict:
envs held back, groups cancelled as stale, the run ended. It shares the runner's collaborators (backpressure,
follower, in-flight groups, stats) and the `Weights` now generating, and speaks back only through `changed`
(dispatch may move) and `end` (the run must end); so the runner keeps no watch state of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from api.wire.schema import EnvStatus
from rollout_client.backpressure import Backpressure
from rollout_client.breaker import Breaker
from rollout_client.client import RolloutClient
from rollout_client.errors import RetriesExhausted
from rollout_client.following import Beats, Follower
from rollout_client.inflight import InFlight
from rollout_client.stats import RunnerStats
from rollout_client.watching import Monitor, Sight, held_back
from rollout_client.workers import WorkerPool

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

    @property
    def now(self) -> int:
        return self.step or 0

    def set(self, step: int) -> None:
        self.step = step
        self.stats.policy_step = step


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
        """The announced step this runner is drained for (no drain env's episode in flight), if any."""

    def beats(self, clients: Sequence[RolloutClient], producer_id: str) -> Beats:
        """The heartbeat to run beside the watch: it carries the step generating and the drain state."""
        return Beats(list(clients), self.names, self.stats, lambda: self.weights.now,
                     lambda: (self.follow.drains, self.drained_for), self.beat_now, producer_id)  # fmt: skip

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

    async def watch(self) -> None:
        """The loop itself: returns when the monitor ends the run; raises what a status read raises."""
        while True:
            mark = self.backpressure.mark()
            statuses: Sequence[EnvStatus] = await asyncio.gather(
                *(self.statuses.status(i) for i in range(len(self.names)))
            )
            trainer_step = self.backpressure.observed(list(statuses), mark)
            self._weights_observed(statuses)
            held = self.backpressure.refresh(self.in_flight.pending(), self.weights.now)
            self._drained_now()
            self.stats.trainer_step = trainer_step
            sight = Sight(
                held, self.draining(), [(k, g.policy_step, g.submitting) for k, g in self.in_flight.groups.items()],
                self.weights.now, trainer_step, paused=self.paused(), resumed=self.weights.resumed,
                weights_step=self.follow.weights_step,
                blocked_reason=next((st.blocked_reason for st in statuses if st.blocked_reason), None),
                inference_down_for=self.inference.down_for(time.monotonic()),
            )  # fmt: skip
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
                log.info("drained for the weight sync to step %d: no drain env's episode in flight", drained)
