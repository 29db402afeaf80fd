"""The runner's watch over a run: every `poll_interval`, each env's /status-env (held back while the queue is
full or the trainer too far behind), stale groups cancelled, an inference outage that lasts, a runner held
ahead of a trainer that never calls `resume()`; and `health()`, the snapshot a trainer checks."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from api.schema import EnvStatus
from rollout_client.pacing import AHEAD, DRAINING, is_stale
from rollout_client.stats import RunnerHealth

if TYPE_CHECKING:
    from rollout_client.backpressure import Backpressure
    from rollout_client.breaker import Breaker
    from rollout_client.client import RolloutClient
    from rollout_client.env import Environment
    from rollout_client.following import Follower
    from rollout_client.inflight import InFlight
    from rollout_client.registration import Registrations
    from rollout_client.stats import RunnerStats
    from rollout_client.workers import WorkerPool

_DIGITS = re.compile(r"\d+")
log = logging.getLogger("rollout_client.runner")


class Watching:
    """Mixed into `RolloutRunner`: what it watches, and the state it reads (declared here for the types)."""

    envs: list[Environment]
    clients: list[RolloutClient]
    stats: RunnerStats
    pool: WorkerPool | None
    max_staleness: int | None
    poll_interval: float
    stall_warning: float | None
    inference_outage_timeout: float | None
    _registrations: Registrations
    _backpressure: Backpressure
    _in_flight: InFlight
    _inference: Breaker
    _changed: asyncio.Event
    _running: bool
    _error: BaseException | None
    _held_since: float | None
    _stall_logged: float | None
    _resumed: bool
    _follow: Follower

    @property
    def policy_step(self) -> int:
        raise NotImplementedError

    @property
    def paused(self) -> bool:
        raise NotImplementedError

    def _end(self, reason: str, exc: BaseException | None) -> None:
        raise NotImplementedError

    def _weights_observed(self, statuses: Sequence[EnvStatus]) -> None:
        raise NotImplementedError

    def _drained_now(self) -> None:
        raise NotImplementedError

    def health(self) -> RunnerHealth:
        """What a trainer checks between steps: alive workers, in flight, failures, lag. Call it on the
        runner's loop (or through `RunnerHandle.health()` from another thread)."""
        s = self.stats
        s.workers_alive = len(self.pool.workers) if self.pool is not None else 0
        return RunnerHealth(
            running=self._running,
            paused=self.paused,
            workers_alive=s.workers_alive,
            in_flight=s.in_flight,
            accepted=s.accepted,
            failed={env: dict(c) for env, c in s.failed.items()},
            failed_total=s.failed_total,
            error_rate=s.error_rate,
            skipped=dict(s.skipped),
            held_back=dict(s.paused),
            trainer_step=s.trainer_step,
            policy_step=self.policy_step,
            lag=max(0, s.trainer_step - self.policy_step),
            error=None if self._error is None else str(self._error),
            inference_reachable=s.inference_reachable,
            inference_outages=s.inference_outages,
            workers_recycled=dict(s.workers_recycled),
            stalled=s.stalled,
            rollouts_failed={env: dict(c) for env, c in s.rollouts_failed.items()},
            partial_groups=s.partial_groups,
            server_blocked=s.server_blocked,
        )

    async def _watch(self) -> None:
        while True:
            mark = self._backpressure.mark()
            statuses: Sequence[EnvStatus] = await asyncio.gather(
                *(self._registrations.status(i) for i in range(len(self.clients)))
            )
            trainer_step = self._backpressure.observed(list(statuses), mark)
            self._weights_observed(statuses)
            self._refresh_blocked()
            self._drained_now()
            self.stats.trainer_step = trainer_step
            self._check_stall()
            self._check_server(statuses)
            now = time.monotonic()
            if self.inference_outage_timeout is not None and (
                self._inference.down_for(now) > self.inference_outage_timeout
            ):
                self._end(f"the inference server stayed unreachable for {self.inference_outage_timeout} s", None)
                return
            if self.pool is not None:
                self.stats.workers_alive = len(self.pool.workers)
                self.stats.worker_deaths = self.pool.deaths
                self.stats.workers_recycled = Counter(self.pool.recycled)
            for g in self._in_flight:
                if not g.submitting and is_stale(g.policy_step, trainer_step, self.max_staleness):
                    self._in_flight.cancel(g, "stale")
            self._changed.set()
            await asyncio.sleep(self.poll_interval)

    def _check_stall(self) -> None:
        """Held back `ahead_of_trainer` for `stall_warning` s with nobody calling `resume()`: the trainer moves
        on but this runner believes its weights are old. Say so (a log line, `health().stalled`)."""
        now = time.monotonic()
        ahead = AHEAD in self.stats.paused.values() and not self.paused
        if not ahead or self.stall_warning is None:
            self._held_since = None
            self.stats.stalled = None
            return
        if self._held_since is None:
            self._held_since = now
        held = now - self._held_since
        if held < self.stall_warning:
            return
        fix = "call resume() after each weight sync, or resume(policy_step=N)"
        if self._follow.weights_step is not None:
            fix = f"the trainer announced no weights after step {self._follow.weights_step} (POST /weights)"
        self.stats.stalled = (
            f"held back ahead_of_trainer for {held:.0f} s at policy step {self.policy_step} (trainer at "
            f"{self.stats.trainer_step}): {fix}"
        )
        if self._stall_logged is None or now - self._stall_logged >= self.stall_warning:
            self._stall_logged = now
            log.warning("the runner is stalled: %s%s", self.stats.stalled,
                        "" if self._resumed else " (resume() was never called)")  # fmt: skip

    def _check_server(self, statuses: Sequence[EnvStatus]) -> None:
        """The server cannot form a batch from what is queued: log its reason once (each new one), show it in
        `health()`, so the user learns in seconds what to change (a mode, a policy, a group size)."""
        reason = next((st.blocked_reason for st in statuses if st.blocked_reason), None)
        if reason is not None and _kind(reason) != _kind(self.stats.server_blocked or ""):
            log.warning("the server can form no batch from what is queued: %s", reason)
        elif reason is None and self.stats.server_blocked is not None:
            log.info("the server forms batches again")
        self.stats.server_blocked = reason

    def _refresh_blocked(self) -> None:
        """Which envs must wait, from the last status read and what this runner has in flight now."""
        held = self._backpressure.refresh(self._in_flight.pending(), self.policy_step)
        for i, reason in enumerate(held):
            if reason is None and self._follow.holds(i):
                reason = DRAINING
            if reason is None:
                self.stats.paused.pop(self.envs[i].name, None)
            else:
                self.stats.paused[self.envs[i].name] = reason


def _kind(reason: str) -> str:
    """A reason with its numbers left out: the same block with a new step or count in it is not news (a
    commit-mode trainer at its read-ahead bound names a new step every episode)."""
    return _DIGITS.sub("N", reason)
