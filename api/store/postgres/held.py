"""The PostgreSQL store's side buffers (`txn.held`): rows written through (a rare path), counted in the group's
cache beside the queues, under `held_slot` keys."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg

from api.store import sql
from api.store.base import ANON_ENV, HeldGroup, ItemMeta, QueueCounts, held_slot
from api.store.postgres.cache import Pending
from api.store.sql.held import AddCounts, SqlHeld

# Releases all of these groups or, if one of them is not held for this env, none.
_RELEASE = """
DELETE FROM held WHERE env_id = %(env)b AND item_id = ANY(%(ids)b)
  AND (SELECT count(*) FROM held WHERE env_id = %(env)b AND item_id = ANY(%(ids)b)) = %(n)b
RETURNING item_id, seqs, tokens, policy_step, held_at, payload
"""


class PostgresHeld(SqlHeld):
    def __init__(
        self,
        conn: psycopg.Connection[Any],
        pending: Pending,
        write: Callable[[str, Sequence[Any] | dict[str, Any]], psycopg.Cursor[Any]],
        add_counts: AddCounts,
    ) -> None:
        super().__init__(add_counts)
        self._db = conn
        self._p = pending
        self._write = write
        """Runs a write under the function's savepoint (`PostgresTxn._write`)."""

    def _run(self, name: str, params: Sequence[Any], *, write: bool) -> list[Sequence[Any]]:
        if write:
            self._write(sql.postgres(name), params)
            return []
        return self._db.execute(sql.postgres(name), params, binary=True).fetchall()

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
        return self._released(env_id, [found[i] for i in wanted])

    def counts(self) -> dict[int, QueueCounts]:
        return {held_slot(env): QueueCounts(*c) for env, c in self._p.counts.items() if c[0] > 0 and env < ANON_ENV}
