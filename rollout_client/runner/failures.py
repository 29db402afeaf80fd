"""The runner's failure policy: which failures end a run, and which tasks are never dispatched again.

Pure bookkeeping, apart from the runner's I/O so that it can be tested alone: the runner records how every
finished group ended (stored, failed, rejected by the server) and acts on the verdict (quarantine a task, end
the run). One failed group is dropped and counted; only a pattern of them (an error rate over a window, a task
that keeps failing, the server refusing group after group) says that going on is pointless.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

MAX_ERROR_RATE = 0.5
"""Default: the run ends once more than half of the last `error_window` finished groups failed."""
ERROR_WINDOW = 32
"""Finished groups (stored or failed) the error rate is measured over; the run never ends before this many."""
QUARANTINE_AFTER = 3
"""Failures of one task (by task id, in a row) after which the runner never dispatches it again."""
MAX_REJECTED_IN_A_ROW = 10
"""One rejected group (say, a transcript over max_token_len) is logged and counted; this many in a row mean
something systematic (the env or the run is misconfigured) and end the run with the server's verdict."""
TRACKED_TASKS = 100_000
"""Bound on the per-task failure counts kept for quarantine (oldest forgotten first)."""


@dataclass(frozen=True)
class Stored:
    """The server acknowledged the group of task `task_id` of env `env` (stored now, or already)."""

    env: int
    task_id: str


@dataclass(frozen=True)
class Failed:
    """The group of task `task_id` of env `env` failed before it was submitted (an error, a timeout...)."""

    env: int
    task_id: str


@dataclass(frozen=True)
class Refused:
    """The server rejected a group (validation): the group's task is not to blame, the run may be."""


Outcome = Stored | Failed | Refused


@dataclass(frozen=True)
class Verdict:
    """What the runner must do about an outcome."""

    stop: str | None = None
    """Why the run must end now, or None to go on."""
    quarantined: bool = False
    """This failure quarantined its task: it is never dispatched again."""
    failures: int = 0
    """The task's failures in a row, with this one (for a Failed outcome)."""


class FailurePolicy:
    """Tracks the error rate over the last `error_window` finished groups, each task's failures in a row and
    the server's rejections in a row. `None` for `max_error_rate` or `quarantine_after` turns that rule off."""

    def __init__(
        self,
        *,
        max_error_rate: float | None = MAX_ERROR_RATE,
        error_window: int = ERROR_WINDOW,
        quarantine_after: int | None = QUARANTINE_AFTER,
        max_rejected_in_a_row: int = MAX_REJECTED_IN_A_ROW,
        tracked_tasks: int = TRACKED_TASKS,
    ) -> None:
        if error_window < 1:
            raise ValueError(f"error_window must be at least 1, got {error_window}")
        self.max_error_rate = max_error_rate
        self.error_window = error_window
        self.quarantine_after = quarantine_after
        self.max_rejected_in_a_row = max_rejected_in_a_row
        self.tracked_tasks = tracked_tasks
        self.error_rate = 0.0
        """Failed share of the last `error_window` finished groups."""
        self.rejected_in_a_row = 0
        self._outcomes: deque[bool] = deque(maxlen=error_window)
        """Last finished groups: True for a failure."""
        self._task_failures: OrderedDict[tuple[int, str], int] = OrderedDict()
        self._quarantine: set[tuple[int, str]] = set()

    def is_quarantined(self, env: int, task_id: str) -> bool:
        return (env, task_id) in self._quarantine

    def record(self, outcome: Outcome) -> Verdict:
        if isinstance(outcome, Refused):
            self.rejected_in_a_row += 1
            if self.rejected_in_a_row >= self.max_rejected_in_a_row:
                return Verdict(stop=f"{self.rejected_in_a_row} groups in a row rejected by the server")
            return Verdict()
        key = (outcome.env, outcome.task_id)
        if isinstance(outcome, Stored):
            self.rejected_in_a_row = 0
            self._task_failures.pop(key, None)
            self._finished(False)
            return Verdict()
        failures, quarantined = self._task_failed(key)
        rate = self._finished(True)
        stop = None
        if self.max_error_rate is not None and len(self._outcomes) >= self.error_window and rate > self.max_error_rate:
            stop = f"{rate:.0%} of the last {len(self._outcomes)} groups failed (max_error_rate {self.max_error_rate})"
        return Verdict(stop=stop, quarantined=quarantined, failures=failures)

    def _task_failed(self, key: tuple[int, str]) -> tuple[int, bool]:
        """Count a failure of the task `key`: its failures in a row, and whether this one quarantines it."""
        if self.quarantine_after is None:
            return 0, False
        n = self._task_failures.pop(key, 0) + 1
        self._task_failures[key] = n  # last in the order: the oldest-touched are forgotten first
        while len(self._task_failures) > self.tracked_tasks:
            self._task_failures.popitem(last=False)
        if n >= self.quarantine_after and key not in self._quarantine:
            self._quarantine.add(key)
            return n, True
        return n, False

    def _finished(self, failed: bool) -> float:
        self._outcomes.append(failed)
        self.error_rate = sum(self._outcomes) / len(self._outcomes)
        return self.error_rate
