"""The PostgreSQL store's side buffers (`txn.held`): rows written through (a rare path), counted in the group's
cache beside the queues, under `held_slot` keys."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg

from api.store import sql
from api.store.base import ANON_ENV, HeldGroup, HeldMeta, HeldTxn, ItemMeta, QueueCounts, held_slot
from api.store.postgres.cache import Pending

# Releases all of these groups or, if one of them is not held for this env, none.
_RELEASE = """
DELETE FROM held WHERE env_id = %(env)b AND item_id = ANY(%(ids)b)
  AND (SELECT count(*) FROM held WHERE env_id = %(env)b AND item_id = ANY(%(ids)b)) = %(n)b
RETURNING item_id, seqs, tokens, policy_step, held_at, payload
"""


class PostgresHeld(HeldTxn):
    def __init__(
        self,
        conn: psycopg.Connection[Any],
        pending: Pending,
        write: Callable[[str, Sequence[Any] | dict[str, Any]], psycopg.Cursor[Any]],
        add_counts: Callable[[int, int, int, int, int, int], None],
    ) -> None:
        self._db = conn
        self._p = pending
        self._write = write
        """Runs a write under the function's savepoint (`PostgresTxn._write`)."""
        self._add_counts = add_counts

    def add(self, env_id: int, group: HeldGroup) -> None:
        m = group.meta
        size = len(group.payload)
        row = (m.item_id, env_id, m.seqs, m.tokens, m.policy_step, group.held_at, size, group.payload)
        self._write(sql.postgres("held_add"), row)
        self._add_counts(held_slot(env_id), 1, 1, m.seqs, m.tokens, size)

    def groups(self, env_id: int) -> list[HeldMeta]:
        rows = self._db.execute(sql.postgres("held_groups"), (env_id,), binary=True).fetchall()
        return [HeldMeta(ItemMeta(r[0], r[1], r[2], r[3]), r[4], r[5]) for r in rows]

    def release(self, env_id: int, item_ids: Iterable[int]) -> list[HeldGroup]:
        wanted = list(item_ids)
        if not wanted:
            return []
        if len(set(wanted)) != len(wanted):
            raise KeyError(f"groups {wanted} are not all held (once) for env {env_id}")
        rows = self._write(_RELEASE, {"env": env_id, "ids": wanted, "n": len(wanted)}).fetchall()
        if len(rows) != len(wanted):
            raise KeyError(f"groups {wanted} are not all held for env {env_id}")
        found = {r[0]: HeldGroup(ItemMeta(r[0], r[1], r[2], r[3]), r[4], bytes(r[5])) for r in rows}
        out = [found[i] for i in wanted]
        for g in out:
            self._add_counts(held_slot(env_id), -1, -1, -g.meta.seqs, -g.meta.tokens, -len(g.payload))
        return out

    def counts(self) -> dict[int, QueueCounts]:
        return {held_slot(env): QueueCounts(*c) for env, c in self._p.counts.items() if c[0] > 0 and env < ANON_ENV}
