"""Where tasks come from: a task source hands out the next task and hears each group's mean score, so a
curriculum can adapt what it hands out next. A source may also have `discard(task)`: the runner calls it for
every task whose group ends without a score (stale, failed, rejected, stopped, quarantined), so a source
that remembers what it handed out can forget it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import count
from typing import Protocol

from rollout_client.env import Task


class TaskSource(Protocol):
    def next_task(self) -> Task | None:
        """The next task, or None when there are no more."""
        ...

    def report(self, task: Task, mean_score: float) -> None:
        """The mean score of the group rolled out for `task` (called once per submitted group)."""
        ...


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
    `promote`, down when it falls below `demote`. Pure bookkeeping; no I/O."""

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
        self._level_of: dict[str, int] = {}

    def next_task(self) -> Task | None:
        task = self.levels[self.level].next_task()
        if task is not None:
            self._level_of[task.id] = self.level
        return task

    def discard(self, task: Task) -> None:
        """The group for `task` ended without a score: forget which level it came from."""
        level = self._level_of.pop(task.id, None)
        discard = getattr(self.levels[level], "discard", None) if level is not None else None
        if discard is not None:
            discard(task)

    def report(self, task: Task, mean_score: float) -> None:
        level = self._level_of.pop(task.id, None)
        if level != self.level:
            return  # a group started before the last level change says nothing about this level
        self.levels[level].report(task, mean_score)
        self._recent.append(mean_score)
        if len(self._recent) < self.window:
            return
        mean = sum(self._recent) / len(self._recent)
        if mean >= self.promote and self.level + 1 < len(self.levels):
            self.level += 1
            self._recent.clear()
        elif mean < self.demote and self.level > 0:
            self.level -= 1
            self._recent.clear()
