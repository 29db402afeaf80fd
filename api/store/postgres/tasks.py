"""The PostgreSQL store's task tables (`TaskTxn`). Dataset records are read at BEGIN and task rows written with
the COMMIT (api/store/postgres/cache.py): reads of rows go to the database and see the group's own writes laid
over them (api/store/overlay.py), so a lease costs two round trips (what it may take, then the tasks' data) and
an acknowledgement one, whatever the dataset's size. The front and expired leases are read `FOR UPDATE SKIP
LOCKED`: replicas that ever took leases beside each other (writers hold the store lock today) would still never
hand out the same task."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg

from api.store import overlay
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


def _key(r: TaskRow) -> tuple[str, int, int]:
    """A task row's key, as `Pending.task_rows` holds it."""
    return r.dataset, r.epoch, r.index


def _position(r: TaskRow) -> tuple[int, int]:
    """Where a row is in its dataset's scan."""
    return r.epoch, r.index


class PostgresTaskTxn(TaskTxn):
    def __init__(self, db: psycopg.Connection[Any], pending: Pending, write: Write, writable: Callable[[], None]):
        self._db = db
        self._p = pending
        self._write = write
        self._writable = writable

    def _read(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        return self._db.execute(query, params, binary=True).fetchall()

    def _mine(self, name: str) -> dict[tuple[str, int, int], TaskRow]:
        """This group's pending rows of `name` (the rows an overlay of one dataset's read lays over)."""
        return {k: r for k, r in self._p.task_rows.items() if k[0] == name}

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
        def fetch(wanted: list[tuple[str, int, int]]) -> list[tuple[tuple[str, int, int], TaskRow]]:
            found = self._read(
                f"SELECT {COLUMNS} FROM tasks WHERE dataset = %b AND (epoch, idx) IN "
                "(SELECT * FROM unnest(%b::int8[], %b::int8[]))",
                (name, [e for _, e, _ in wanted], [i for _, _, i in wanted]),
            )
            return [(_key(r), r) for r in map(row_of, found)]

        found = overlay.point([(name, e, i) for e, i in keys], self._p.task_rows, fetch)
        return {(e, i): r for (_, e, i), r in found.items()}

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
        mine = self._mine(name)
        found = self._read(_RECLAIMABLE, (name, now, overlay.wanted(limit, mine), name, overlay.wanted(front, mine)))

        def ended(r: TaskRow) -> bool:
            return r.state == LEASED and r.expires_at is not None and r.expires_at <= now

        def waiting(r: TaskRow) -> bool:
            return r.state == FRONT

        expired = (row_of(r[1:]) for r in found if r[0] == 0)
        first = (row_of(r[1:]) for r in found if r[0] == 1)
        return (
            overlay.lay(expired, mine, _key, where=ended, order=lambda r: r.expires_at or 0.0, limit=limit),
            overlay.lay(first, mine, _key, where=waiting, order=lambda r: r.seq, limit=front),
        )

    def by_ledger(self, ids: Sequence[int]) -> list[TaskRow]:
        wanted = set(ids)
        found = self._read(
            f"SELECT {COLUMNS} FROM tasks WHERE ledger_id = ANY(%b::int8[]) AND ledger_id IS NOT NULL", (list(ids),)
        )
        return overlay.lay(map(row_of, found), self._p.task_rows, _key, where=lambda r: r.ledger_id in wanted)

    def scan(self, name: str, after: tuple[int, int], limit: int) -> list[TaskRow]:
        mine = self._mine(name)
        found = self._read(
            f"SELECT {COLUMNS} FROM tasks WHERE dataset = %b AND (epoch, idx) > (%b, %b) ORDER BY epoch, idx LIMIT %b",
            (name, after[0], after[1], overlay.wanted(limit, mine)),
        )
        return overlay.lay(
            map(row_of, found), mine, _key, where=lambda r: _position(r) > after, order=_position, limit=limit
        )
