"""The PostgreSQL store's task tables (`TaskTxn`): written through to the database under the function's
savepoint, in the enclosing transaction. The front is read `FOR UPDATE SKIP LOCKED`: replicas that ever took
leases beside each other (writers hold the store lock today) would still never hand out the same task."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg

from api.store.tasks import COLUMNS, TaskRow, TaskTxn, row_of, values_of

_PUT = (
    f"INSERT INTO tasks ({COLUMNS}) SELECT * FROM unnest(%b::text[], %b::int8[], %b::int8[], %b::text[], "
    "%b::int8[], %b::text[], %b::float8[], %b::int8[], %b::int8[], %b::int8[], %b::text[], %b::float8[], %b::int8[]) "
    "ON CONFLICT (dataset, epoch, idx) DO UPDATE SET state = excluded.state, leases = excluded.leases, "
    "producer = excluded.producer, expires_at = excluded.expires_at, retries = excluded.retries, "
    "ledger_id = excluded.ledger_id, step = excluded.step, reason = excluded.reason, "
    "updated_at = excluded.updated_at, seq = excluded.seq"
)
Write = Callable[[str, Sequence[Any]], psycopg.Cursor[Any]]


class PostgresTaskTxn(TaskTxn):
    def __init__(self, db: psycopg.Connection[Any], write: Write) -> None:
        self._db = db
        self._write = write

    def _read(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        return self._db.execute(query, params, binary=True).fetchall()

    def get_dataset(self, name: str) -> str | None:
        rows = self._read("SELECT record FROM task_sets WHERE name = %b", (name,))
        return str(rows[0][0]) if rows else None

    def put_dataset(self, name: str, record: str) -> None:
        self._write(
            "INSERT INTO task_sets (name, record) VALUES (%b, %b) ON CONFLICT (name) DO UPDATE SET record = "
            "excluded.record",
            (name, record),
        )

    def dataset_names(self) -> list[str]:
        return [str(r[0]) for r in self._read("SELECT name FROM task_sets ORDER BY name", ())]

    def add_tasks(self, name: str, first: int, data: Sequence[str]) -> None:
        self._write(
            "INSERT INTO task_data (dataset, idx, data) SELECT %b, i, d FROM unnest(%b::int8[], %b::text[]) "
            "AS u(i, d) ON CONFLICT (dataset, idx) DO UPDATE SET data = excluded.data",
            (name, list(range(first, first + len(data))), list(data)),
        )

    def task_data(self, name: str, indices: Iterable[int]) -> dict[int, str]:
        ids = list(indices)
        if not ids:
            return {}
        rows = self._read("SELECT idx, data FROM task_data WHERE dataset = %b AND idx = ANY(%b::int8[])", (name, ids))
        return {int(i): str(d) for i, d in rows}

    def rows(self, name: str, keys: Iterable[tuple[int, int]]) -> dict[tuple[int, int], TaskRow]:
        wanted = list(keys)
        if not wanted:
            return {}
        rows = self._read(
            f"SELECT {COLUMNS} FROM tasks WHERE dataset = %b AND (epoch, idx) IN "
            "(SELECT * FROM unnest(%b::int8[], %b::int8[]))",
            (name, [e for e, _ in wanted], [i for _, i in wanted]),
        )
        return {(int(r[1]), int(r[2])): row_of(r) for r in rows}

    def put_rows(self, rows: Sequence[TaskRow]) -> None:
        if rows:
            self._write(_PUT, [list(col) for col in zip(*(values_of(r) for r in rows), strict=True)])

    def front(self, name: str, limit: int) -> list[TaskRow]:
        rows = self._read(
            f"SELECT {COLUMNS} FROM tasks WHERE dataset = %b AND state = 'waiting' ORDER BY seq LIMIT %b "
            "FOR UPDATE SKIP LOCKED",
            (name, limit),
        )
        return [row_of(r) for r in rows]

    def expired(self, name: str, now: float, limit: int) -> list[TaskRow]:
        rows = self._read(
            f"SELECT {COLUMNS} FROM tasks WHERE dataset = %b AND state = 'leased' AND expires_at <= %b "
            "ORDER BY expires_at LIMIT %b FOR UPDATE SKIP LOCKED",
            (name, now, limit),
        )
        return [row_of(r) for r in rows]

    def by_ledger(self, ids: Sequence[int]) -> list[TaskRow]:
        rows = self._read(
            f"SELECT {COLUMNS} FROM tasks WHERE ledger_id = ANY(%b::int8[]) AND ledger_id IS NOT NULL", (list(ids),)
        )
        return [row_of(r) for r in rows]

    def scan(self, name: str, after: tuple[int, int], limit: int) -> list[TaskRow]:
        rows = self._read(
            f"SELECT {COLUMNS} FROM tasks WHERE dataset = %b AND (epoch, idx) > (%b, %b) ORDER BY epoch, idx LIMIT %b",
            (name, after[0], after[1], limit),
        )
        return [row_of(r) for r in rows]
