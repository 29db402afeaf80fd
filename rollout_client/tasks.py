"""Where tasks come from: a task source hands out the next task and hears each group's mean score, so a
curriculum can adapt what it hands out next. A source may also hear of every task whose group ends without a
score, so that a source that remembers what it handed out can forget it, and one that leases its tasks
(`LeasedTasks`) can end the lease as it should: `fail(task, reason)` when the rollout failed (an error, a
timeout, a group skipped or rejected, a task quarantined), `hand_back(task)` when it was never tried to its end
(the run stopped, it went stale, a pause ran out of time, it was not sent). A source with neither has
`discard(task)` called for both (`ended_unscored`)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import count
from typing import Protocol

from rollout_client.env import Task
from rollout_client.runner.lifecycle import unless_stopped

log = logging.getLogger("rollout_client.tasks")


class TaskSource(Protocol):
    def next_task(self) -> Task | None:
        """The next task, or None when there are no more."""
        ...

    def report(self, task: Task, mean_score: float) -> None:
        """The mean score of the group rolled out for `task` (called once per submitted group)."""
        ...


def ended_unscored(source: object, task: Task, reason: str | None) -> None:
    """Tell `source` that `task`'s group ended without a score: its rollout failed for `reason`, or, with None,
    it was never tried to its end. Calls the source's `fail` or `hand_back` where it has it, else `discard`,
    else nothing (a plain source need not hear of it)."""
    if reason is None and (hand_back := getattr(source, "hand_back", None)) is not None:
        hand_back(task)
        return
    if reason is not None and (fail := getattr(source, "fail", None)) is not None:
        fail(task, reason)
        return
    discard = getattr(source, "discard", None)
    if discard is not None:
        discard(task)


async def next_task(source: TaskSource) -> Task | None:
    """The source's next task: awaited from `anext_task` where it has one (a source that asks a server, as
    `LeasedTasks`), else `next_task`."""
    anext = getattr(source, "anext_task", None)
    if anext is not None:
        task: Task | None = await anext()
        return task
    return source.next_task()


async def next_task_unless(source: TaskSource, stopping: asyncio.Event) -> Task | None:
    """`next_task(source)`, or None when `stopping` is set first: a source that waits on a server (`anext_task`)
    must not hold up a run that stops."""
    if getattr(source, "anext_task", None) is None:
        return source.next_task()
    got: list[Task | None] = []

    async def get() -> None:
        got.append(await next_task(source))

    await unless_stopped(stopping, get())
    return got[0] if got else None


class Tasks:
    """Tasks from an iterable (cycled with `cycle=True`) or a function of a running index."""

    def __init__(self, tasks: Iterable[Task] | Callable[[int], Task], *, cycle: bool = False) -> None:
        if callable(tasks):
            make = tasks
            self._it: Iterator[Task] = (make(i) for i in count())
        else:
            items = list(tasks) if cycle else tasks
            self._it = (t for _ in count() for t in items) if cycle and items else iter(items)

    def next_task(self) -> Task | None:
        return next(self._it, None)

    def report(self, task: Task, mean_score: float) -> None:
        """Plain sources do not adapt."""

    def discard(self, task: Task) -> None:
        """Plain sources remember nothing."""


class Curriculum:
    """Levels of difficulty: moves up a level when the mean score of its last `window` groups reaches
    `promote`, down when it falls below `demote`. Pure bookkeeping; no I/O.

    A level whose tasks run out is left for the next one up (or, at the top, the nearest one below that
    still has tasks), with a warning: the curriculum ends only when every level is exhausted. Task ids may
    repeat (the same task handed out again): each handout is remembered apart."""

    def __init__(
        self, levels: Sequence[TaskSource], *, window: int = 8, promote: float = 0.8, demote: float = 0.2
    ) -> None:
        if not levels:
            raise ValueError("a curriculum needs at least one level")
        if not 0.0 <= demote < promote:
            raise ValueError(f"need 0 <= demote < promote, got demote={demote}, promote={promote}")
        self.levels = list(levels)
        self.level = 0
        self.window = window
        self.promote = promote
        self.demote = demote
        self._recent: deque[float] = deque(maxlen=window)
        self._level_of: dict[str, list[int]] = {}
        """Task id -> the level of each handout of it not reported yet (ids may repeat)."""
        self.exhausted = [False] * len(self.levels)

    def next_task(self) -> Task | None:
        while True:
            task = self.levels[self.level].next_task()
            if task is not None:
                self._level_of.setdefault(task.id, []).append(self.level)
                return task
            self.exhausted[self.level] = True
            left = [i for i, x in enumerate(self.exhausted) if not x]
            if not left:
                return None
            above = [i for i in left if i > self.level]
            nxt = above[0] if above else left[-1]
            log.warning("curriculum: level %d has no tasks left; moving to level %d", self.level, nxt)
            self.level = nxt
            self._recent.clear()

    def _take(self, task: Task) -> int | None:
        """The level `task` was handed out at (this level's handout first, where the id was handed out at
        several), forgotten."""
        levels = self._level_of.get(task.id)
        if not levels:
            return None
        level = self.level if self.level in levels else levels[0]
        levels.remove(level)
        if not levels:
            del self._level_of[task.id]
        return level

    def discard(self, task: Task) -> None:
        """The group for `task` ended without a score: forget which level it came from."""
        self._unscored(task, None, fallback=True)

    def fail(self, task: Task, reason: str) -> None:
        """The rollout of `task` failed: forget its level, and tell the level (`ended_unscored`)."""
        self._unscored(task, reason)

    def hand_back(self, task: Task) -> None:
        """`task` was never tried to its end: forget its level, and tell the level (`ended_unscored`)."""
        self._unscored(task, None)

    def _unscored(self, task: Task, reason: str | None, *, fallback: bool = False) -> None:
        level = self._take(task)
        if level is None:
            return
        if fallback:  # `discard` from a caller that cannot say why: the level's own `discard`
            discard = getattr(self.levels[level], "discard", None)
            if discard is not None:
                discard(task)
            return
        ended_unscored(self.levels[level], task, reason)

    def report(self, task: Task, mean_score: float) -> None:
        level = self._take(task)
        if level != self.level:
            return  # a group started before the last level change says nothing about this level
        self.levels[level].report(task, mean_score)
        self._recent.append(mean_score)
        if len(self._recent) < self.window:
            return
        mean = sum(self._recent) / len(self._recent)
        if mean >= self.promote and (up := self._open(range(self.level + 1, len(self.levels)))) is not None:
            self.level = up
            self._recent.clear()
        elif mean < self.demote and (down := self._open(range(self.level - 1, -1, -1))) is not None:
            self.level = down
            self._recent.clear()

    def _open(self, order: Iterable[int]) -> int | None:
        """The first level in `order` that still has tasks."""
        return next((i for i in order if not self.exhausted[i]), None)
