"""Background jobs of one process, by name: each runs in a task of its own when asked, never twice at once, at
most once per its interval, and all stop with one `close()`. Jobs are declared as `Periodic` values beside the
state they keep (the open-group sweep's is `Rollouts.job`), and `Service` adds the list. A job that fails is
logged and asked again later, never fatal to its caller. A job whose work falls due by the clock rather than by
a request is also asked by a timer (`keep_asking`): a deadline passes while no client calls."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from api.errors import Unavailable

log = logging.getLogger("rollbuf")


IDLE_S = 1.0
"""How long a timer (`keep_asking`) waits before it reads again the interval of a job that is off (None)."""
MIN_WAIT_S = 0.01
"""Least wait of a timer whose job still runs (an interval of 0 never spins)."""


def always() -> float | None:
    return 0.0


@dataclass(frozen=True, slots=True)
class Periodic:
    """A background job as its flow declares it (as arq declares `cron(...)` jobs): asked by requests, and also by
    a timer when its work falls due by the clock (`by_clock`)."""

    name: str
    run: Callable[[], Awaitable[bool | None]]
    """The work; True when it wants to run again at once (what it was asked for came in while it ran)."""
    every: Callable[[], float | None] = always
    """Least seconds between two starts, read when asked (None: not now)."""
    by_clock: bool = False
    """Asked by a timer too (`Scheduler.keep_asking`, once the service starts): a deadline passes while no
    client calls."""


@dataclass(slots=True)
class Job:
    run: Callable[[], Awaitable[bool | None]]
    """The work; True when it wants to run again at once (what it was asked for came in while it ran)."""
    every: Callable[[], float | None]
    """Least seconds between two starts, read when asked (None: not now)."""
    started: float
    """When (monotonic) it last started, or was added."""
    task: asyncio.Task[None] | None = None


class Scheduler:
    """Named jobs run soon, once: asked many times while one runs (or before its interval has passed since it
    last started), a job still runs once."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._jobs: dict[str, Job] = {}
        self._timers: dict[str, asyncio.Task[None]] = {}

    def add(
        self, name: str, run: Callable[[], Awaitable[bool | None]], every: Callable[[], float | None] = always
    ) -> None:
        """Name a job; its interval counts from now (a process just started has nothing to catch up on)."""
        self._jobs[name] = Job(run, every, self._clock())

    def declare(self, job: Periodic) -> None:
        """Add a flow's job (`add`)."""
        self.add(job.name, job.run, job.every)

    def ask(self, name: str) -> bool:
        """Start job `name` in the background unless it is running or ran less than its interval ago; whether
        it started."""
        job = self._jobs[name]
        every = job.every()
        now = self._clock()
        if every is None or job.task is not None or now - job.started < every:
            return False
        job.started = now
        job.task = asyncio.get_running_loop().create_task(self._run(name, job))
        return True

    def keep_asking(self, name: str) -> None:
        """Ask job `name` each time its interval has passed, until `close()` (from a running loop; once per job)."""
        if name not in self._timers:
            self._timers[name] = asyncio.get_running_loop().create_task(self._timer(name))

    async def _timer(self, name: str) -> None:
        job = self._jobs[name]
        while True:
            every = job.every()
            if every is None:
                await asyncio.sleep(IDLE_S)
                continue
            left = every - (self._clock() - job.started)
            if left > 0:
                await asyncio.sleep(left)
            elif not self.ask(name):  # it runs still: look again after its interval
                await asyncio.sleep(max(every, MIN_WAIT_S))

    def running(self, name: str) -> bool:
        return self._jobs[name].task is not None

    async def _run(self, name: str, job: Job) -> None:
        again = False
        try:
            again = bool(await job.run())
        except Unavailable as exc:  # the store is down: the next time it is asked tries again
            log.debug("background job %s: the store is unavailable (%s)", name, exc)
        except Exception:
            log.exception("background job %s failed; it runs again when next asked", name)
        finally:
            job.task = None
        if again:
            job.started = self._clock()
            job.task = asyncio.get_running_loop().create_task(self._run(name, job))

    async def close(self) -> None:
        """Cancel every timer and running job and wait until each has stopped; none starts afterwards unless asked."""
        tasks = [*self._timers.values(), *(job.task for job in self._jobs.values() if job.task is not None)]
        self._timers = {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for job in self._jobs.values():
            job.task = None
