"""One transaction function's view of the SQLite file (`SqliteTxn`), and the item id counter it draws from.

Everything here runs on the store's writer thread, inside the transaction `api/store/commit.py` opened.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import cache
from typing import cast

import numpy as np

from api.store.base import (
    ANON_ENV,
    QUEUED,
    HeldGroup,
    HeldMeta,
    ItemMeta,
    KeptPayload,
    LedgerGroup,
    LedgerStep,
    QueueCounts,
    QueuedItem,
    Txn,
    held_slot,
)
from api.store.jobs import head_chunk_sizes
from api.store.ledger_rows import GROUP_COLUMNS, STEP_COLUMNS, gid_bytes, group_of, group_values, step_of, step_values
from api.store.sqlite.config import SqliteConfig
from api.store.sqlite.schema import CLEARED
from api.store.sqlite.tasks import SqliteTaskTxn
from api.store.tasks import TaskTxn

POP_CHUNK = 500
"""Ids per DELETE statement: stays under SQLite's host-parameter limit on any build."""
REPLY_TRIM_EVERY = 1024
"""Old replies are trimmed every this many inserted replies, not on every insert."""

_INT64_MIN = -(2**63)
_I64 = np.dtype("<i8")

_HEAD = (
    "SELECT item_id, seqs, tokens, policy_step FROM queue WHERE env_id = ? AND item_id > ? ORDER BY env_id, item_id "
    "LIMIT ?"
)
_APPEND = "INSERT INTO queue (item_id, env_id, seqs, tokens, policy_step, n_groups) VALUES (?,?,?,?,?,?)"
_APPEND_PAYLOAD = "INSERT INTO payloads (item_id, payload) VALUES (?,?)"
_ADD_COUNTS = (
    "INSERT INTO counts (env_id, items, groups, seqs, tokens, bytes) VALUES (?,?,?,?,?,?) ON CONFLICT (env_id) DO "
    "UPDATE SET items = items + excluded.items, groups = groups + excluded.groups, seqs = seqs + excluded.seqs, "
    "tokens = tokens + excluded.tokens, bytes = bytes + excluded.bytes"
)

_HOLD = (
    "INSERT INTO held (item_id, env_id, seqs, tokens, policy_step, held_at, bytes, payload) VALUES (?,?,?,?,?,?,?,?)"
)
_HELD = "SELECT item_id, seqs, tokens, policy_step, held_at, bytes FROM held WHERE env_id = ? ORDER BY item_id"

_LEDGER_ADD = f"INSERT INTO ledger ({GROUP_COLUMNS}) VALUES ({','.join('?' * 19)})"
_LEDGER_DECIDE = "UPDATE ledger SET fate = ?, step = ?, reason = ?, decided_at = ?, kept = ? WHERE id = ?"

_ADD_COUNTER = (
    "INSERT INTO counters (kind, name, n) VALUES (?,?,?) ON CONFLICT (kind, name) DO UPDATE SET n = n + excluded.n"
)


@cache
def _pop_sql(n: int) -> str:
    marks = ",".join("?" * n)
    return (
        f"DELETE FROM queue WHERE env_id = ? AND item_id IN ({marks}) "
        "RETURNING item_id, seqs, tokens, policy_step, n_groups"
    )


@cache
def _held_sql(n: int, delete: bool) -> str:
    marks = ",".join("?" * n)
    if delete:
        return f"DELETE FROM held WHERE env_id = ? AND item_id IN ({marks})"
    return (
        "SELECT item_id, seqs, tokens, policy_step, held_at, payload FROM held "
        f"WHERE env_id = ? AND item_id IN ({marks})"
    )


@cache
def _payloads_sql(n: int, delete: bool) -> str:
    marks = ",".join("?" * n)
    if delete:
        return f"DELETE FROM payloads WHERE item_id IN ({marks}) RETURNING item_id, payload"
    return f"SELECT item_id, payload FROM payloads WHERE item_id IN ({marks})"


def _chunks(ids: list[int]) -> Iterator[list[int]]:
    for i in range(0, len(ids), POP_CHUNK):
        yield ids[i : i + POP_CHUNK]


