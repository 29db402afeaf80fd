"""The SQLite file's task tables (`TaskTxn`): written through on the writer's connection, inside the enclosing
transaction. Each method is one indexed statement; none scans a dataset."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from typing import cast

from api.store.tasks import COLUMNS, MISSING_BYTES, TaskRow, TaskTxn, row_of, values_of

_PUT = f"INSERT OR REPLACE INTO tasks ({COLUMNS}) VALUES ({','.join('?' * 15)})"


class SqliteTaskTxn(TaskTxn):
    __slots__ = ("_db",)

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def get_dataset(self, name: str) -> str | None:
        row = self._db.execute("SELECT record FROM task_sets WHERE name = ?", (name,)).fetchone()
        return None if row is None else cast(str, row[0])

    def put_dataset(self, name: str, record: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO task_sets (name, record) VALUES (?, ?)", (name, record))

    def dataset_names(self) -> list[str]:
        return [str(r[0]) for r in self._db.execute("SELECT name FROM task_sets ORDER BY name")]

    def add_tasks(self, name: str, first: int, data: Sequence[str]) -> None:
        self._db.executemany(
            "INSERT OR REPLACE INTO task_data (dataset, idx, data) VALUES (?, ?, ?)",
            [(name, first + i, text) for i, text in enumerate(data)],
        )

    def task_data(self, name: str, indices: Iterable[int]) -> dict[int, str]:
        out = {}
        for i in indices:
            row = self._db.execute("SELECT data FROM task_data WHERE dataset = ? AND idx = ?", (name, i)).fetchone()
            if row is not None:
                out[i] = str(row[0])
        return out

    def tasks_within(self, name: str, indices: Sequence[int], max_bytes: int | None) -> tuple[int, dict[int, str]]:
        out: dict[int, str] = {}
        total = 0
        for k, i in enumerate(indices):  # a task at a time: what does not fit is read once, and no more
            row = self._db.execute("SELECT data FROM task_data WHERE dataset = ? AND idx = ?", (name, i)).fetchone()
            total += MISSING_BYTES if row is None else len(str(row[0]).encode())
            if k and max_bytes is not None and total > max_bytes:
                return k, out
            if row is not None:
                out[i] = str(row[0])
        return len(indices), out

    def rows(self, name: str, keys: Iterable[tuple[int, int]]) -> dict[tuple[int, int], TaskRow]:
        out = {}
        for epoch, index in keys:
            row = self._db.execute(
                f"SELECT {COLUMNS} FROM tasks WHERE dataset = ? AND epoch = ? AND idx = ?", (name, epoch, index)
            ).fetchone()
            if row is not None:
                out[epoch, index] = row_of(row)
        return out

    def put_rows(self, rows: Sequence[TaskRow]) -> None:
        if rows:
            self._db.executemany(_PUT, [values_of(r) for r in rows])

    def front(self, name: str, limit: int) -> list[TaskRow]:
        cur = self._db.execute(
            f"SELECT {COLUMNS} FROM tasks WHERE dataset = ? AND state = 'waiting' ORDER BY seq LIMIT ?", (name, limit)
        )
        return [row_of(r) for r in cur]

    def expired(self, name: str, now: float, limit: int) -> list[TaskRow]:
        cur = self._db.execute(
            f"SELECT {COLUMNS} FROM tasks WHERE dataset = ? AND state = 'leased' AND expires_at <= ? "
            "ORDER BY expires_at LIMIT ?",
            (name, now, limit),
        )
        return [row_of(r) for r in cur]

    def by_ledger(self, ids: Sequence[int]) -> list[TaskRow]:
        out = []
        for i in ids:
            row = self._db.execute(
                f"SELECT {COLUMNS} FROM tasks WHERE ledger_id = ? AND ledger_id IS NOT NULL", (i,)
            ).fetchone()
            if row is not None:
                out.append(row_of(row))
        return out

    def scan(self, name: str, after: tuple[int, int], limit: int) -> list[TaskRow]:
        cur = self._db.execute(
            f"SELECT {COLUMNS} FROM tasks WHERE dataset = ? AND (epoch, idx) > (?, ?) ORDER BY epoch, idx LIMIT ?",
            (name, after[0], after[1], limit),
        )
        return [row_of(r) for r in cur]
