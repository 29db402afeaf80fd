"""The task store's contract (`TaskTxn`, reached as `txn.tasks`): datasets of tasks, their cursors and each task's
fate (docs/tasks.md), stored beside the queue so that a lease, a submission and a trained step land in the same
transaction as the decision they record.

The logic (what a lease, a heartbeat, a drop does) is written once, in api/tasks/leases.py and fates.py and the
moves of api/tasks/states.py, over these rows; a backend only stores them. Every method costs the rows it names or
returns, never the dataset: a dataset of 10M tasks is read a page at a time and its rows exist only for tasks
that were handed out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["COLUMNS", "FRONT", "LEASED", "MISSING_BYTES", "TaskRow", "TaskTxn", "fitting", "row_of", "values_of"]

LEASED = "leased"
FRONT = "waiting"
"""Back at the front of its dataset (an expired lease, a retry): handed out before the cursor moves on."""


@dataclass(frozen=True, slots=True)
class TaskRow:
    """One task of one epoch of a dataset, from its first lease on."""

    dataset: str
    epoch: int
    index: int
    """The task's position in the dataset as registered (its line in the file, its place in the pages posted)."""
    state: str
    """One of api/tasks/states.py's STATES, written only by its moves."""
    leases: int = 0
    """How many times it was leased: a lease token names this number, so a lease that expired is told apart from
    the one that replaced it."""
    producer: str | None = None
    expires_at: float | None = None
    """Leased: when the lease ends unless heartbeated."""
    retries: int = 0
    """How many times it was offered again after a drop or a failure (the retry policy's count)."""
    ledger_id: int | None = None
    """Submitted and after: its group's ledger id."""
    step: int | None = None
    """Served or trained: the batch's step. Dropped: the step being formed when it was dropped."""
    reason: str | None = None
    """Dropped or failed (or offered again after either): why."""
    updated_at: float = 0.0
    seq: int = 0
    """Waiting: its place at the front (smaller first)."""
    holder: str | None = None
    """The name of the key that took its lease (None without keys): only that key may act on the lease."""
    nonce: str | None = None
    """The random part of its lease's token, new with each lease: a token cannot be guessed from what is shown
    (None: leased before tokens had one, docs/tasks.md)."""


class TaskTxn(ABC):
    """Synchronous view of the task tables inside the enclosing store transaction (same atomicity)."""

    # --- datasets: one record each (JSON text: its spec, cursor and tallies), rewritten as it moves ---
    @abstractmethod
    def get_dataset(self, name: str) -> str | None: ...

    @abstractmethod
    def put_dataset(self, name: str, record: str) -> None: ...

    @abstractmethod
    def dataset_names(self) -> list[str]:
        """Every dataset, by name."""

    # --- the tasks themselves (JSON text each), by index ---
    @abstractmethod
    def add_tasks(self, name: str, first: int, data: Sequence[str]) -> None:
        """Store tasks `first`, `first + 1`, ... of `name` (replacing any stored under those indices)."""

    @abstractmethod
    def task_data(self, name: str, indices: Iterable[int]) -> dict[int, str]:
        """The stored tasks of these indices (absent ones left out)."""

    def task_sizes(self, name: str, indices: Iterable[int]) -> dict[int, int]:
        """The sizes in bytes (UTF-8) of the stored tasks of these indices (absent ones left out), without reading
        the tasks into memory where the backend can."""
        return {i: len(text.encode()) for i, text in self.task_data(name, indices).items()}

    def tasks_within(self, name: str, indices: Sequence[int], max_bytes: int | None) -> tuple[int, dict[int, str]]:
        """How many of `indices`, in order, fit `max_bytes` of task data (`fitting`), and the stored tasks of those:
        a lease reply, bounded in bytes before more is read than it carries (the sizes first, then the tasks that
        fit; a backend that reads a task at a time stops at the first that does not)."""
        if max_bytes is None:
            return len(indices), self.task_data(name, indices)
        fits = fitting(self.task_sizes(name, indices), indices, max_bytes)
        return fits, self.task_data(name, indices[:fits])

    # --- rows: one per (dataset, epoch, index) handed out ---
    @abstractmethod
    def rows(self, name: str, keys: Iterable[tuple[int, int]]) -> dict[tuple[int, int], TaskRow]:
        """The rows of these (epoch, index) keys that exist."""

    @abstractmethod
    def put_rows(self, rows: Sequence[TaskRow]) -> None:
        """Write these rows (inserted, or replacing the row of the same key)."""

    @abstractmethod
    def front(self, name: str, limit: int) -> list[TaskRow]:
        """Up to `limit` waiting rows, by `seq`. On PostgreSQL, rows another transaction holds are skipped."""

    @abstractmethod
    def expired(self, name: str, now: float, limit: int) -> list[TaskRow]:
        """Up to `limit` leased rows whose lease ended by `now`, soonest first."""

    def reclaimable(self, name: str, now: float, limit: int, front: int) -> tuple[list[TaskRow], list[TaskRow]]:
        """`expired(name, now, limit)` and `front(name, front)`, both read before either is moved: what a lease
        takes, read in one round trip where the backend can."""
        return self.expired(name, now, limit), self.front(name, front) if front else []

    @abstractmethod
    def by_ledger(self, ids: Sequence[int]) -> list[TaskRow]:
        """The rows whose group has these ledger ids (ids of groups that carried no lease are skipped)."""

    @abstractmethod
    def scan(self, name: str, after: tuple[int, int], limit: int) -> list[TaskRow]:
        """Up to `limit` rows of `name` with (epoch, index) above `after`, in that order: paging for views."""


MISSING_BYTES = 4
"""What a task whose data is missing costs a reply: it goes out as `null`."""


def fitting(sizes: dict[int, int], indices: Sequence[int], max_bytes: int) -> int:
    """How many of `indices`, in order, fit `max_bytes` of task data (one at least: a task is at most
    `task_max_bytes`, so one always goes out)."""
    total = 0
    for k, index in enumerate(indices):
        total += sizes.get(index, MISSING_BYTES)
        if k and total > max_bytes:
            return k
    return len(indices)


COLUMNS = (
    "dataset, epoch, idx, state, leases, producer, expires_at, retries, ledger_id, step, reason, updated_at, seq, "
    "holder, nonce"
)
"""The SQL backends' `tasks` columns, in `TaskRow`'s order."""


def row_of(r: Sequence[object]) -> TaskRow:
    """A `tasks` row (COLUMNS) as a TaskRow."""
    return TaskRow(*r)  # type: ignore[arg-type]


def values_of(row: TaskRow) -> tuple[object, ...]:
    return (
        row.dataset,
        row.epoch,
        row.index,
        row.state,
        row.leases,
        row.producer,
        row.expires_at,
        row.retries,
        row.ledger_id,
        row.step,
        row.reason,
        row.updated_at,
        row.seq,
        row.holder,
        row.nonce,
    )
