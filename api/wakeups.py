"""Waking long-polling trainers: each change wakes one waiter, and a waiter that then takes a batch wakes the
next. 2,000 waiting `/batch?wait=` long-polls once re-ran a write transaction every 0.5 s each (0.7-0.8 of a
core while nothing changed, ingest 30-120x slower). Every waiter waits for the same thing, a batch that can
be formed, so when one tries after a change and finds none, none of the others would either: they stay
asleep. `count` numbers the changes, so a change that lands while a waiter is trying is not missed.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Wakeups:
    """Changes of what a batch is formed from (data queued, envs, the run), and the waiters for them."""

    def __init__(self) -> None:
        self.count = 0
        """Changes so far: a waiter compares it with the count before its last try."""
        self._waiters: deque[asyncio.Future[None]] = deque()

    def changed(self) -> None:
        """Something a batch may now be formed from: wake one waiter to try."""
        self.count += 1
        self.pass_on()

    def pass_on(self) -> None:
        """Wake the next waiter (one that took a batch, or was woken and left without trying, calls it)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def wait(self, timeout: float) -> bool:
        """Until woken (True) or `timeout` seconds (False)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            if not waiter.done():
                waiter.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())
