"""Waking long-polling trainers: each change wakes one waiter, and a waiter that then takes a batch wakes the
next. 2,000 waiting `/batch?wait=` long-polls once re-ran a write transaction every 0.5 s each (0.7-0.8 of a
core while nothing changed, ingest 30-120x slower). Every waiter waits for the same thing, a batch that can
be formed, so when one tries after a change and finds none, none of the others would either: they stay
asleep. `count` numbers the changes, so a change that lands while a waiter is trying is not missed.

A waiter's deadline costs O(1) and wakes nobody: a change made while it slept woke another waiter, so it was
never this one's to try (2,000 polls expiring together once passed on a wake each, every one re-running a
formation: ~1,100 store transactions and ~12 s before the last was answered, #35).
"""

from __future__ import annotations

import asyncio


class Wakeups:
    """Changes of what a batch is formed from (data queued, envs, the run), and the waiters for them."""

    def __init__(self) -> None:
        self.count = 0
        """Changes so far: a waiter compares it with the count before its last try."""
        self._waiters: dict[asyncio.Future[bool], None] = {}
        """Those still waiting, oldest first (a dict: one that leaves is removed in O(1))."""
        self.closed = False
        """The process is stopping: nobody waits (a long-poll would hold the graceful shutdown to its end)."""

    def close(self) -> None:
        """The process is stopping: wake every waiter, and none waits again; each answers what it has now."""
        self.closed = True
        waiting, self._waiters = self._waiters, {}
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(True)

    def changed(self) -> None:
        """Something a batch may now be formed from: wake one waiter to try."""
        self.count += 1
        self.pass_on()

    def pass_on(self) -> None:
        """Wake the next waiter (one that took a batch, or was woken and left without trying, calls it)."""
        while self._waiters:
            waiter = next(iter(self._waiters))
            del self._waiters[waiter]
            if not waiter.done():
                waiter.set_result(True)
                return

    def _expire(self, waiter: asyncio.Future[bool], seen: list[int]) -> None:
        if not waiter.done():
            self._waiters.pop(waiter, None)
            seen.append(self.count)
            waiter.set_result(False)

    async def wait(self, timeout: float) -> int | None:
        """Until woken (None) or `timeout` seconds: then the count of changes when it stopped waiting. Changes
        before that woke another waiter (theirs to try); only a later one is still this waiter's to see."""
        if self.closed:
            return self.count
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiters[waiter] = None
        seen: list[int] = []
        timer = loop.call_later(max(0.0, timeout), self._expire, waiter, seen)
        try:
            woken = await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.pass_on()  # woken, then cancelled before it could try: the next waiter tries instead
            raise
        finally:
            timer.cancel()
            self._waiters.pop(waiter, None)
        return None if woken else seen[0]

    @property
    def waiting(self) -> int:
        return len(self._waiters)
