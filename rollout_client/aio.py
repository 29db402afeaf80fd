"""Generic asyncio helpers the runner's group machinery is built on, none of them about rollouts: a blocking
call off the loop in a daemon thread, waiting for an event or anything else, the first real error of a task
group, bounded closes of an exit stack that a cancellation cannot cut short, and an all-or-nothing acquire of
async context managers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import queue
import threading
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any, TypeVar

from rollout_client.errors import ResourceExhausted, exited

log = logging.getLogger("rollout_client.group")

RELEASE_S = 30.0
"""Default bound on releasing a group's resources (a sandbox's close): past it the release is abandoned
(cancelled, logged, counted) and the group goes on; a close that hangs must not hold slots or a shutdown."""

T = TypeVar("T")


class DaemonThreads:
    """Daemon threads for blocking calls, reused: starting a thread costs the event loop about 100 µs (it
    waits for the thread to run), a hand-over to an idle one a third of that. A call that never returns keeps
    its thread, which is never handed another; the next call finds another idle thread or starts one. Idle
    threads end after `idle_s` seconds."""

    def __init__(self, idle_s: float = 30.0, name: str = "rollout-score") -> None:
        self.idle_s = idle_s
        self.name = name
        self._jobs: queue.SimpleQueue[Callable[[], Callable[[], None] | None]] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        """Counts threads waiting for a job: a submit takes one (the job is theirs) or starts a thread."""

    def submit(self, job: Callable[[], Callable[[], None] | None]) -> None:
        """Run `job()` in one of the threads; it must not raise. What it returns, if anything, is called once
        the thread counts as idle again: handing the result back there, a caller's next submit finds this
        thread idle instead of starting another."""
        if not self._idle.acquire(blocking=False):
            threading.Thread(target=self._work, name=self.name, daemon=True).start()
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                if self._idle.acquire(blocking=False):  # no submit counted on this thread: it may end
                    return
                continue  # a submit took this thread's count: its job is on the way
            hand_back = job()
            del job
            self._idle.release()
            if hand_back is not None:
                try:
                    hand_back()
                except Exception:  # a bug: this thread is counted idle already, so it must live on to take jobs
                    log.exception("a score thread's hand-back raised")
                del hand_back


_THREADS = DaemonThreads()


def _after_fork() -> None:
    """A forked child has none of the parent's threads: its idle count must not promise them jobs."""
    global _THREADS
    _THREADS = DaemonThreads()


os.register_at_fork(after_in_child=_after_fork)


async def in_daemon_thread(fn: Callable[[], T]) -> T:
    """`fn()` in a daemon thread, off the event loop: a verifier that never returns cannot block the loop
    (signals, timeouts, submits still run) nor, being a daemon, the process's exit. Cancelling this abandons
    the thread (Python cannot stop it); the worker watchdog replaces a worker that has one. Threads are
    reused (`DaemonThreads`)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def target() -> Callable[[], None]:
        try:
            result: T | None = fn()
            error: BaseException | None = None
        except Exception as exc:
            result, error = None, exc
        except BaseException as exc:  # exit() in a verifier fails its group only
            result, error = None, exited(exc)

        def hand_back() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(settle, result, error)

        return hand_back

    _THREADS.submit(target)
    return await fut


async def wait_first(event: asyncio.Event, *also: Awaitable[Any]) -> None:
    """Clear `event`, then sleep until it is set again or any of `also` completes (the rest cancelled)."""
    event.clear()
    waits = [asyncio.ensure_future(event.wait()), *(asyncio.ensure_future(a) for a in also)]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The first real error in a task group's failure (not a cancellation it caused), with the others
    attached to it as notes; None if there are only cancellations."""
    flat: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for e in exc.exceptions:
                walk(e)
        elif not isinstance(exc, asyncio.CancelledError):
            flat.append(exc)

    walk(group)
    if not flat:
        return None
    for other in flat[1:]:
        flat[0].add_note(f"also, in another rollout of the group: {type(other).__name__}: {other}")
    return flat[0]


async def outlast(fut: asyncio.Future[Any], timeout: float | None) -> tuple[bool, asyncio.CancelledError | None]:
    """Wait until `fut` is done or `timeout` s have passed, whatever cancellations of the caller arrive
    meanwhile: a release cut short by a stop would leave its unit held at the pool for good. Returns whether
    `fut` is done and the cancellation that arrived meanwhile, if one did: the caller raises it once it has
    dealt with `fut` (`timeout` still bounds how long a cancelled caller takes to end)."""
    loop = asyncio.get_running_loop()
    give_up = None if timeout is None else loop.time() + timeout
    cancelled: asyncio.CancelledError | None = None
    while not fut.done():
        left = None if give_up is None else give_up - loop.time()
        if left is not None and left <= 0:
            break
        try:
            await asyncio.wait([fut], timeout=left)
        except asyncio.CancelledError as exc:
            cancelled = exc
    return fut.done(), cancelled


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark an abandoned task's outcome as seen: no "exception was never retrieved" noise."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def bounded_close(stack: AsyncExitStack, timeout: float | None) -> bool:
    """Exit `stack` within `timeout` s: True if it did; else its exits are cancelled and abandoned (False).
    Run as its own task, so that a close that hangs cannot hold its group past `timeout`; a cancellation of
    the caller (`stop()`, a stale group, a deadline) does not cut the exits short: they finish within
    `timeout`, then the cancellation is raised, so every unit is given back to its pool on every path."""
    closing = asyncio.ensure_future(stack.aclose())
    done, cancelled = await outlast(closing, timeout)
    if not done:
        closing.cancel()
        _retrieved(closing)
        log.warning("releasing a group's resources took more than release_timeout=%s s: abandoned", timeout)
    if cancelled is not None:
        if done and not closing.cancelled() and (err := closing.exception()) is not None:
            log.warning("releasing resources as the group was cancelled: %s: %s", type(err).__name__, err)
        raise cancelled
    if done:
        closing.result()  # re-raise what the exits raised
    return done


