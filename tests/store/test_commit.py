"""Group commit alone (api/store/commit.py), over a driver that records what it is told: what is acknowledged,
and when. The SQL backends run the same routine against their databases in test_contract.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.store import commit as commit_module
from api.store.commit import Driver, Loss, run, serve
from api.store.jobs import GROUP_MAX, Job, Lane, Stop, deliver, next_group


class Lost(Exception):
    """An error that costs the whole transaction (the driver says what that means)."""


def _noted(step: str) -> Callable[[FakeDriver], None]:
    """A driver step that only notes that it was called."""

    def method(self: FakeDriver) -> None:
        self.log.append(step)

    return method


class FakeDriver(Driver):
    def __init__(self, loss: Loss = Loss.RETRY_OTHERS, fail_begin: int = 0, fail_commit: int = 0) -> None:
        self.log: list[str] = []
        self._loss = loss
        self.fail_begin = fail_begin
        self.fail_commit = fail_commit
        self.answered_at: dict[int, int] = {}

    def begin(self, jobs: Sequence[Job]) -> None:
        self.log.append("begin")
        if self.fail_begin:
            self.fail_begin -= 1
            raise OSError("no connection")

    def call(self, job: Job) -> Any:
        return job.fn(self)  # type: ignore[arg-type]

    savepoint = _noted("savepoint")
    release = _noted("release")
    rollback_to = _noted("rollback_to")
    rollback = _noted("rollback")

    def commit(self) -> None:
        self.log.append("commit")
        if self.fail_commit:
            self.fail_commit -= 1
            raise OSError("commit lost")

    def loss(self, exc: BaseException) -> Loss | None:
        return self._loss if isinstance(exc, Lost) else None

    def failed(self, what: str, exc: BaseException) -> BaseException:
        return RuntimeError(f"{what}: {exc}")

    def broken(self, exc: BaseException, jobs: Sequence[Job]) -> None:
        self.log.append("broken")
        for job in jobs:
            deliver(job, False, self.failed("broken", exc))


def ok(n: int) -> Callable[[FakeDriver], int]:
    def fn(d: FakeDriver) -> int:
        d.log.append(f"fn{n}")
        return n

    return fn


def raises(n: int, exc: type[BaseException] = ValueError) -> Callable[[FakeDriver], int]:
    def fn(d: FakeDriver) -> int:
        d.log.append(f"fn{n}")
        raise exc(n)

    return fn


UNANSWERED = "unanswered"


def outcomes(driver: FakeDriver, fns: list[Callable[[FakeDriver], int]]) -> list[Any]:
    """Run fns as one group; each caller's result or exception."""

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        jobs = [Job(fn, loop.create_future(), loop) for fn in fns]  # type: ignore[arg-type]
        run(driver, jobs)
        await asyncio.sleep(0)  # the answers were scheduled on this loop before run returned
        return [UNANSWERED if not j.future.done() else j.future.exception() or j.future.result() for j in jobs]

    return asyncio.run(main())


def test_each_function_in_its_savepoint_answered_after_commit() -> None:
    d = FakeDriver()
    got = outcomes(d, [ok(0), raises(1), ok(2)])
    assert got[0] == 0 and got[2] == 2 and isinstance(got[1], ValueError)
    assert d.log == [
        "begin",
        "savepoint",
        "fn0",
        "release",
        "savepoint",
        "fn1",
        "rollback_to",
        "savepoint",
        "fn2",
        "release",
        "commit",
    ]


def test_a_function_alone_has_the_transaction_to_itself() -> None:
    d = FakeDriver()
    assert outcomes(d, [ok(0)]) == [0] and d.log == ["begin", "fn0", "commit"]
    d = FakeDriver()
    [err] = outcomes(d, [raises(0)])
    assert isinstance(err, ValueError) and d.log == ["begin", "fn0", "rollback"], "nothing to commit"


def test_a_failed_commit_fails_those_that_succeeded_and_keeps_the_others_errors() -> None:
    d = FakeDriver(fail_commit=1)
    first, second = outcomes(d, [ok(0), raises(1)])
    assert isinstance(first, RuntimeError) and "COMMIT failed" in str(first)
    assert isinstance(second, ValueError)
    assert d.log[-2:] == ["commit", "rollback"]


