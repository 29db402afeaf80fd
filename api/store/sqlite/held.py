"""The SQLite store's side buffers (`txn.held`): one row per held group, counted beside the queues under
`held_slot` keys, in the transaction's count deltas."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from functools import cache

from api.store import sql
from api.store.base import ANON_ENV, HeldGroup, HeldMeta, HeldTxn, ItemMeta, QueueCounts, held_slot
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


class SqliteHeld(HeldTxn):
    def __init__(
        self,
        db: sqlite3.Connection,
        add_counts: Callable[[int, int, int, int, int, int], None],
        flush_counts: Callable[[], None],
    ) -> None:
        self._db = db
        self._add_counts = add_counts
        """Adds to the transaction's count deltas (written once, with its other counts)."""
        self._flush_counts = flush_counts

    def add(self, env_id: int, group: HeldGroup) -> None:
        m = group.meta
        size = len(group.payload)
        self._db.execute(
            sql.sqlite("held_add"),
            (m.item_id, env_id, m.seqs, m.tokens, m.policy_step, group.held_at, size, group.payload),
        )
        self._add_counts(held_slot(env_id), 1, 1, m.seqs, m.tokens, size)

    def groups(self, env_id: int) -> list[HeldMeta]:
        rows = self._db.execute(sql.sqlite("held_groups"), (env_id,)).fetchall()
        return [HeldMeta(ItemMeta(r[0], r[1], r[2], r[3]), r[4], r[5]) for r in rows]

    def release(self, env_id: int, item_ids: Iterable[int]) -> list[HeldGroup]:
        wanted = list(item_ids)
        if not wanted:
            return []
        found: dict[int, HeldGroup] = {}
        for chunk in chunks(wanted):
            for r in self._db.execute(_held_sql(len(chunk), False), (env_id, *chunk)).fetchall():
                found[r[0]] = HeldGroup(ItemMeta(r[0], r[1], r[2], r[3]), r[4], r[5])
        if len(found) != len(wanted) or len(set(wanted)) != len(wanted):
            raise KeyError(f"groups {wanted} are not all held (once) for env {env_id}")
        for chunk in chunks(wanted):  # found them all: nothing fails past this point
            self._db.execute(_held_sql(len(chunk), True), (env_id, *chunk))
        out = [found[i] for i in wanted]
        for g in out:
            self._add_counts(held_slot(env_id), -1, -1, -g.meta.seqs, -g.meta.tokens, -len(g.payload))
        return out

    def counts(self) -> dict[int, QueueCounts]:
        self._flush_counts()
        rows = self._db.execute(
            "SELECT env_id, items, groups, seqs, tokens, bytes FROM counts WHERE items > 0 AND env_id < ?", (ANON_ENV,)
        )
        return {held_slot(row[0]): QueueCounts(*row[1:]) for row in rows}
