"""What the functions of one group commit insert, written together before its COMMIT (`Deferred`).

A group commit of N requests used to run each request's inserts (queue item, payload, ledger row, reply,
counters, counts) as statements of their own: per-commit work in disguise. Here they wait in memory, merged
by statement, and go out as one `executemany` each, just before the COMMIT (or before any other statement
that might read or order against them). The counts table is read once per commit and kept up to date in
memory; replies not yet written answer `get_reply` from memory.

Only inserts of new rows and commutative upserts (counts, counters) wait, so writing them later, merged
across requests, changes nothing another statement could see: every other statement of a transaction function
writes them first (`flush`). A function's savepoint may thus contain the earlier functions' rows (written by
its flush): when it is undone, they are put back to wait (`undone`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from api.store.base import QueueCounts

Row = Sequence[Any]
Counts = dict[int, list[int]]

_ADD_COUNTS = (
    "INSERT INTO counts (env_id, items, groups, seqs, tokens, bytes) VALUES (?,?,?,?,?,?) ON CONFLICT (env_id) DO "
    "UPDATE SET items = items + excluded.items, groups = groups + excluded.groups, seqs = seqs + excluded.seqs, "
    "tokens = tokens + excluded.tokens, bytes = bytes + excluded.bytes"
)
REPLIES = "INSERT OR REPLACE INTO replies (key, reply, created) VALUES (?, ?, ?)"
"""The reply insert: `Deferred.replies_written` counts its rows (old replies are trimmed every so many)."""


def add_to(counts: Counts, env_id: int, delta: Sequence[int]) -> None:
    d = counts.get(env_id)
    if d is None:
        counts[env_id] = list(delta)
    else:
        for k in range(5):
            d[k] += delta[k]


class Deferred:
    """The rows waiting for one SQLite transaction's COMMIT, shared by its functions (the writer thread's)."""

    __slots__ = ("ops", "counts", "replies", "stored", "redo", "in_savepoint", "replies_written", "saved_replies")

    def __init__(self) -> None:
        self.ops: dict[str, list[Row]] = {}
        """Inserts waiting, by statement, in the order they were made."""
        self.counts: Counts = {}
        """Count deltas of the finished functions, not written yet."""
        self.replies: dict[str, str] = {}
        """Replies the finished functions of this transaction put (written or not)."""
        self.stored: Counts | None = None
        """The counts table as written so far (None: not read yet in this transaction, nor kept from the last)."""
        self.redo: tuple[dict[str, list[Row]], Counts] | None = None
        """Rows of earlier functions written inside the current function's savepoint."""
        self.in_savepoint = False
        self.replies_written = 0
        """Reply rows written since the last trim (kept across transactions)."""
        self.saved_replies: dict[str, str] | None = None
        """The replies known before the current function emptied the tables (`cleared`)."""

    # --- around the transaction and its functions (the driver) ---
    def reset(self, *, keep_counts: bool = False) -> None:
        """A transaction begins or ended: nothing waits; the counts as stored are known still only with
        `keep_counts` (the driver's word: this connection committed them and no other connection committed since)."""
        self.ops = {}
        self.counts = {}
        self.replies = {}
        if not keep_counts:
            self.stored = None
        self.redo = None
        self.in_savepoint = False
        self.saved_replies = None

    def savepoint(self) -> None:
        self.in_savepoint = True
        self.redo = None

    def release(self) -> None:
        self.in_savepoint = False
        self.redo = None
        self.saved_replies = None

    def undone(self) -> None:
        """The current function's savepoint was rolled back: what of the earlier ones it wrote waits again."""
        self.in_savepoint = False
        if self.redo is not None:
            ops, counts = self.redo
            for sql, rows in self.ops.items():  # none since the flush: the function wrote through after it
                ops.setdefault(sql, []).extend(rows)
            self.ops = ops
            for env_id, d in counts.items():
                add_to(self.counts, env_id, d)
            self.redo = None
        self.stored = None  # it may hold what the undone function wrote
        if self.saved_replies is not None:
            self.replies = self.saved_replies
            self.saved_replies = None

    def cleared(self) -> None:
        """The tables were emptied (after a flush): no reply nor count of this transaction is known."""
        if self.in_savepoint and self.saved_replies is None:
            self.saved_replies = self.replies
        self.replies = {}
        self.stored = None

    def finished(self, ops: dict[str, list[Row]], counts: Counts, replies: dict[str, str]) -> None:
        """A function returned: what it left waiting joins the transaction's."""
        for sql, rows in ops.items():
            mine = self.ops.get(sql)
            if mine is None:
                self.ops[sql] = list(rows)
            else:
                mine.extend(rows)
        for env_id, d in counts.items():
            add_to(self.counts, env_id, d)
        self.replies.update(replies)

    # --- writing ---
    def flush(self, db: sqlite3.Connection, ops: dict[str, list[Row]], counts: Counts) -> int:
        """Write what waits, the transaction's and a function's own (`ops`, `counts`, emptied); the reply
        rows written."""
        mine_ops, mine_counts = self.ops, self.counts
        if not (mine_ops or mine_counts or ops or counts):
            return 0
        if self.in_savepoint and (mine_ops or mine_counts):
            redo_ops, redo_counts = self.redo if self.redo is not None else ({}, {})
            for sql, rows in mine_ops.items():
                redo_ops.setdefault(sql, []).extend(rows)
            for env_id, d in mine_counts.items():
                add_to(redo_counts, env_id, d)
            self.redo = (redo_ops, redo_counts)
        self.ops, self.counts = {}, {}
        replies = 0
        for source in (mine_ops, ops):
            for sql, rows in source.items():
                db.executemany(sql, rows)
                if sql == REPLIES:
                    replies += len(rows)
        ops.clear()
        merged: Counts = {}
        for source_counts in (mine_counts, counts):
            for env_id, d in source_counts.items():
                add_to(merged, env_id, d)
        counts.clear()
        if merged:
            db.executemany(_ADD_COUNTS, [(env_id, *d) for env_id, d in merged.items()])
            if self.stored is not None:
                for env_id, d in merged.items():
                    add_to(self.stored, env_id, d)
        self.replies_written += replies
        return replies

    # --- reading ---
    def queue_counts(self, db: sqlite3.Connection, mine: Counts, *, held: bool, anon_env: int) -> list[Row]:
        """The counts table's rows (env_id, items, ...) with more than no items, on the queue side
        (env_id >= anon_env) or the held side, as they stand with what waits (the transaction's and `mine`)."""
        if self.stored is None:
            rows = db.execute("SELECT env_id, items, groups, seqs, tokens, bytes FROM counts").fetchall()
            self.stored = {row[0]: list(row[1:]) for row in rows}
        total: Counts = {}
        for source in (self.stored, self.counts, mine):
            for env_id, d in source.items():
                if (env_id < anon_env) == held:
                    add_to(total, env_id, d)
        return [(env_id, *d) for env_id, d in total.items() if d[0] > 0]


def counts_of(rows: list[Row]) -> dict[int, QueueCounts]:
    return {row[0]: QueueCounts(*row[1:]) for row in rows}