async def release(stack: AsyncExitStack, error: BaseException, timeout: float | None = RELEASE_S) -> None:
    """Exit `stack` after `error`, which stays the error: whatever the exits raise is attached to it as notes
    (a sandbox that fails to close must not hide why the group failed). Bounded by `timeout`; a cancellation
    that arrives meanwhile is raised once the exits are done (`bounded_close`)."""
    try:
        if not await bounded_close(stack, timeout):
            error.add_note(f"releasing its resources took more than {timeout} s: abandoned")
    except asyncio.CancelledError:  # cancelled while releasing: released all the same, and the cancellation goes on
        raise
    except BaseException as close_error:
        chain: list[BaseException] = []
        e: BaseException | None = close_error
        while e is not None and e is not error and e not in chain:
            chain.append(e)
            e = e.__context__
        for c in reversed(chain):
            error.add_note(f"while releasing resources after this error: {type(c).__name__}: {c}")
        log.warning(
            "releasing resources after %s: %s: %s", type(error).__name__, type(close_error).__name__, close_error
        )


async def let_go(entering: asyncio.Future[Any], cm: AbstractAsyncContextManager[Any], timeout: float | None) -> None:
    """An acquire cancelled mid-way may already hold its unit (a remote pool took it; its answer is on the
    way): let it finish, within `timeout`, and release what it got, whatever further cancellations arrive (the
    caller is being cancelled already and raises once this returns). Past `timeout` it is abandoned, logged."""
    done, _ = await outlast(entering, timeout)
    if not done:
        entering.cancel()
        _retrieved(entering)
        log.warning(
            "a cancelled resource acquire did not finish within release_timeout=%s s: abandoned (the "
            "pool may still hold its unit)",
            timeout,
        )
        return
    if entering.cancelled() or entering.exception() is not None:
        return  # it holds nothing
    exiting = asyncio.ensure_future(cm.__aexit__(None, None, None))
    done, _ = await outlast(exiting, timeout)
    if not done:
        exiting.cancel()
        _retrieved(exiting)
        log.warning("releasing a resource after a cancelled acquire took more than %s s: abandoned", timeout)
    elif not exiting.cancelled() and (err := exiting.exception()) is not None:
        log.warning("releasing a resource after a cancelled acquire: %s: %s", type(err).__name__, err)


async def acquire_all(
    cms: Sequence[AbstractAsyncContextManager[Any]],
    release_timeout: float | None = RELEASE_S,
    on_stuck: tuple[float, Callable[[int, int], None]] | None = None,
) -> tuple[list[Any], AsyncExitStack]:
    """Enter every context manager concurrently; all succeed or none is held.

    A cancellation (`stop()`, a stale group, a timeout) does not cut an acquire short: each one in progress
    finishes (within `release_timeout`) and what it got is released, so a remote pool keeps no unit for it.

    On a failure the others are cancelled, whatever was entered is exited, and the first real error (not a
    cancellation it caused) is raised, with any error from the exits attached as notes. A ResourceExhausted
    ("not now") cancels nothing: the others finish entering, then all are exited and it is raised. On success
    the returned stack exits them all.
    """
    entered: dict[int, Any] = {}
    held: list[AbstractAsyncContextManager[Any]] = []
    stack = AsyncExitStack()

    async def exit_all(exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        """Exit every held one at once: one cancellation reaches every exit (a bounded release that gives
        up on closes that hang cancels them all, not one after another)."""
        results = await asyncio.gather(
            *(cm.__aexit__(exc_type, exc, tb) for cm in reversed(held)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException) and r is not exc]
        for other in errors[1:]:
            errors[0].add_note(f"also, releasing another resource: {type(other).__name__}: {other}")
        if errors:
            raise errors[0]
        return False

    stack.push_async_exit(exit_all)

    exhausted: list[ResourceExhausted] = []

    async def enter(i: int, cm: AbstractAsyncContextManager[Any]) -> None:
        entering = asyncio.ensure_future(cm.__aenter__())
        try:
            value = await asyncio.shield(entering)
        except asyncio.CancelledError:
            await let_go(entering, cm, release_timeout)
            raise
        except ResourceExhausted as exc:  # "not now": the others finish entering (a cancelled acquire could
            exhausted.append(exc)  # leave its resource taken at the pool), then all are released
            return
        entered[i] = value  # no await between entering and recording: a cancellation cannot lose it
        held.append(cm)

    def stuck() -> None:
        if on_stuck is not None and 0 < len(held) < len(cms):
            on_stuck[1](len(held), len(cms))

    watch = asyncio.get_running_loop().call_later(on_stuck[0] if on_stuck else math.inf, stuck)
    try:
        async with asyncio.TaskGroup() as tg:
            for i, cm in enumerate(cms):
                tg.create_task(enter(i, cm))
        watch.cancel()
        if exhausted:
            raise exhausted[0]
    except BaseExceptionGroup as group:
        watch.cancel()
        real = first_error(group)
        await release(stack, real or group, release_timeout)
        if real is not None:
            raise real from None
        raise
    except BaseException as exc:
        watch.cancel()
        await release(stack, exc, release_timeout)
        raise
    return [entered[i] for i in range(len(cms))], stack
