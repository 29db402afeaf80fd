"""The SQLite store's side buffers (`txn.held`): one row per held group, counted beside the queues under
`held_slot` keys, in the transaction's count deltas."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from typing import Any

from api.store import sql
from api.store.base import HeldGroup, ItemMeta, QueueCounts, held_slot
from api.store.sql.held import AddCounts, SqlHeld
from api.store.sqlite.ledger import chunks


@cache
def _held_sql(n: int, delete: bool) -> str:
    marks = ",".join("?" * n)
    if delete:
        return f"DELETE FROM held WHERE env_id = ? AND item_id IN ({marks})"
    return (
        "SELECT item_id, seqs, tokens, policy_step, held_at, payload FROM held "
        f"WHERE env_id = ? AND item_id IN ({marks})"
    )


class SqliteHeld(SqlHeld):
    def __init__(
        self,
        db: sqlite3.Connection,
        add_counts: AddCounts,
        flush: Callable[[], None],
        counts: Callable[[], dict[int, QueueCounts]],
    ) -> None:
        super().__init__(add_counts)
        self._db = db
        self._flush = flush
        """Writes the transaction's waiting inserts and count deltas (api/store/sqlite/deferred.py) first."""
        self._counts = counts
        """The held side of the transaction's counts (kept in memory through a group commit)."""

    def _run(self, name: str, params: Sequence[Any], *, write: bool) -> list[Sequence[Any]]:
        self._flush()
        cur = self._db.execute(sql.sqlite(name), params)
        return [] if write else cur.fetchall()

    def release(self, env_id: int, item_ids: Iterable[int]) -> list[HeldGroup]:
        wanted = list(item_ids)
        if not wanted:
            return []
        self._flush()
        found: dict[int, HeldGroup] = {}
        for chunk in chunks(wanted):
            for r in self._db.execute(_held_sql(len(chunk), False), (env_id, *chunk)).fetchall():
                found[r[0]] = HeldGroup(ItemMeta(r[0], r[1], r[2], r[3]), r[4], r[5])
        if len(found) != len(wanted) or len(set(wanted)) != len(wanted):
            raise KeyError(f"groups {wanted} are not all held (once) for env {env_id}")
        for chunk in chunks(wanted):  # found them all: nothing fails past this point
            self._db.execute(_held_sql(len(chunk), True), (env_id, *chunk))
        return self._released(env_id, [found[i] for i in wanted])

    def counts(self) -> dict[int, QueueCounts]:
        return {held_slot(env_id): c for env_id, c in self._counts().items()}
