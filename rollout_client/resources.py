"""Shared resource pools: admission against a known capacity, acquiring in turn from a pool of unknown size,
and acquiring from a pool that answers "exhausted".

Two ways a pool of sandboxes deadlocks or fails a run: groups that each hold part of it and wait for the
rest (G=8 on a pool of 8, two groups in flight: 4 each, forever), and a capped server that answers
"exhausted" (every group that meets it fails). `Capacity` admits work only when its whole need fits (the
runner takes a group-scored group's G units at once, a rollout run on its own one unit), so no holder ever
waits for a unit another holder has. Without a known capacity, `Turns` lets one group at a time acquire its
units: the only group that can hold part of the pool while it waits is the one acquiring, and the units it
waits for are held by groups that hold all theirs and give them back as they end. `acquire_backing_off`
treats ResourceExhausted as "wait": it lets go of everything the attempt holds (no hold-and-wait), backs off
with jitter and tries again, up to a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from rollout_client.env import Environment
from rollout_client.errors import ResourceExhausted, ResourceTimeout

log = logging.getLogger("rollout_client.resources")

HOLD_WARN_S = 30.0
"""A group that has held part of its resources this long, waiting for the rest, is reported (once per env and
process): a pool of unknown size that the rest of the run, or others, keep from it."""

BACKOFF_S = 0.05
"""First wait after an "exhausted" answer; doubled per answer in a row, up to MAX_BACKOFF_S, jittered."""
MAX_BACKOFF_S = 2.0


def backoff(attempt: int, retry_after: float | None, rng: random.Random) -> float:
    """Seconds to wait after the `attempt`-th exhausted answer in a row (from 0): exponential, capped,
    full jitter above half (waiters that met the same full pool do not come back in step), never under the
    pool's own `retry_after`."""
    ceiling = min(MAX_BACKOFF_S, BACKOFF_S * 2.0 ** min(attempt, 64))  # 2.0**1024 overflows (acquire_timeout=None)
    wait = ceiling / 2 + rng.random() * ceiling / 2
    return max(wait, retry_after or 0.0)


async def acquire_backing_off(
    acquire: Callable[[], Any],
    timeout: float | None,
    rng: random.Random | None = None,
) -> tuple[list[Any], AsyncExitStack]:
    """`await acquire()` (an all-or-nothing acquire: it holds nothing when it raises) again after each
    ResourceExhausted, backing off, until it succeeds or `timeout` s have passed (then ResourceTimeout, its
    `__cause__` the last exhausted answer). Any other error is raised at once."""
    rng = rng or random.Random()
    loop = asyncio.get_running_loop()
    give_up = None if timeout is None else loop.time() + timeout
    attempt = 0
    while True:
        try:
            result: tuple[list[Any], AsyncExitStack] = await acquire()
            return result
        except ResourceExhausted as exc:
            wait = backoff(attempt, exc.retry_after, rng)
            attempt += 1
            if give_up is not None and loop.time() + wait > give_up:
                raise ResourceTimeout(
                    f"resources stayed exhausted for acquire_timeout={timeout} s ({attempt} tries)"
                ) from exc
            await asyncio.sleep(wait)


class Capacity:
    """`size` units of a shared pool (None: unbounded). `take(n)` waits, first come first served, until `n`
    are free and takes them all at once; `try_take(n)` takes them only if free now; `give(n)` returns them."""

    def __init__(self, size: int | None) -> None:
        self.size = size
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def fits(self, n: int) -> bool:
        return self.size is None or (self.used + n <= self.size and not self._waiters)

    def try_take(self, n: int) -> bool:
        if not self.fits(n):
            return False
        self.used += n
        return True

    async def take(self, n: int) -> None:
        if self.try_take(n):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif fut.done() and not fut.cancelled():
                self.give(n)  # granted as it was cancelled: hand the units on
            self._wake()
            raise

    def give(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.size is not None:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.used + n > self.size:
                return
            self._waiters.popleft()
            self.used += n
            fut.set_result(None)


def own_resources(env: Environment) -> bool:
    """Whether `env` holds something per rollout: `resource` overridden on its class or set on the instance
    (else each rollout gets a null context, which nothing need acquire)."""
    return getattr(env.resource, "__func__", None) is not Environment.resource


def takes_turns(env: Environment) -> bool:
    """Whether a group of `env` acquires its units in turn (`Turns`): it takes several at once (its G rollouts
    run together) from a pool whose size the runner does not know (no `max_resources`)."""
    return own_resources(env) and env.max_resources is None and not env.scores_each_rollout and env.group_size > 1


class Turns:
    """One group of the runner at a time acquires its units, first come first served; it holds the turn from
    the start of an attempt until it holds all its units (or the attempt ends), then the next group takes it.
    The only group that can hold part of the pool while it waits is then the one with the turn, and what it
    waits for is held by groups that hold all theirs and give them back as they end: no set of groups can
    wait for each other. The cost: groups of such envs acquire one after another (a group's own units still
    concurrently); `max_resources` lifts it, since admission already keeps the groups within the pool."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[Callable[[], None]]:
        """Wait for the turn; yields what to call once the group holds all its units (it ends the turn early;
        leaving the block ends it otherwise)."""
        await self._lock.acquire()
        holding = True

        def acquired() -> None:
            nonlocal holding
            if holding:
                holding = False
                self._lock.release()

        try:
            yield acquired
        finally:
            acquired()


def warn_unbounded_pool(env: Environment) -> tuple[float, Callable[[int, int], None]] | None:
    """For an env without `max_resources`: what warns, once per process, that a group has held part of its
    resources for HOLD_WARN_S while waiting for the rest. Its groups take turns to acquire (`Turns`), so they
    cannot deadlock each other: the rest is held by groups still running (a long wait, not a deadlock), by
    other users of the pool (other producers), or the pool is smaller than the group. The warning says which
    and names the fix."""
    if env.max_resources is not None:
        return None

    def warn(held: int, n: int) -> None:
        if env.name in _warned_pools:
            return
        _warned_pools.add(env.name)
        log.warning(
            "env %r: a group has held %d of its %d resources for %.0f s, waiting for the rest. Its groups acquire one "
            "at a time, so they cannot deadlock each other: the rest is held by rollouts still running, or by other "
            "users of the pool (another producer), or resource() draws from a pool of fewer than %d units, which "
            "never fills a group. Set max_resources = <the pool's capacity> on %s (the runner then admits a group "
            "only when all its units are free), or raise ResourceExhausted from resource() when the pool is full",
            env.name,
            held,
            n,
            HOLD_WARN_S,
            n,
            type(env).__name__,
        )

    return HOLD_WARN_S, warn


_warned_pools: set[str] = set()