def test_a_failed_begin_fails_every_function_unrun() -> None:
    d = FakeDriver(fail_begin=1)
    got = outcomes(d, [ok(0), ok(1)])
    assert all(isinstance(e, RuntimeError) and "could not begin" in str(e) for e in got)
    assert d.log == ["begin"]


def test_a_lost_transaction_by_the_function_at_fault_runs_the_others_again() -> None:
    d = FakeDriver(Loss.RETRY_OTHERS)
    got = outcomes(d, [ok(0), raises(1, Lost), ok(2)])
    assert got[0] == 0 and isinstance(got[1], Lost) and got[2] == 2
    assert d.log[d.log.index("rollback") :] == [
        "rollback",
        "begin",
        "savepoint",
        "fn0",
        "release",
        "savepoint",
        "fn2",
        "release",
        "commit",
    ]


def test_a_lost_transaction_by_the_store_fails_the_whole_group() -> None:
    d = FakeDriver(Loss.FAIL_GROUP)
    got = outcomes(d, [raises(0), raises(1, Lost), ok(2)])
    assert all(isinstance(e, RuntimeError) and "transaction aborted" in str(e) for e in got)
    assert "commit" not in d.log and "fn2" not in d.log


def test_a_lost_transaction_so_far_fails_those_before_and_runs_those_after() -> None:
    d = FakeDriver(Loss.FAIL_SO_FAR)
    got = outcomes(d, [ok(0), raises(1), raises(2, Lost), ok(3)])
    assert isinstance(got[0], RuntimeError) and "rolled back" in str(got[0])
    assert isinstance(got[1], ValueError) and isinstance(got[2], Lost) and got[3] == 3
    assert d.log[-4:] == ["rollback", "begin", "fn3", "commit"], "the one after runs alone, afresh"


def test_a_failing_savepoint_loses_the_transaction() -> None:
    class BadRelease(FakeDriver):
        def release(self) -> None:
            raise OSError("release failed")

    got = outcomes(BadRelease(), [ok(0), ok(1)])
    assert all(isinstance(e, RuntimeError) and "transaction aborted" in str(e) for e in got)


def test_cancelled_callers_are_not_run() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        d = FakeDriver()
        jobs = [Job(fn, loop.create_future(), loop) for fn in (ok(0), ok(1))]  # type: ignore[arg-type]
        jobs[0].future.cancel()
        run(d, jobs)
        assert await jobs[1].future == 1
        return d.log

    assert asyncio.run(main()) == ["begin", "fn1", "commit"]


def test_serve_runs_groups_until_stopped_and_answers_even_when_the_routine_breaks() -> None:
    class Breaks(FakeDriver):
        def begin(self, jobs: Sequence[Job]) -> None:
            raise OSError("no connection")

        def failed(self, what: str, exc: BaseException) -> BaseException:
            if what == "could not begin a transaction":
                raise AssertionError("a bug while answering")  # escapes the routine: serve still answers
            return super().failed(what, exc)

    async def main() -> tuple[list[Any], list[str]]:
        loop = asyncio.get_running_loop()
        d = Breaks()
        lane = Lane("x://")
        mine = [Job(fn, loop.create_future(), loop) for fn in (ok(0), ok(1))]  # type: ignore[arg-type]
        for job in mine:
            lane.jobs.put(job)
        stop = Stop(Future())
        lane.jobs.put(stop)
        assert serve(lane, d) is stop
        return list(await asyncio.gather(*(j.future for j in mine), return_exceptions=True)), d.log

    got, log = asyncio.run(main())
    assert log == ["broken"] and all(isinstance(e, RuntimeError) and "broken" in str(e) for e in got)


