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
    """A count of bytes held, bounded by `limit` over all requests and by `per_holder` for one holder (an API
    key's name, or a keyless client's address), so that one holder cannot take it all; thread-safe (gzip bodies
    inflate in worker threads). `reserve`: the most a request's declared length takes before its bytes arrive
    (`api.http.body.read_body`): a client that declares 256 MiB and dribbles holds only what it sent and this."""

    def __init__(
        self, limit: int, retry_after: float = 1.0, *, per_holder: int | None = None, reserve: int | None = None
    ) -> None:
        self.limit = limit
        self.per_holder = limit if per_holder is None else per_holder
        self.reserve = limit if reserve is None else reserve
        self.retry_after = retry_after
        self.held = 0
        self.by_holder: dict[str, int] = {}
        self.peak = 0
        """The most held at once so far (tests and benches read it)."""
        self._lock = threading.Lock()

    def take(self, n: int, holder: str = "", *, alone: int | None = None) -> None:
        """Hold `n` more bytes, or raise `Busy` (holding nothing more) when that would pass a limit. `alone`: what
        the taking request holds already; when that is all the budget holds, it may pass the limits (a request
        whose decoding costs more than the budget runs when it is the only one, instead of never)."""
        with self._lock:
            held, mine = self.held, self.by_holder.get(holder, 0)
            if (held + n <= self.limit and mine + n <= self.per_holder) or held == alone:
                self.held = held + n
                self.by_holder[holder] = mine + n
                self.peak = max(self.peak, self.held)
                return
        if held + n > self.limit:
            why = (
                f"the server holds {held} bytes of request bodies; this request needs {n} more and the limit "
                f"(max_inflight_bytes) is {self.limit}"
            )
        else:
            why = (
                f"{holder or 'this client'} holds {mine} bytes of request bodies; this request needs {n} more "
                f"and one key's or client's share (max_inflight_bytes_per_client) is {self.per_holder}"
            )
        raise Busy(f"{why}: retry later", self.retry_after)

    def give(self, n: int, holder: str = "") -> None:
        with self._lock:
            self.held -= n
            left = self.by_holder.get(holder, 0) - n
            if left > 0:
                self.by_holder[holder] = left
            else:
                self.by_holder.pop(holder, None)

    def hold(self, holder: str = "") -> Hold:
        return Hold(self, holder)


class Hold:
    """One request's share of a `BodyBudget`: what it took, given back all at once by `release`."""

    def __init__(self, budget: BodyBudget, holder: str = "") -> None:
        self.budget = budget
        self.holder = holder
        self.bytes = 0

    def take(self, n: int) -> None:
        self.budget.take(n, self.holder)
        self.bytes += n

    def charge(self, n: int) -> None:
        """Hold `n` more bytes for what decoding the body will cost beyond its bytes (`api.http.body_cost`); alone
        in the budget, a request may pass its limits (`BodyBudget.take`)."""
        self.budget.take(n, self.holder, alone=self.bytes)
        self.bytes += n

    def give(self, n: int) -> None:
        """Give back part of what was taken (a compressed body, once inflated)."""
        n = min(n, self.bytes)
        self.budget.give(n, self.holder)
        self.bytes -= n

    def release(self) -> None:
        self.give(self.bytes)


UNBOUNDED = BodyBudget(1 << 62)
"""For bodies read outside a request's hold (tests, tools)."""
