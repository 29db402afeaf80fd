"""The PostgreSQL store's task tables (`TaskTxn`). Dataset records are read at BEGIN and task rows written with
the COMMIT (api/store/postgres/cache.py): reads of rows go to the database and see the group's own writes laid
over them, so a lease costs two round trips (what it may take, then the tasks' data) and an acknowledgement one,
whatever the dataset's size. The front and expired leases are read `FOR UPDATE SKIP LOCKED`: replicas that ever
took leases beside each other (writers hold the store lock today) would still never hand out the same task."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg

from api.store.postgres.cache import Pending
from api.store.tasks import COLUMNS, FRONT, LEASED, TaskRow, TaskTxn, row_of

Write = Callable[[str, Sequence[Any]], psycopg.Cursor[Any]]
_FRONT = f"SELECT {COLUMNS} FROM tasks WHERE dataset = %b AND state = 'waiting' ORDER BY seq LIMIT %b"
_EXPIRED = (
    f"SELECT {COLUMNS} FROM tasks WHERE dataset = %b AND state = 'leased' AND expires_at <= %b "
    "ORDER BY expires_at LIMIT %b"
)
_LOCKED = " FOR UPDATE SKIP LOCKED"
_RECLAIMABLE = f"SELECT 0, * FROM ({_EXPIRED}{_LOCKED}) e UNION ALL SELECT 1, * FROM ({_FRONT}{_LOCKED}) f"


def _is_front(r: TaskRow) -> bool:
    return r.state == FRONT


class PostgresTaskTxn(TaskTxn):
    def __init__(self, db: psycopg.Connection[Any], pending: Pending, write: Write, writable: Callable[[], None]):
        self._db = db
        self._p = pending
        self._write = write
        self._writable = writable

    def _read(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        return self._db.execute(query, params, binary=True).fetchall()

    def _mine(self, name: str) -> list[TaskRow]:
        """This group's writes to `name`'s rows."""
        return [r for r in self._p.task_rows.values() if r.dataset == name]

    def _over(self, found: Iterable[TaskRow], mine: list[TaskRow], keep: Callable[[TaskRow], bool]) -> list[TaskRow]:
        """Rows read from the database, each replaced by this group's write of it, and this group's other writes,
        those that `keep` accepts."""
        written = self._p.task_rows
        out = {(r.epoch, r.index): written.get((r.dataset, r.epoch, r.index), r) for r in found}
        out.update(((r.epoch, r.index), r) for r in mine)
        return [r for r in out.values() if keep(r)]

    def get_dataset(self, name: str) -> str | None:
        return self._p.task_sets.get(name)

    def put_dataset(self, name: str, record: str) -> None:
        self._writable()
        self._p.task_sets[name] = record
        self._p.dirty_task_sets.add(name)

    def dataset_names(self) -> list[str]:
        return sorted(self._p.task_sets)

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

    def task_sizes(self, name: str, indices: Iterable[int]) -> dict[int, int]:
        ids = list(indices)
        if not ids:
            return {}
        rows = self._read(
            "SELECT idx, octet_length(data) FROM task_data WHERE dataset = %b AND idx = ANY(%b::int8[])", (name, ids)
        )
        return {int(i): int(n) for i, n in rows}

    def rows(self, name: str, keys: Iterable[tuple[int, int]]) -> dict[tuple[int, int], TaskRow]:
        written = self._p.task_rows
        asked = list(keys)
        out = {k: written[(name, *k)] for k in asked if (name, *k) in written}
        wanted = [k for k in asked if k not in out]
        if wanted:
            found = self._read(
                f"SELECT {COLUMNS} FROM tasks WHERE dataset = %b AND (epoch, idx) IN "
                "(SELECT * FROM unnest(%b::int8[], %b::int8[]))",
                (name, [e for e, _ in wanted], [i for _, i in wanted]),
            )
            out.update(((int(r[1]), int(r[2])), row_of(r)) for r in found)
        return out

    def put_rows(self, rows: Sequence[TaskRow]) -> None:
        if rows:
            self._writable()
        for r in rows:
            self._p.task_rows[r.dataset, r.epoch, r.index] = r

    def front(self, name: str, limit: int) -> list[TaskRow]:
        return self.reclaimable(name, 0.0, 0, limit)[1]

    def expired(self, name: str, now: float, limit: int) -> list[TaskRow]:
        return self.reclaimable(name, now, limit, 0)[0]

    def reclaimable(self, name: str, now: float, limit: int, front: int) -> tuple[list[TaskRow], list[TaskRow]]:
        # Each read asks for as many more rows as this group wrote: those may have left the state (and are laid
        # over), so the first `limit` that are still in it are among what comes back.
        mine = self._mine(name)
        found = self._read(_RECLAIMABLE, (name, now, limit + len(mine), name, front + len(mine)))
        ended = lambda r: r.state == LEASED and r.expires_at is not None and r.expires_at <= now  # noqa: E731
        expired = self._over((row_of(r[1:]) for r in found if r[0] == 0), mine, ended)
        waiting = self._over((row_of(r[1:]) for r in found if r[0] == 1), mine, _is_front)
        expired.sort(key=lambda r: r.expires_at or 0.0)
        waiting.sort(key=lambda r: r.seq)
        return expired[:limit], waiting[:front]

    def by_ledger(self, ids: Sequence[int]) -> list[TaskRow]:
        wanted = set(ids)
        found = self._read(
            f"SELECT {COLUMNS} FROM tasks WHERE ledger_id = ANY(%b::int8[]) AND ledger_id IS NOT NULL", (list(ids),)
        )
        written = self._p.task_rows
        out = {(r.dataset, r.epoch, r.index): r for r in map(row_of, found)}
        out.update((k, r) for k, r in written.items() if k in out or r.ledger_id in wanted)
        return [r for r in out.values() if r.ledger_id is not None and r.ledger_id in wanted]

    def scan(self, name: str, after: tuple[int, int], limit: int) -> list[TaskRow]:
        mine = [r for r in self._mine(name) if (r.epoch, r.index) > after]
        found = self._read(
            f"SELECT {COLUMNS} FROM tasks WHERE dataset = %b AND (epoch, idx) > (%b, %b) ORDER BY epoch, idx LIMIT %b",
            (name, after[0], after[1], limit + len(mine)),
        )
        rows = self._over(map(row_of, found), mine, lambda r: True)
        return sorted(rows, key=lambda r: (r.epoch, r.index))[:limit]
