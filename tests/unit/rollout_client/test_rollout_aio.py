"""The generic asyncio helpers (rollout_client/aio.py) that are not covered with the group machinery."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from rollout_client.aio import DaemonThreads, first_error, in_daemon_thread, wait_first

pytestmark = pytest.mark.anyio


async def test_wait_first_returns_on_the_event_or_on_anything_else_() -> None:
    changed = asyncio.Event()
    changed.set()  # set before: cleared first, so only a new change counts
    other = asyncio.Event()
    waiting = asyncio.create_task(wait_first(changed, other.wait()))
    await asyncio.sleep(0)
    assert not waiting.done()
    other.set()
    await waiting
    waiting = asyncio.create_task(wait_first(changed))
    await asyncio.sleep(0)
    changed.set()
    await waiting


def test_first_error_skips_the_cancellations_and_notes_the_others() -> None:
    group = BaseExceptionGroup("g", [asyncio.CancelledError(), ValueError("first"), KeyError("second")])
    error = first_error(group)
    assert isinstance(error, ValueError) and "KeyError" in (error.__notes__ or [""])[0]
    assert first_error(BaseExceptionGroup("g", [asyncio.CancelledError()])) is None


async def test_daemon_threads_are_reused_and_a_hung_call_keeps_only_its_own() -> None:
    """Calls one after another run on one thread; a call that never returns holds its thread and no other
    call waits behind it; an exit() in the call fails it without ending anything else."""
    before = {t.ident for t in threading.enumerate() if t.name == "rollout-score"}  # idle ones of earlier tests
    names = {await in_daemon_thread(lambda: threading.get_ident()) for _ in range(20)}
    # One started if none was idle, then handed each call in turn: a thread counts as idle before it hands the
    # result back, so the next call always finds one (threads of earlier tests may take some calls too).
    assert len(names - before) <= 1
    hang = threading.Event()
    stuck = asyncio.ensure_future(in_daemon_thread(hang.wait))
    try:
        assert await asyncio.wait_for(in_daemon_thread(lambda: 7), 10) == 7
        with pytest.raises(BaseException, match="SystemExit"):
            await in_daemon_thread(lambda: exit(3))
        assert await asyncio.wait_for(in_daemon_thread(lambda: 8), 10) == 8
    finally:
        hang.set()
        await stuck


def test_idle_daemon_threads_end_and_new_calls_start_others() -> None:
    pool = DaemonThreads(idle_s=0.01, name="idle-test")
    ran: list[str] = []
    done = threading.Event()

    def job() -> None:
        ran.append(threading.current_thread().name)
        done.set()

    pool.submit(job)
    assert done.wait(10)
    first = next(t for t in threading.enumerate() if t.name == "idle-test" and t.daemon)
    first.join(10)  # idle past idle_s: it ends
    assert not first.is_alive()
    done.clear()
    pool.submit(job)
    assert done.wait(10) and ran == ["idle-test", "idle-test"]


def test_a_thread_counts_as_idle_before_it_hands_the_result_back() -> None:
    """What a job hands back runs once its thread counts as idle: a submit made from there (as the caller's
    next call, woken by the result, is) goes to that thread rather than starting another."""
    pool = DaemonThreads(name="hand-back-test")
    ran: list[int] = []
    done = threading.Event()

    def second() -> None:
        ran.append(threading.get_ident())
        done.set()

    def first() -> Callable[[], None]:
        ran.append(threading.get_ident())
        return lambda: pool.submit(second)

    pool.submit(first)
    assert done.wait(10)
    assert len(ran) == 2 and ran[0] == ran[1]
    assert sum(t.name == "hand-back-test" for t in threading.enumerate()) == 1


def test_a_hand_back_that_raises_leaves_its_thread_serving() -> None:
    """A hand-back must not raise; if one does, its thread (already counted idle) goes on taking jobs: a thread
    that ended there would leave a count behind that the next submit takes, its job then never run."""
    pool = DaemonThreads(name="raising-hand-back-test")
    raising, done = threading.Event(), threading.Event()

    def broken() -> None:
        raising.set()  # its thread counts as idle by now
        raise RuntimeError("a bug in a hand-back")

    pool.submit(lambda: broken)
    assert raising.wait(10)
    pool.submit(done.set)  # takes that thread's idle count: the job is queued for it
    assert done.wait(10), "the job after a failed hand-back never ran"
    assert sum(t.name == "raising-hand-back-test" for t in threading.enumerate()) == 1
