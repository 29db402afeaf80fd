"""The in-process backend's task tables (`TaskTxn` over dicts), undone with the enclosing `MemoryTxn`.

The front and the leases are kept apart from the rows, so that `front` and `expired` cost what is waiting or
leased (bounded by the lease settings), not the tasks handed out.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from api.store.tasks import FRONT, LEASED, TaskRow, TaskTxn

if TYPE_CHECKING:
    from api.store.memory.state import Undo

Key = tuple[str, int, int]
_ABSENT = object()


class TaskState:
    """Every dataset's tables, as one process holds them."""

    def __init__(self) -> None:
        self.datasets: dict[str, str] = {}
        self.data: dict[str, dict[int, str]] = {}
        self.rows: dict[Key, TaskRow] = {}
        self.front: dict[str, dict[Key, int]] = {}
        """Waiting rows' keys, with their `seq`."""
        self.leased: dict[str, dict[Key, float]] = {}
        """Leased rows' keys, with their expiry."""
        self.by_ledger: dict[int, Key] = {}


class MemoryTaskTxn(TaskTxn):
    def __init__(self, state: TaskState, undo: Undo) -> None:
        self._s = state
        self._undo = undo

    def _set(self, mapping: dict[Any, Any], key: object, value: object) -> None:
        """mapping[key] = value (or removed, for _ABSENT), undone with the transaction."""
        old = mapping.get(key, _ABSENT)
        if value is _ABSENT:
            mapping.pop(key, None)
        else:
            mapping[key] = value
        if old is _ABSENT:
            self._undo.append(lambda: mapping.pop(key, None))
        else:
            self._undo.append(lambda: mapping.__setitem__(key, old))

    def get_dataset(self, name: str) -> str | None:
        return self._s.datasets.get(name)

    def put_dataset(self, name: str, record: str) -> None:
        self._set(self._s.datasets, name, record)

    def dataset_names(self) -> list[str]:
        return sorted(self._s.datasets)

    def add_tasks(self, name: str, first: int, data: Sequence[str]) -> None:
        if name not in self._s.data:
            self._set(self._s.data, name, {})
        stored = self._s.data[name]
        for i, text in enumerate(data):
            self._set(stored, first + i, text)

    def task_data(self, name: str, indices: Iterable[int]) -> dict[int, str]:
        stored = self._s.data.get(name, {})
        return {i: stored[i] for i in indices if i in stored}

    def rows(self, name: str, keys: Iterable[tuple[int, int]]) -> dict[tuple[int, int], TaskRow]:
        out = {}
        for epoch, index in keys:
            row = self._s.rows.get((name, epoch, index))
            if row is not None:
                out[epoch, index] = row
        return out

    def put_rows(self, rows: Sequence[TaskRow]) -> None:
        s = self._s
        for row in rows:
            key = (row.dataset, row.epoch, row.index)
            old = s.rows.get(key)
            if old is not None and old.ledger_id is not None and old.ledger_id != row.ledger_id:
                self._set(s.by_ledger, old.ledger_id, _ABSENT)
            if row.ledger_id is not None:
                self._set(s.by_ledger, row.ledger_id, key)
            for index, state, value in ((s.front, FRONT, row.seq), (s.leased, LEASED, row.expires_at)):
                if row.dataset not in index:
                    self._set(index, row.dataset, {})
                self._set(index[row.dataset], key, value if row.state == state else _ABSENT)
            self._set(s.rows, key, row)

    def front(self, name: str, limit: int) -> list[TaskRow]:
        waiting = self._s.front.get(name, {})
        keys = heapq.nsmallest(limit, waiting, key=waiting.__getitem__)
        return [self._s.rows[k] for k in keys]

    def expired(self, name: str, now: float, limit: int) -> list[TaskRow]:
        leased = self._s.leased.get(name, {})
        ended = [k for k, at in leased.items() if at <= now]
        return [self._s.rows[k] for k in heapq.nsmallest(limit, ended, key=leased.__getitem__)]

    def by_ledger(self, ids: Sequence[int]) -> list[TaskRow]:
        keys = (self._s.by_ledger.get(i) for i in ids)
        return [self._s.rows[k] for k in keys if k is not None]

    def scan(self, name: str, after: tuple[int, int], limit: int) -> list[TaskRow]:
        keys = sorted(k for k in self._s.rows if k[0] == name and (k[1], k[2]) > after)
        return [self._s.rows[k] for k in keys[:limit]]