@given(
    st.lists(st.sampled_from(["ok", "raise", "lost"]), min_size=1, max_size=12),
    st.sampled_from(list(Loss)),
    st.integers(0, 2),
)
def test_answered_once_and_acknowledged_only_if_committed(kinds: list[str], loss: Loss, fail_commits: int) -> None:
    """Whatever fails, every caller is answered exactly once, with its result only if the function returned
    in a transaction whose COMMIT went through."""
    d = FakeDriver(loss, fail_commit=fail_commits)
    committed: set[int] = set()
    last_ran_in: dict[int, int] = {}

    def fn_for(n: int, kind: str) -> Callable[[FakeDriver], int]:
        def fn(drv: FakeDriver) -> int:
            last_ran_in[n] = drv.log.count("begin")
            if kind != "ok":
                raise (ValueError if kind == "raise" else Lost)(n)
            return n

        return fn

    def commit(original: Callable[[], None] = d.commit) -> None:
        original()  # raises while fail_commit lasts
        committed.update(n for n, txn in last_ran_in.items() if txn == d.log.count("begin"))

    d.commit = commit  # type: ignore[method-assign]
    answers: list[int] = []

    def counting(job: Job, ok: bool, value: Any) -> None:
        answers.append(id(job))
        deliver(job, ok, value)

    commit_module.deliver = counting  # type: ignore[attr-defined]
    try:
        got = outcomes(d, [fn_for(n, k) for n, k in enumerate(kinds)])
    finally:
        commit_module.deliver = deliver  # type: ignore[attr-defined]
    assert len(answers) == len(set(answers)) == len(kinds), "a caller answered twice, or never"
    for n, (kind, result) in enumerate(zip(kinds, got, strict=True)):
        assert (result == n) == (kind == "ok" and n in committed), (n, kind, result)


# ----------------------------------------------------------------------------- gathering a group (next_group)

HANG_S = 60.0
"""A delay no test may wait out: a group that waits for it shows as a thread still waiting after JOIN_S."""
JOIN_S = 20.0


def _job() -> Job:
    loop = asyncio.new_event_loop()
    try:
        return Job(ok(0), loop.create_future(), loop)  # type: ignore[arg-type]
    finally:
        loop.close()


def _gather(lane: Lane) -> tuple[threading.Thread, list[tuple[list[Job], Stop | None]]]:
    """`next_group` on a thread of its own, as the writer calls it; its result once it returned."""
    got: list[tuple[list[Job], Stop | None]] = []
    thread = threading.Thread(target=lambda: got.append(next_group(lane, GROUP_MAX)), daemon=True)
    thread.start()
    return thread, got


def _taken(lane: Lane) -> None:
    """Once the thread took what was queued (what is put next, it can only have waited for)."""
    deadline = time.monotonic() + JOIN_S
    while not lane.jobs.empty():
        assert time.monotonic() < deadline, "the thread never took the first transaction"
        time.sleep(0.001)


def test_a_lone_transaction_never_waits_for_company() -> None:
    """Nothing else is being prepared (one client): its group goes out at once, whatever the delay."""
    lane = Lane("x://", commit_delay=HANG_S)
    first = _job()
    with lane.expecting():
        lane.jobs.put(first)
        thread, got = _gather(lane)
        thread.join(JOIN_S)
        assert not thread.is_alive() and got == [([first], None)]


@pytest.mark.parametrize("then", ["transaction", "stop"])
def test_a_group_waits_for_the_transactions_being_prepared_and_no_longer(then: str) -> None:
    """Two requests in the process and one transaction queued: the group waits for the second, and goes out
    as soon as it came (not at the end of the delay); a `Stop` ends the wait too."""
    lane = Lane("x://", commit_delay=HANG_S)
    first = _job()
    after = _job() if then == "transaction" else Stop(Future())
    expected = ([first, after], None) if isinstance(after, Job) else ([first], after)
    with lane.expecting(), lane.expecting():
        lane.jobs.put(first)
        thread, got = _gather(lane)
        _taken(lane)
        lane.jobs.put(after)
        thread.join(JOIN_S)
        assert not thread.is_alive() and got == [expected]


@pytest.mark.parametrize("delay", [0.0, 0.001])
def test_a_group_goes_out_with_what_came_within_its_delay(delay: float) -> None:
    """Without a delay only what is queued goes; a request announced that never sends its transaction (it
    failed validation) costs at most one delay."""
    lane = Lane("x://", commit_delay=delay)
    first = _job()
    with lane.expecting(), lane.expecting():
        lane.jobs.put(first)
        assert next_group(lane, GROUP_MAX) == ([first], None)
    assert lane.coming == 0


def test_an_announcement_is_withdrawn_when_its_request_fails() -> None:
    lane = Lane("x://")
    try:
        with lane.expecting():
            assert lane.coming == 1
            raise ValueError("invalid group")
    except ValueError:
        pass
    assert lane.coming == 0
