"""The side buffers of the SQL stores (`HeldTxn`), as far as their SQL is the same: holding a group (one row,
counted beside the queues under its `held_slot` key) and listing an env's held groups. Releasing them and
reading the counts are the backends' own (SQLite checks then deletes in chunks; PostgreSQL deletes all or none
in one statement and counts in its cache)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from api.store.base import HeldGroup, HeldMeta, HeldTxn, ItemMeta, held_slot

AddCounts = Callable[[int, int, int, int, int, int], None]
"""Adds (env slot, items, groups, seqs, tokens, bytes) to the transaction's count deltas."""


class SqlHeld(HeldTxn):
    def __init__(self, add_counts: AddCounts) -> None:
        self._add_counts = add_counts

    @abstractmethod
    def _run(self, name: str, params: Sequence[Any], *, write: bool) -> list[Sequence[Any]]:
        """Run named query `name` (api/store/sql/queries.sql); its rows, if it reads."""

    def add(self, env_id: int, group: HeldGroup) -> None:
        m = group.meta
        size = len(group.payload)
        row = (m.item_id, env_id, m.seqs, m.tokens, m.policy_step, group.held_at, size, group.payload)
        self._run("held_add", row, write=True)
        self._add_counts(held_slot(env_id), 1, 1, m.seqs, m.tokens, size)

    def groups(self, env_id: int) -> list[HeldMeta]:
        rows = self._run("held_groups", (env_id,), write=False)
        return [HeldMeta(ItemMeta(r[0], r[1], r[2], r[3]), r[4], r[5]) for r in rows]

    def _released(self, env_id: int, groups: list[HeldGroup]) -> list[HeldGroup]:
        for g in groups:
            self._add_counts(held_slot(env_id), -1, -1, -g.meta.seqs, -g.meta.tokens, -len(g.payload))
        return groups
