"""The bytes of request bodies held at once, across every request of this process.

A body limit bounds one request; without a bound across them, six concurrent 200 MB bodies (or three small
gzip bodies that inflate to 250 MB each) hold gigabytes at once. Each request's bytes, as received and as
inflated, are taken from one budget while it is handled and given back when it ends; past the budget a
request is answered 503 + Retry-After (handlers retry it) instead of being read.
"""

from __future__ import annotations

import threading

from api.errors import Unavailable


class Busy(Unavailable):
    """The process holds as many request bytes as it may: try again shortly."""

    code = "busy"


class BodyBudget:
    """A count of bytes held, bounded by `limit`; thread-safe (gzip bodies inflate in worker threads)."""

    def __init__(self, limit: int, retry_after: float = 1.0) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self.held = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Hold `n` more bytes, or raise `Busy` (holding nothing more) when that would pass the limit."""
        with self._lock:
            held = self.held
            if held + n <= self.limit:
                self.held = held + n
                return
        raise Busy(
            f"the server holds {held} bytes of request bodies; this request needs {n} more and the limit "
            f"(max_inflight_bytes) is {self.limit}: retry later",
            self.retry_after,
        )

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n

    def hold(self) -> Hold:
        return Hold(self)


class Hold:
    """One request's share of a `BodyBudget`: what it took, given back all at once by `release`."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.bytes = 0

    def take(self, n: int) -> None:
        self.budget.take(n)
        self.bytes += n

    def give(self, n: int) -> None:
        """Give back part of what was taken (a compressed body, once inflated)."""
        n = min(n, self.bytes)
        self.budget.give(n)
        self.bytes -= n

    def release(self) -> None:
        self.give(self.bytes)


UNBOUNDED = BodyBudget(1 << 62)
"""For bodies read outside a request's hold (tests, tools)."""
