"""What the SQL backends share: the hand-off between the event loop and a store's writer thread, and the
sizes in which it commits and reads.

A caller's function travels to the writer thread as a `Job` through a `Lane`; its result travels back to the
caller's own event loop, which may be closed by then (the caller gave up): that is not the writer's problem.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from api.store.base import Txn


@dataclass(slots=True)
class Job:
    fn: Callable[[Txn], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    replies: Sequence[str] = ()
    """Idempotency keys `fn` will look up (`Store.transact`)."""


@dataclass(slots=True)
class Stop:
    """Asks the writer thread to finish what it holds and exit; `done` resolves once it has."""

    done: Future[None]


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


Jobs = queue.SimpleQueue[Job | Stop]


class _Announcement:
    """`Lane.expecting`: counts one more transaction coming while entered (reentrant: it holds no state of
    its own)."""

    __slots__ = ("_lane",)

    def __init__(self, lane: Lane) -> None:
        self._lane = lane

    def __enter__(self) -> None:
        self._lane.coming += 1

    def __exit__(self, *exc: object) -> None:
        self._lane.coming -= 1


class Lane:
    """The queue of jobs one thread runs, and whether that thread still takes them: submitting and stopping
    from the event loop, refusing from the thread once it stops (`accepting` is changed and checked under a
    lock around every put, so no job is queued after the thread answered those left).

    `coming` counts the transactions the event loop is preparing (`expecting`: requests decoding their groups),
    for the thread to gather them into the group it is about to commit (`next_group`)."""

    def __init__(self, url: str, commit_delay: float = 0.0) -> None:
        self.url = url
        self.jobs: Jobs = queue.SimpleQueue()
        self.commit_delay = commit_delay
        self.coming = 0
        self._announcement = _Announcement(self)
        self._accepting = True
        self._lock = threading.Lock()

    def expecting(self) -> AbstractContextManager[None]:
        """Around the preparation and submission of a transaction, on the event loop (the only thread that
        changes `coming`; the writer only reads it). One object for every request: it is on ingest's path."""
        return self._announcement

    async def submit(self, fn: Callable[[Txn], Any], replies: Sequence[str] = ()) -> Any:
        """Queue fn for the thread; its result (or exception) once the thread answered."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            if not self._accepting:
                raise RuntimeError(f"store {self.url} is closed")
            self.jobs.put(Job(fn, future, loop, replies))
        return await future

    async def stop(self) -> None:
        """Ask the thread to finish what it holds and stop taking jobs; returns once it has."""
        done: Future[None] = Future()
        with self._lock:
            if self._accepting:
                self.jobs.put(Stop(done))
            else:  # the thread already ended
                done.set_result(None)
        await asyncio.wrap_future(done)

    def refuse(self) -> None:
        """From the thread, once it stops taking jobs (asked to, or failed)."""
        with self._lock:
            self._accepting = False


GROUP_MAX = 64
"""Most transaction functions committed together: bounds how long one waits for those queued before it."""
HEAD_CHUNKS = (32, 256, 2048)
"""Rows read at a time from the head of a queue, growing: a batch window rarely needs more than the first."""


def head_chunk_sizes() -> Iterator[int]:
    """HEAD_CHUNKS, then the last of them for ever."""
    yield from HEAD_CHUNKS
    while True:
        yield HEAD_CHUNKS[-1]


def next_group(lane: Lane, limit: int) -> tuple[list[Job], Stop | None]:
    """Wait for the next job, then take what else is queued, up to `limit`: the functions committed together.
    A `Stop` ends the group (what came before it still runs); it is returned for the thread to exit after.

    When the event loop is preparing more transactions than the group holds (`Lane.coming`: other requests
    are in the process), the group waits for them up to `lane.commit_delay`, and no longer than until they
    all came, as PostgreSQL's `commit_delay` does when `commit_siblings` are active. A commit costs about as
    much as the functions it covers (BEGIN, the write lock, the COMMIT's page writes: every commit rewrites the
    last page of each table it appends to), and a group that goes out at once leaves out the clients answered
    by the commit before, whose next requests arrive just after it: with SQLite at 8 clients, a commit holds
    4.4 groups without the wait and 7.6 with it, and a small group's server CPU is 0.29 ms without it and 0.24
    with it (docs/benchmarks-settings.md). A lone client never waits: nothing else is coming."""
    jobs = lane.jobs
    first = jobs.get()
    if isinstance(first, Stop):
        return [], first
    group = [first]
    deadline: float | None = None
    while len(group) < limit:
        try:
            more = jobs.get_nowait()
        except queue.Empty:
            if lane.commit_delay <= 0 or lane.coming <= len(group):  # nothing more is on its way
                break
            if deadline is None:
                deadline = time.monotonic() + lane.commit_delay
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                more = jobs.get(timeout=left)
            except queue.Empty:
                break
        if isinstance(more, Stop):
            return group, more
        group.append(more)
    return group, None


def refuse_left(jobs: Jobs, url: str, stop: Stop | None) -> None:
    """Once the writer thread stopped taking jobs: answer those queued meanwhile (the store is closed, never
    a hang), then whoever asked it to stop."""
    while True:
        try:
            left = jobs.get_nowait()
        except queue.Empty:
            break
        if isinstance(left, Job):
            deliver(left, False, RuntimeError(f"store {url} is closed"))
        else:
            left.done.set_result(None)
    if stop is not None:
        stop.done.set_result(None)


def deliver(job: Job, ok: bool, value: Any) -> None:
    """Hand a result (ok) or an exception back to the job's caller, from any thread."""
    try:
        job.loop.call_soon_threadsafe(_settle, job.future, ok, value)
    except RuntimeError:  # that event loop is closed: nobody waits for the answer any more
        pass
