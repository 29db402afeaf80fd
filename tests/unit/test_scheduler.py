"""The background jobs' scheduler (`api/scheduler.py`): a job asked many times runs once, at most once per its
interval; one that asks to run again does, once; a failure is logged and the job runs when next asked; `close`
cancels what runs and returns once it has stopped."""

from __future__ import annotations

import asyncio
import logging

import pytest

from api.errors import Unavailable
from api.scheduler import Scheduler

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def settled(jobs: Scheduler, name: str) -> None:
    """Until job `name` is no longer running (each turn of the loop lets it go on)."""
    while jobs.running(name):
        await asyncio.sleep(0)


async def test_a_job_asked_many_times_while_it_runs_runs_once() -> None:
    jobs = Scheduler()
    gate = asyncio.Event()
    runs = []

    async def job() -> None:
        runs.append(1)
        await gate.wait()

    jobs.add("j", job)
    assert jobs.ask("j")
    assert not any(jobs.ask("j") for _ in range(10))
    await asyncio.sleep(0)
    assert not jobs.ask("j")
    gate.set()
    await settled(jobs, "j")
    assert runs == [1]
    assert jobs.ask("j")  # done: the next ask runs it again
    await settled(jobs, "j")
    assert runs == [1, 1]


async def test_at_most_once_per_interval_counted_from_when_it_was_added() -> None:
    clock = Clock()
    jobs = Scheduler(clock)
    runs = []

    async def job() -> None:
        runs.append(clock.now)

    jobs.add("j", job, lambda: 10.0)
    assert not jobs.ask("j")  # a process just started has nothing to catch up on
    clock.now = 10.0
    assert jobs.ask("j")
    await settled(jobs, "j")
    clock.now = 19.0
    assert not jobs.ask("j")
    clock.now = 20.0
    assert jobs.ask("j")
    await settled(jobs, "j")
    assert runs == [10.0, 20.0]


async def test_a_job_whose_interval_is_none_does_not_run() -> None:
    jobs = Scheduler()
    on = False

    async def job() -> None:
        raise AssertionError("ran while off")

    jobs.add("j", job, lambda: 0.0 if on else None)
    assert not jobs.ask("j")
    assert not jobs.running("j")


async def test_a_job_that_asks_to_run_again_runs_once_more() -> None:
    jobs = Scheduler()
    left = [2]

    async def job() -> bool:
        left[0] -= 1
        return left[0] > 0

    jobs.add("j", job)
    jobs.ask("j")
    while left[0] > 0 or jobs.running("j"):
        await asyncio.sleep(0)
    assert left == [0]


async def test_a_failure_is_logged_and_the_job_runs_when_next_asked(caplog: pytest.LogCaptureFixture) -> None:
    jobs = Scheduler()
    runs = []

    async def job() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("boom")
        if len(runs) == 2:
            raise Unavailable("the store is down", 1)

    jobs.add("j", job)
    with caplog.at_level(logging.DEBUG, logger="rollbuf"):
        for _ in range(3):
            assert jobs.ask("j")
            await settled(jobs, "j")
    assert runs == [1, 1, 1]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "boom" in (errors[0].exc_text or "")  # the store being down is no error
    assert any("unavailable" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)


async def test_close_cancels_what_runs_and_waits_until_it_stopped() -> None:
    jobs = Scheduler()
    started, stopped = asyncio.Event(), []

    async def job() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopped.append(1)

    async def idle() -> None:
        raise AssertionError("never asked")

    jobs.add("j", job)
    jobs.add("idle", idle)
    jobs.ask("j")
    await started.wait()
    await jobs.close()
    assert stopped == [1]
    assert not jobs.running("j")
    await jobs.close()  # twice: nothing left to stop


async def test_a_timer_asks_its_job_each_interval_without_a_caller_until_close() -> None:
    jobs = Scheduler()
    runs: list[float] = []
    enough = asyncio.Event()

    async def job() -> None:
        runs.append(1)
        if len(runs) >= 3:
            enough.set()

    jobs.add("j", job, lambda: 0.01)
    jobs.keep_asking("j")
    jobs.keep_asking("j")  # once per job
    await asyncio.wait_for(enough.wait(), 10)  # nobody asks: only the timer does
    await jobs.close()
    seen = len(runs)
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(runs) == seen and not jobs.running("j"), "closed: the timer asks no more"
