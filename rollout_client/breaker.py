"""The inference circuit breaker: is the inference server reachable, and how many outages has it had.

Pure bookkeeping (the caller passes the time), apart from the policy's HTTP and the runner's dispatch, so
that it can be tested alone. A connection failure opens the breaker (the runner holds dispatch: new groups
would only fail), a success closes it. One outage is one transition from reachable to unreachable; a
request sent before the breaker last closed tells nothing of the server now: its failure is stale and
changes nothing, however late it reports (under load, requests caught by a restart reported more than 5 s
after the server was reached again). A failure within `debounce_s` of the breaker closing belongs to the
outage that just ended, for callers that cannot say when their request left (a worker pool's relayed
state), so a restart is never counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEBOUNCE_S = 5.0
"""After the server is reached again, failures this soon still belong to the outage that just ended."""


@dataclass
class Breaker:
    """`closed` (reachable) until a connection failure; closed again by the next success."""

    debounce_s: float = DEBOUNCE_S
    closed: bool = True
    outages: int = 0
    """Transitions from reachable to unreachable, debounced."""
    down_since: float | None = None
    """When the current outage began (None while reachable)."""
    _closed_at: float | None = field(default=None, repr=False)

    def failure(self, now: float, sent: float | None = None) -> bool:
        """A connection failure at `now` of a request sent at `sent` (None: unknown); True if the breaker opened
        on it (it was closed, and the request left after it last closed)."""
        if not self.closed or self.stale(sent):
            return False
        self.closed = False
        recent = self._closed_at is not None and now - self._closed_at < self.debounce_s
        if not recent:
            self.outages += 1
            self.down_since = now
        elif self.down_since is None:
            self.down_since = now
        return True

    def stale(self, sent: float | None) -> bool:
        """Whether a request sent at `sent` left before the breaker last closed (its outcome is the old state's)."""
        return sent is not None and self._closed_at is not None and sent < self._closed_at

    def success(self, now: float) -> bool:
        """A reply at `now`; True if the breaker closed on it (it was open)."""
        if self.closed:
            return False
        self.closed = True
        self._closed_at = now
        return True

    def observe(self, down: bool, now: float) -> bool:
        """`failure` (when `down`) or `success` at `now`; True if the breaker changed on it."""
        return self.failure(now) if down else self.success(now)

    def down_for(self, now: float) -> float:
        """Seconds the current outage has lasted (0 while reachable)."""
        return 0.0 if self.closed or self.down_since is None else now - self.down_since

    def __post_init__(self) -> None:
        if self.debounce_s < 0:
            raise ValueError(f"debounce_s must be at least 0, got {self.debounce_s}")
