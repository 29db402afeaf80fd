"""`Timeouts`: every time bound of a `RolloutRunner` as one value (like httpx's `Timeout`), so that a runner
is configured with a few objects rather than seven loose keywords. `None` turns a bound off."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from rollout_client.aio import RELEASE_S
from rollout_client.group import Limits
from rollout_client.runner.coalescing import LINGER_S
from rollout_client.runner.following import REPLY_S

TURN_S = 600.0
ROLLOUT_S = 1800.0
GROUP_S = 3600.0
PAUSE_S = 60.0
SHUTDOWN_S = 10.0
INFERENCE_OUTAGE_S = 600.0


@dataclass(frozen=True, slots=True)
class Timeouts:
    """The runner's bounds, in seconds. Time paused at the gate (a weight sync) never counts against `turn`,
    `rollout` or `group`.

    `Timeouts(group=120.0)` changes one and keeps the defaults of the others."""

    turn: float | None = TURN_S
    """One generation request, retries included: past it, `TurnTimeout` fails the group."""
    rollout: float | None = ROLLOUT_S
    """One rollout (all its turns and tools): past it, `RolloutTimeout` fails the group."""
    group: float | None = GROUP_S
    """One whole group (its rollouts, scoring, release): past it the group fails (`group_timeout`) and a
    worker running it is replaced (it may hold a verifier that never returns)."""
    release: float | None = RELEASE_S
    """Releasing a group's resources (a sandbox's close): past it the release is abandoned and counted."""
    pause: float = PAUSE_S
    """`pause()` without its own timeout: an inference server that hangs must not stall a weight sync forever
    (`math.inf`: wait as long as the requests take)."""
    shutdown: float = SHUTDOWN_S
    """`run()` returns within this of a stop: groups still submitting after it are cancelled."""
    inference_outage: float | None = INFERENCE_OUTAGE_S
    """The inference server unreachable this long (its circuit breaker open) ends the run."""
    submit_linger: float = LINGER_S
    """How long a finished group waits for others of its env to be submitted with it, in one
    /scored_data_list (`rollout_client.runner.coalescing`); 0 submits each group alone at once."""
    server_reply: float | None = REPLY_S
    """A heartbeat the rollbuf server has not answered within this reports it unresponsive (a log line,
    `health().server_reachable` False) while the heartbeat waits on; its answer reports the recovery. A stopped
    or hung server is so told within one heartbeat interval and this. None: only a failed heartbeat is told."""

    def __post_init__(self) -> None:
        for name in (f.name for f in fields(self)):  # every bound is seconds
            value = getattr(self, name)
            if value is not None and (math.isnan(value) or value < 0):
                raise ValueError(f"Timeouts.{name} must be a number of seconds >= 0 (or None), got {value}")

    def limits(self, token_limit: int | None = None) -> Limits:
        """What bounds a group's rollouts, in this process or a worker; the token limit is the server's."""
        return Limits(token_limit, self.turn, self.rollout, self.release)
