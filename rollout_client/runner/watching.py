"""The runner's watch over a run, as a value: every `poll_interval` the runner reads each env's /status-env
and hands what it sees (`Sight`) to `Monitor.tick`, which says (`Tick`) which envs to hold back and why,
which groups became too stale to finish, why the run must end (an inference outage that lasts), whether the
runner is stalled ahead of a trainer that never calls `resume()`, and what the server says blocks its
batches. The runner applies it; the monitor does no I/O but its log lines, so it is tested alone."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from rollout_client.runner.pacing import AHEAD, DRAINING, is_stale

_DIGITS = re.compile(r"\d+")
log = logging.getLogger("rollout_client.runner")


@dataclass(frozen=True)
class Sight:
    """What the runner sees at one tick."""

    held: Sequence[str | None]
    """Per env: why backpressure holds it back (queue_full, ahead_of_trainer), or None."""
    draining: Sequence[bool]
    """Per env: held for a weight sync's drain (`on_new_weights="drain"`)."""
    groups: Sequence[tuple[str, int, bool]]
    """Groups in flight: (group id, the policy step they were started at, submitting already)."""
    policy_step: int
    trainer_step: int
    paused: bool = False
    """Between `pause()` and `resume()`."""
    resumed: bool = False
    """`resume()` was called, or the trainer announced weights, at least once."""
    weights_step: int | None = None
    """The step of the weights the trainer last announced (POST /weights), if any."""
    blocked_reason: str | None = None
    """Why the server forms no batch from what is queued (the first env's /status-env that says so)."""
    inference_down_for: float = 0.0
    """Seconds the inference server has been unreachable (its circuit breaker open)."""


@dataclass(frozen=True)
class Tick:
    """What the runner must do after a tick."""

    held: tuple[str | None, ...]
    """Per env: why it waits now (queue_full, ahead_of_trainer, draining), or None: `stats.paused`."""
    stale: tuple[str, ...] = ()
    """Group ids to cancel: too stale to finish (`max_staleness`)."""
    end: str | None = None
    """Why the run must end now, or None."""
    stalled: str | None = None
    """Why production is stalled (`health().stalled`), or None."""
    server_blocked: str | None = None
    """The server's reason it forms no batch (`health().server_blocked`), or None."""


def held_back(held: Sequence[str | None], draining: Sequence[bool]) -> tuple[str | None, ...]:
    """Why each env waits: its backpressure, else a drain for a weight sync, else nothing."""
    return tuple(h if h is not None else DRAINING if d else None for h, d in zip(held, draining, strict=True))


class Monitor:
    """Judges each tick against `max_staleness`, `stall_warning` and `inference_outage_timeout` (None turns
    each off), remembering what it needs across ticks: since when the runner is held ahead, when that was
    last logged, the server's last reason."""

    def __init__(
        self, max_staleness: int | None, stall_warning: float | None, inference_outage_timeout: float | None
    ) -> None:
        self.max_staleness = max_staleness
        self.stall_warning = stall_warning
        self.inference_outage_timeout = inference_outage_timeout
        self._held_since: float | None = None
        self._stall_logged: float | None = None
        self._server_blocked: str | None = None

    def tick(self, sight: Sight, now: float) -> Tick:
        """What to do about `sight`, seen at `now` (monotonic seconds)."""
        held = held_back(sight.held, sight.draining)
        stalled = self._stall(sight, AHEAD in held, now)
        blocked = self._server(sight.blocked_reason)
        end = None
        limit = self.inference_outage_timeout
        if limit is not None and sight.inference_down_for > limit:
            end = f"the inference server stayed unreachable for {limit} s"
        stale = tuple(
            g
            for g, step, submitting in sight.groups
            if not submitting and is_stale(step, sight.trainer_step, self.max_staleness)
        )
        return Tick(held, stale, end, stalled, blocked)

    def _stall(self, sight: Sight, ahead: bool, now: float) -> str | None:
        """Held back `ahead_of_trainer` for `stall_warning` s with nobody calling `resume()`: the trainer moves
        on but this runner believes its weights are old. Say so (a log line every `stall_warning` s)."""
        if not ahead or sight.paused or self.stall_warning is None:
            self._held_since = None
            return None
        if self._held_since is None:
            self._held_since = now
        held = now - self._held_since
        if held < self.stall_warning:
            return None
        fix = "call resume() after each weight sync, or resume(policy_step=N)"
        if sight.weights_step is not None:
            fix = f"the trainer announced no weights after step {sight.weights_step} (POST /weights)"
        stalled = (
            f"held back ahead_of_trainer for {held:.0f} s at policy step {sight.policy_step} (trainer at "
            f"{sight.trainer_step}): {fix}"
        )
        if self._stall_logged is None or now - self._stall_logged >= self.stall_warning:
            self._stall_logged = now
            log.warning("the runner is stalled: %s%s", stalled, "" if sight.resumed else " (resume() was never called)")
        return stalled

    def _server(self, reason: str | None) -> str | None:
        """The server cannot form a batch from what is queued: log its reason once (each new kind), so the user
        learns in seconds what to change (a mode, a policy, a group size)."""
        if reason is not None and _kind(reason) != _kind(self._server_blocked or ""):
            log.warning("the server can form no batch from what is queued: %s", reason)
        elif reason is None and self._server_blocked is not None:
            log.info("the server forms batches again")
        self._server_blocked = reason
        return reason


def _kind(reason: str) -> str:
    """A reason with its numbers left out: the same block with a new step or count in it is not news (a
    commit-mode trainer at its read-ahead bound names a new step every episode)."""
    return _DIGITS.sub("N", reason)
