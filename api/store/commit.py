"""Group commit, once for both SQL backends: what is acknowledged, and when.

A store's writer thread takes the transaction functions queued meanwhile (`jobs.next_group`) and runs them
in one database transaction: each function in its own savepoint, so one that raises undoes only itself; every
caller is answered only after the COMMIT that covers it; if the COMMIT fails, the functions that succeeded
fail with it. One COMMIT (one fsync, one WAL flush) then serves up to `GROUP_MAX` requests.

The routine is written here once; a backend supplies a `Driver`: its BEGIN, SAVEPOINT, RELEASE, ROLLBACK
and COMMIT, how it runs one function, and what its errors mean (`Driver.loss`, `Driver.failed`).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from api.store.jobs import GROUP_MAX, Job, Lane, Stop, deliver, next_group


class Loss(enum.Enum):
    """What a function's error that cost the whole transaction (not only its savepoint) means for the group."""

    RETRY_OTHERS = "the function is at fault: it fails with its error, every other one runs again"
    FAIL_GROUP = "the store failed: every function of the group fails (Driver.failed)"
    FAIL_SO_FAR = "it fails with its error, those before it as after a failed COMMIT, those after it run again"


class Driver(ABC):
    """One backend's side of a group commit, on its writer (or reader) thread. The savepoint calls come only
    while a group of more than one function runs: a function alone has the transaction to itself."""

    @abstractmethod
    def begin(self, jobs: Sequence[Job]) -> None:
        """Open the transaction these functions will run in (raises if it cannot)."""

    @abstractmethod
    def call(self, job: Job) -> Any:
        """Run the job's function on a `Txn` of the open transaction; its result."""

    @abstractmethod
    def savepoint(self) -> None:
        """Mark the point the next function's undo returns to."""

    @abstractmethod
    def release(self) -> None:
        """Keep what the function since the savepoint did."""

    @abstractmethod
    def rollback_to(self) -> None:
        """Undo what the function since the savepoint did, and release it."""

    @abstractmethod
    def rollback(self) -> None:
        """Undo the whole transaction, and end it (a broken connection included)."""

    @abstractmethod
    def commit(self) -> None:
        """COMMIT, and end the transaction; raises if it failed or its outcome is unknown."""

    def committed(self) -> None:
        """After the callers of a committed group were answered."""
        return None

    @abstractmethod
    def loss(self, exc: BaseException) -> Loss | None:
        """Whether the error a function raised cost the whole transaction (and what follows), or None: only
        its own savepoint is undone."""

    @abstractmethod
    def failed(self, what: str, exc: BaseException) -> BaseException:
        """The error a caller gets when `what` failed with `exc` under its function (a new one per caller: an
        exception object raised in several tasks gets its traceback mixed)."""

    @abstractmethod
    def broken(self, exc: BaseException, jobs: Sequence[Job]) -> None:
        """The routine itself failed: clean up and answer every one of `jobs`."""


def serve(lane: Lane, driver: Driver) -> Stop | None:
    """Run groups of queued jobs until a `Stop` (returned, for the thread to answer once it closed) or an
    empty group; every caller is answered, whatever fails."""
    stop: Stop | None = None
    while stop is None:
        group, stop = next_group(lane, GROUP_MAX)
        if not group:
            break
        try:
            run(driver, group)
        except BaseException as exc:  # never leave a caller waiting
            driver.broken(exc, group)
        # Not kept while waiting for the next: a job holds its caller's data (a list's 100,000 groups), which
        # would outlive its request until another came (and be walked by the cyclic collector meanwhile).
        del group
    return stop


def run(driver: Driver, jobs: Sequence[Job]) -> None:
    """Run these functions, in as few transactions as their errors allow, and answer each."""
    left = list(jobs)
    while left:
        left = run_group(driver, [job for job in left if not job.future.cancelled()])  # nobody waits for these


def run_group(driver: Driver, jobs: list[Job]) -> list[Job]:
    """Run `jobs` in one transaction and answer them; return those to run again in another."""
    if not jobs:
        return []
    try:
        driver.begin(jobs)
    except BaseException as exc:
        for job in jobs:
            deliver(job, False, driver.failed("could not begin a transaction", exc))
        return []
    alone = len(jobs) == 1
    outcomes: list[tuple[Job, bool, Any]] = []
    for i, job in enumerate(jobs):
        try:
            if not alone:
                driver.savepoint()
            try:
                value = driver.call(job)
            except BaseException as exc:
                loss = driver.loss(exc)
                if loss is not None:
                    return _lost(driver, jobs, i, outcomes, exc, loss)
                if alone:
                    driver.rollback()
                    deliver(job, False, exc)
                    return []
                driver.rollback_to()
                outcomes.append((job, False, exc))
                continue
            if not alone:
                driver.release()
        except BaseException as exc:  # a savepoint statement failed: the transaction is not to be trusted
            return _lost(driver, jobs, i, outcomes, exc, driver.loss(exc) or Loss.FAIL_GROUP)
        outcomes.append((job, True, value))
    try:
        driver.commit()
    except BaseException as exc:
        driver.rollback()
        for job, ok, result in outcomes:
            deliver(job, False, driver.failed("COMMIT failed or its outcome is unknown", exc) if ok else result)
        return []
    for job, ok, result in outcomes:
        deliver(job, ok, result)
    driver.committed()
    return []


def _lost(
    driver: Driver, jobs: list[Job], i: int, outcomes: list[tuple[Job, bool, Any]], exc: BaseException, loss: Loss
) -> list[Job]:
    """Function `i` cost the whole transaction: roll it back and answer, or hand back, every function."""
    driver.rollback()
    if loss is Loss.FAIL_GROUP:
        for job in jobs:
            deliver(job, False, driver.failed("transaction aborted", exc))
        return []
    deliver(jobs[i], False, exc)
    if loss is Loss.RETRY_OTHERS:
        return jobs[:i] + jobs[i + 1 :]
    for job, ok, result in outcomes:
        deliver(job, False, driver.failed("transaction rolled back", exc) if ok else result)
    return jobs[i + 1 :]