class ItemIds:
    """Item ids, handed out from memory; the counter is stored with the next COMMIT.

    The stored counter is read once per SQLite transaction, since another process sharing the file may have
    handed out ids meanwhile. Ids given to functions that rolled back are stored too, so no id is handed
    out twice, not even across restarts."""

    __slots__ = ("next", "synced", "unsaved")

    def __init__(self) -> None:
        self.next = 1
        self.synced = False
        self.unsaved = False

    def begin(self) -> None:
        self.synced = False

    def take(self, db: sqlite3.Connection) -> int:
        if not self.synced:
            stored = db.execute("SELECT value FROM meta WHERE key = 'next_item_id'").fetchone()[0]
            self.next = max(self.next, int(stored))
            self.synced = True
        item_id = self.next
        self.next += 1
        self.unsaved = True
        return item_id

    def save(self, db: sqlite3.Connection) -> None:
        """Inside a transaction; `committed()` once it is."""
        if self.unsaved:
            db.execute("UPDATE meta SET value = max(value, ?) WHERE key = 'next_item_id'", (self.next,))

    def committed(self) -> None:
        self.unsaved = False


class SqliteTxn(Txn):
    """Writes to the queue are batched until something reads it (or the function returns), then written
    with executemany; per-env counts are kept as deltas and written once per transaction."""

    __slots__ = ("_db", "_config", "_ids", "_now", "_rows", "_payloads", "_delta", "_values")

    def __init__(
        self, db: sqlite3.Connection, config: SqliteConfig, ids: ItemIds, values: dict[str, str | None] | None = None
    ) -> None:
        self._db = db
        self._values = {} if values is None else values
        """Values read or written in this SQLite transaction, shared by the functions of one group commit (the
        driver forgets them when one is undone): the run state is read once per commit, not once per request."""
        self._config = config
        self._ids = ids
        self._now = time.time()
        self._rows: list[tuple[int, int, int, int, int, int]] = []
        self._payloads: list[tuple[int, bytes]] = []
        self._delta: dict[int, list[int]] = {}

    # --- bookkeeping the store calls around the transaction function ---
    def finish(self) -> None:
        """Write what is still pending; runs inside the transaction, before COMMIT."""
        self._flush_items()
        self._flush_counts()

    def _flush_items(self) -> None:
        if self._rows:
            self._db.executemany(_APPEND, self._rows)
            self._db.executemany(_APPEND_PAYLOAD, self._payloads)
            self._rows.clear()
            self._payloads.clear()

    def _flush_counts(self) -> None:
        if self._delta:
            self._db.executemany(_ADD_COUNTS, [(env, *d) for env, d in self._delta.items()])
            self._delta.clear()

    def _add(self, env_id: int, items: int, groups: int, seqs: int, tokens: int, size: int) -> None:
        d = self._delta.get(env_id)
        if d is None:
            self._delta[env_id] = [items, groups, seqs, tokens, size]
        else:
            d[0] += items
            d[1] += groups
            d[2] += seqs
            d[3] += tokens
            d[4] += size

    @property
    def tasks(self) -> TaskTxn:
        return SqliteTaskTxn(self._db)

    # --- values ---
    def get_value(self, key: str) -> str | None:
        if key in self._values:
            return self._values[key]
        row = self._db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        value = None if row is None else cast(str, row[0])
        self._values[key] = value
        return value

    def set_value(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, value))
        self._values[key] = value

    # --- the queue ---
    def next_item_id(self) -> int:
        return self._ids.take(self._db)

    def append(self, env_id: int, item: QueuedItem) -> None:
        m = item.meta
        self._rows.append((m.item_id, env_id, m.seqs, m.tokens, m.policy_step, item.n_groups))
        self._payloads.append((m.item_id, item.payload))
        self._add(env_id, 1, item.n_groups, m.seqs, m.tokens, len(item.payload))

    def head(self, env_id: int) -> Iterator[ItemMeta]:
        self._flush_items()
        return self._head(env_id)

    def _head(self, env_id: int) -> Iterator[ItemMeta]:
        # Keyset pages, not one open cursor: pops and appends between two reads of the iterator are safe.
        after = _INT64_MIN
        for limit in head_chunk_sizes():
            self._flush_items()
            rows = self._db.execute(_HEAD, (env_id, after, limit)).fetchall()
            for row in rows:
                yield ItemMeta(*row)
            if len(rows) < limit:
                return
            after = rows[-1][0]

    def pop(
        self, env_id: int, item_ids: Iterable[int], *, keep_for: int | None = None, retain: bool = False
    ) -> list[QueuedItem]:
        wanted = list(item_ids)
        if not wanted:
            return []
        self._flush_items()
        db = self._db
        db.execute("SAVEPOINT rollbuf_pop")  # all or nothing, even if the caller catches the KeyError
        try:
            rows: list[tuple[int, int, int, int, int]] = []
            for chunk in _chunks(wanted):
                rows += db.execute(_pop_sql(len(chunk)), (env_id, *chunk)).fetchall()
            if len(rows) != len(wanted):
                missing = sorted(set(wanted) - {row[0] for row in rows})
                raise KeyError(f"items {missing or wanted} are not all queued (once) for env {env_id}")
            # Kept for a batch: read, and left where they are until the batch is acknowledged.
            payloads: dict[int, bytes] = {}
            for chunk in _chunks(wanted):
                delete = keep_for is None and not retain
                payloads.update(db.execute(_payloads_sql(len(chunk), delete), chunk).fetchall())
        except BaseException:
            db.execute("ROLLBACK TO rollbuf_pop")
            db.execute("RELEASE rollbuf_pop")
            raise
        db.execute("RELEASE rollbuf_pop")
        found = {row[0]: QueuedItem(ItemMeta(row[0], row[1], row[2], row[3]), row[4], payloads[row[0]]) for row in rows}
        items = [found[i] for i in wanted]
        gone = QueueCounts.of(items)
        self._add(env_id, -gone.items, -gone.groups, -gone.seqs, -gone.tokens, -gone.bytes)
        return items

    def counts(self) -> dict[int, QueueCounts]:
        self._flush_counts()
        rows = self._db.execute(
            "SELECT env_id, items, groups, seqs, tokens, bytes FROM counts WHERE items > 0 AND env_id >= ?", (ANON_ENV,)
        )
        return {row[0]: QueueCounts(*row[1:]) for row in rows}

    # --- side buffers: rows of their own, counted beside the queues (`held_slot`) ---
    def hold(self, env_id: int, group: HeldGroup) -> None:
        m = group.meta
        size = len(group.payload)
        self._db.execute(
            _HOLD, (m.item_id, env_id, m.seqs, m.tokens, m.policy_step, group.held_at, size, group.payload)
        )
        self._add(held_slot(env_id), 1, 1, m.seqs, m.tokens, size)

    def held(self, env_id: int) -> list[HeldMeta]:
        rows = self._db.execute(_HELD, (env_id,)).fetchall()
        return [HeldMeta(ItemMeta(r[0], r[1], r[2], r[3]), r[4], r[5]) for r in rows]

    def release(self, env_id: int, item_ids: Iterable[int]) -> list[HeldGroup]:
        wanted = list(item_ids)
        if not wanted:
            return []
        found: dict[int, HeldGroup] = {}
        for chunk in _chunks(wanted):
            for r in self._db.execute(_held_sql(len(chunk), False), (env_id, *chunk)).fetchall():
                found[r[0]] = HeldGroup(ItemMeta(r[0], r[1], r[2], r[3]), r[4], r[5])
        if len(found) != len(wanted) or len(set(wanted)) != len(wanted):
            raise KeyError(f"groups {wanted} are not all held (once) for env {env_id}")
        for chunk in _chunks(wanted):  # found them all: nothing fails past this point
            self._db.execute(_held_sql(len(chunk), True), (env_id, *chunk))
        out = [found[i] for i in wanted]
        for g in out:
            self._add(held_slot(env_id), -1, -1, -g.meta.seqs, -g.meta.tokens, -len(g.payload))
        return out

    def held_counts(self) -> dict[int, QueueCounts]:
        self._flush_counts()
        rows = self._db.execute(
            "SELECT env_id, items, groups, seqs, tokens, bytes FROM counts WHERE items > 0 AND env_id < ?", (ANON_ENV,)
        )
        return {held_slot(row[0]): QueueCounts(*row[1:]) for row in rows}

    # --- idempotency replies ---
    def get_reply(self, key: str) -> str | None:
        row = self._db.execute("SELECT reply FROM replies WHERE key = ?", (key,)).fetchone()
        return None if row is None else cast(str, row[0])

    def put_reply(self, key: str, reply: str) -> None:
        cur = self._db.execute(
            "INSERT OR REPLACE INTO replies (key, reply, created) VALUES (?, ?, ?)", (key, reply, self._now)
        )
        if cur.lastrowid is not None and cur.lastrowid % REPLY_TRIM_EVERY == 0:
            trim_replies(self._db, self._config, self._now)

    # --- formed batches ---
    def put_batch(self, step: int, header: bytes, item_ids: Sequence[int]) -> None:
        ids = list(item_ids)
        present = sum(
            self._db.execute(
                f"SELECT count(*) FROM payloads WHERE item_id IN ({','.join('?' * len(c))})", c
            ).fetchone()[0]
            for c in _chunks(ids)
        )
        if present != len(set(ids)):
            raise KeyError(f"batch {step} refers to items that were not popped with keep_for={step}")
        self._drop_batches("step = ?", step)
        blob = np.asarray(ids, dtype=_I64).tobytes()
        self._db.execute("INSERT INTO batches (step, header, items) VALUES (?, ?, ?)", (step, header, blob))

    def get_batch(self, step: int) -> bytes | None:
        row = self._db.execute("SELECT header, items FROM batches WHERE step = ?", (step,)).fetchone()
        if row is None:
            return None
        ids = np.frombuffer(row[1], _I64).tolist()
        payloads: dict[int, bytes] = {}
        for chunk in _chunks(ids):
            payloads.update(self._db.execute(_payloads_sql(len(chunk), False), chunk).fetchall())
        return b"".join([row[0], *(payloads[i] for i in ids)])

    def drop_batches_before(self, step: int, *, retain: bool = False) -> None:
        self._drop_batches("step < ?", step, retain)

    def _drop_batches(self, where: str, step: int, retain: bool = False) -> None:
        rows = self._db.execute(f"DELETE FROM batches WHERE {where} RETURNING items", (step,)).fetchall()
        if retain:
            return
        ids = [i for (items,) in rows for i in np.frombuffer(items, _I64).tolist()]
        for chunk in _chunks(ids):
            self._db.execute(f"DELETE FROM payloads WHERE item_id IN ({','.join('?' * len(chunk))})", chunk)

    # --- the ledger ---
    def ledger_add(self, rows: Sequence[LedgerGroup]) -> None:
        if rows:
            self._db.executemany(_LEDGER_ADD, [group_values(r) for r in rows])

    def ledger_decide(
        self,
        ids: Sequence[int],
        fate: str,
        *,
        step: int | None = None,
        reason: str | None = None,
        at: float | None = None,
        kept: bool = False,
    ) -> None:
        if ids:
            self._db.executemany(_LEDGER_DECIDE, [(fate, step, reason, at, int(kept), i) for i in ids])

    def ledger_requeue(self, old_id: int, new_id: int) -> None:
        self._db.execute("UPDATE ledger SET id = ?, fate = ? WHERE id = ?", (new_id, QUEUED, old_id))

    def ledger_groups(self, ids: Iterable[int]) -> list[LedgerGroup]:
        wanted = list(ids)
        found: dict[int, LedgerGroup] = {}
        for chunk in _chunks(wanted):
            sql = f"SELECT {GROUP_COLUMNS} FROM ledger WHERE id IN ({','.join('?' * len(chunk))})"
            found.update((r.id, r) for r in map(group_of, self._db.execute(sql, chunk).fetchall()))
        return [found[i] for i in wanted if i in found]

    def ledger_named(self, group_id: str) -> list[LedgerGroup]:
        sql = f"SELECT {GROUP_COLUMNS} FROM ledger WHERE group_id = ? ORDER BY id"
        return [group_of(r) for r in self._db.execute(sql, (gid_bytes(group_id),)).fetchall()]

    def ledger_scan(self, after_id: int, limit: int) -> list[LedgerGroup]:
        sql = f"SELECT {GROUP_COLUMNS} FROM ledger WHERE id > ? ORDER BY id LIMIT ?"
        return [group_of(r) for r in self._db.execute(sql, (after_id, limit)).fetchall()]

    def ledger_dropped(self, first_step: int, last_step: int, limit: int) -> list[LedgerGroup]:
        sql = (
            f"SELECT {GROUP_COLUMNS} FROM ledger WHERE fate = 'dropped' AND step >= ? AND step <= ? "
            "ORDER BY step, id LIMIT ?"
        )
        return [group_of(r) for r in self._db.execute(sql, (first_step, last_step, limit)).fetchall()]

    def ledger_put_step(self, row: LedgerStep) -> None:
        self._db.execute(f"INSERT OR REPLACE INTO ledger_steps ({STEP_COLUMNS}) VALUES ({','.join('?' * 10)})",
                         step_values(row))  # fmt: skip

    def ledger_committed(self, first: int, before: int, at: float) -> None:
        self._db.execute(
            "UPDATE ledger_steps SET committed_at = ? WHERE step >= ? AND step < ? AND committed_at IS NULL",
            (at, first, before),
        )

    def ledger_steps(self, first: int, last: int) -> list[LedgerStep]:
        sql = f"SELECT {STEP_COLUMNS} FROM ledger_steps WHERE step >= ? AND step <= ? ORDER BY step"
        return [step_of(r) for r in self._db.execute(sql, (first, last)).fetchall()]

    def ledger_prune(self, below_id: int, below_step: int) -> int:
        cur = self._db.execute(
            "DELETE FROM ledger WHERE id < ? AND fate IN ('served', 'dropped') AND kept = 0", (below_id,)
        )
        self._db.execute("DELETE FROM ledger_steps WHERE step < ?", (below_step,))
        return cur.rowcount

    # --- retained payloads: rows of payloads, under their group's id ---
    def keep_payloads(self, items: Sequence[tuple[int, bytes]]) -> None:
        if items:
            self._flush_items()
            self._db.executemany(_APPEND_PAYLOAD, items)

    def kept_payloads(self, ids: Iterable[int]) -> dict[int, bytes]:
        self._flush_items()
        out: dict[int, bytes] = {}
        for chunk in _chunks(list(ids)):
            out.update(self._db.execute(_payloads_sql(len(chunk), False), chunk).fetchall())
        return out

    def kept_oldest(self, limit: int) -> list[KeptPayload]:
        rows = self._db.execute(
            "SELECT id, coalesce(step, 0), bytes FROM ledger WHERE kept = 1 ORDER BY step, id LIMIT ?", (limit,)
        ).fetchall()
        return [KeptPayload(*r) for r in rows]

    def prune_payloads(self, ids: Sequence[int]) -> None:
        for chunk in _chunks(list(ids)):
            marks = ",".join("?" * len(chunk))
            self._db.execute(f"DELETE FROM payloads WHERE item_id IN ({marks})", chunk)
            self._db.execute(f"UPDATE ledger SET kept = 0 WHERE id IN ({marks})", chunk)

    # --- envs ---
    def put_env(self, env_id: int, name: str, version: int, record: str) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO envs (env_id, name, version, record) VALUES (?,?,?,?)",
            (env_id, name, version, record),
        )

    def envs_since(self, version: int) -> list[tuple[int, str]]:
        rows = self._db.execute("SELECT env_id, record FROM envs WHERE version > ? ORDER BY env_id", (version,))
        return [(row[0], row[1]) for row in rows]

    def count_named(self, name: str) -> int:
        return int(self._db.execute("SELECT count(*) FROM envs WHERE name = ?", (name,)).fetchone()[0])

    # --- counters ---
    def add_counts(self, kind: str, deltas: Mapping[str, int]) -> None:
        if deltas:
            self._db.executemany(_ADD_COUNTER, [(kind, name, n) for name, n in deltas.items()])

    def get_counts(self, kind: str) -> dict[str, int]:
        return dict(self._db.execute("SELECT name, n FROM counters WHERE kind = ?", (kind,)).fetchall())

    def clear(self) -> None:
        self._rows.clear()
        self._delta.clear()
        self._values.clear()
        for table in CLEARED:
            self._db.execute(f"DELETE FROM {table}")  # meta (next_item_id) stays: ids keep increasing


def trim_replies(db: sqlite3.Connection, config: SqliteConfig, now: float) -> None:
    """Forget all but the newest `max_replies` replies, and those older than `reply_ttl`.

    Rowids grow with every insert (a replaced reply gets a new one), so they order replies by age."""
    newest = db.execute("SELECT max(rowid) FROM replies").fetchone()[0]
    if newest is not None:
        db.execute("DELETE FROM replies WHERE rowid <= ?", (newest - config.max_replies,))
    if config.reply_ttl is not None:
        db.execute("DELETE FROM replies WHERE created < ?", (now - config.reply_ttl,))
