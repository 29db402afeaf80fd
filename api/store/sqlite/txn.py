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

from api.store.base import ANON_ENV, ItemMeta, QueueCounts, QueuedItem, Txn
from api.store.jobs import head_chunk_sizes
from api.store.sqlite.config import SqliteConfig
from api.store.sqlite.deferred import REPLIES, Counts, Deferred, Row, add_to, counts_of
from api.store.sqlite.held import SqliteHeld
from api.store.sqlite.ledger import SqliteLedger, chunks
from api.store.sqlite.payloads import COLUMNS, INSERT, PayloadTier
from api.store.sqlite.rollouts import SqliteOpenGroupTxn
from api.store.sqlite.schema import CLEARED
from api.store.sqlite.tasks import SqliteTaskTxn

REPLY_TRIM_EVERY = 1024
"""Old replies are trimmed every this many inserted replies, not on every insert."""

_INT64_MIN = -(2**63)
_I64 = np.dtype("<i8")

_HEAD = (
    "SELECT item_id, seqs, tokens, policy_step FROM queue WHERE env_id = ? AND item_id > ? ORDER BY env_id, item_id "
    "LIMIT ?"
)
_APPEND = "INSERT INTO queue (item_id, env_id, seqs, tokens, policy_step, n_groups) VALUES (?,?,?,?,?,?)"

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


_SCAN_PAGE = 64
"""Payloads a scan (`payloads_with`) reads at a time."""


@cache
def _payloads_sql(n: int, delete: bool) -> str:
    marks = ",".join("?" * n)
    if delete:
        return f"DELETE FROM payloads WHERE item_id IN ({marks}) RETURNING {COLUMNS}"
    return f"SELECT {COLUMNS} FROM payloads WHERE item_id IN ({marks})"


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


class _Writes:
    """A transaction's writes that wait for the COMMIT, and what its parts (held groups, the ledger) write
    through. Apart from `SqliteTxn` so that the parts hold no reference back to it: a transaction and its parts
    referring to each other were a reference cycle, which left every transaction's objects (about 20 per
    ingested group) to the cyclic garbage collector rather than freed as its function returned."""

    __slots__ = ("db", "config", "deferred", "now", "ops", "delta")

    def __init__(self, db: sqlite3.Connection, config: SqliteConfig, deferred: Deferred) -> None:
        self.db = db
        self.config = config
        self.deferred = deferred
        self.now = time.time()
        self.ops: dict[str, list[Row]] = {}
        self.delta: Counts = {}

    def defer(self, sql: str, rows: list[Row]) -> None:
        mine = self.ops.get(sql)
        if mine is None:
            self.ops[sql] = rows
        else:
            mine.extend(rows)

    def flush(self) -> None:
        """Write what waits: the statement that follows may read or order against it."""
        flush(self.db, self.config, self.deferred, self.now, self.ops, self.delta)

    def add(self, env_id: int, items: int, groups: int, seqs: int, tokens: int, size: int) -> None:
        add_to(self.delta, env_id, (items, groups, seqs, tokens, size))

    def counts(self, held: bool) -> dict[int, QueueCounts]:
        return counts_of(self.deferred.queue_counts(self.db, self.delta, held=held, anon_env=ANON_ENV))

    def held_counts(self) -> dict[int, QueueCounts]:
        return self.counts(True)


class SqliteTxn(Txn):
    """Inserts of new rows (queue items and payloads, ledger rows, replies, counters) and count deltas wait in
    memory, this function's own until it returns (`_Writes`), then the transaction's (`Deferred`), and go out
    merged before the COMMIT; any other statement writes them first (`_flush`)."""

    __slots__ = (
        "_db",
        "_config",
        "_ids",
        "_w",
        "_defer",
        "_flush",
        "_add",
        "_replies",
        "_values",
        "_payloads",
        "held",
        "ledger",
        "tasks",
    )

    def __init__(
        self,
        db: sqlite3.Connection,
        config: SqliteConfig,
        ids: ItemIds,
        payloads: PayloadTier,
        values: dict[str, str | None] | None = None,
        deferred: Deferred | None = None,
    ) -> None:
        self._db = db
        self._payloads = payloads
        """Where payload bytes go and come from (segment files beside the database, small ones inline)."""
        self._values = {} if values is None else values
        """Values read or written in this SQLite transaction, shared by the functions of one group commit (the
        driver forgets them when one is undone): the run state is read once per commit, not once per request."""
        self._config = config
        self._ids = ids
        self._w = w = _Writes(db, config, Deferred() if deferred is None else deferred)
        self._defer, self._flush, self._add = w.defer, w.flush, w.add  # bound once: no delegating frame per call
        self._replies: dict[str, str] = {}
        self.held = SqliteHeld(db, w.add, w.flush, w.held_counts)
        self.ledger = SqliteLedger(db, w.flush, w.defer, payloads)
        self.tasks = SqliteTaskTxn(db)
        self.rollouts = SqliteOpenGroupTxn(db)

    # --- bookkeeping the store calls around the transaction function ---
    def finish(self) -> None:
        """The function returned: what it left waiting waits for the transaction's COMMIT."""
        self._w.deferred.finished(self._w.ops, self._w.delta, self._replies)

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

    def delete_value(self, key: str) -> None:
        self._db.execute("DELETE FROM kv WHERE key = ?", (key,))
        self._values[key] = None

    # --- the queue ---
    def next_item_id(self) -> int:
        return self._ids.take(self._db)

    def append(self, env_id: int, item: QueuedItem) -> None:
        m = item.meta
        self._defer(_APPEND, [(m.item_id, env_id, m.seqs, m.tokens, m.policy_step, item.n_groups)])
        self._defer(INSERT, [self._payloads.row(self._db, m.item_id, item.payload)])
        self._add(env_id, 1, item.n_groups, m.seqs, m.tokens, len(item.payload))

    def head(self, env_id: int) -> Iterator[ItemMeta]:
        self._flush()
        return self._head(env_id)

    def _head(self, env_id: int) -> Iterator[ItemMeta]:
        # Keyset pages, not one open cursor: pops and appends between two reads of the iterator are safe.
        after = _INT64_MIN
        for limit in head_chunk_sizes():
            self._flush()
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
        self._flush()
        db = self._db
        db.execute("SAVEPOINT rollbuf_pop")  # all or nothing, even if the caller catches the KeyError
        try:
            rows: list[tuple[int, int, int, int, int]] = []
            for chunk in chunks(wanted):
                rows += db.execute(_pop_sql(len(chunk)), (env_id, *chunk)).fetchall()
            if len(rows) != len(wanted):
                missing = sorted(set(wanted) - {row[0] for row in rows})
                raise KeyError(f"items {missing or wanted} are not all queued (once) for env {env_id}")
            # Kept for a batch: read, and left where they are until the batch is acknowledged.
            stored: list[tuple[int, bytes, int | None, int | None, int | None, int | None]] = []
            for chunk in chunks(wanted):
                delete = keep_for is None and not retain
                stored += db.execute(_payloads_sql(len(chunk), delete), chunk).fetchall()
            payloads = self._payloads.resolve(stored)
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

    def drop_lost(self, item_ids: Sequence[int]) -> dict[int, list[tuple[ItemMeta, int]]]:
        self._flush()
        out: dict[int, list[tuple[ItemMeta, int]]] = {}
        for chunk in chunks(list(item_ids)):
            marks = ",".join("?" * len(chunk))
            rows = self._db.execute(
                f"DELETE FROM queue WHERE item_id IN ({marks}) "
                "RETURNING env_id, item_id, seqs, tokens, policy_step, n_groups",
                chunk,
            ).fetchall()
            if not rows:
                continue
            queued = [row[1] for row in rows]
            marks = ",".join("?" * len(queued))
            sizes = dict(
                self._db.execute(  # the size counted at append: the payload's length, wherever it is
                    f"DELETE FROM payloads WHERE item_id IN ({marks}) "
                    "RETURNING item_id, coalesce(length, length(payload))",
                    queued,
                ).fetchall()
            )
            for env_id, item_id, seqs, tokens, policy_step, n_groups in rows:
                self._add(env_id, -1, -n_groups, -seqs, -tokens, -int(sizes.get(item_id, 0)))
                out.setdefault(env_id, []).append((ItemMeta(item_id, seqs, tokens, policy_step), n_groups))
        return out

    def counts(self) -> dict[int, QueueCounts]:
        return self._w.counts(False)

    # --- idempotency replies ---
    def get_reply(self, key: str) -> str | None:
        # Replies put in this transaction are not necessarily written yet: memory first (no other process
        # writes while this one holds the write lock).
        reply = self._replies.get(key)
        if reply is None:
            reply = self._w.deferred.replies.get(key)
        if reply is not None:
            return reply
        row = self._db.execute("SELECT reply FROM replies WHERE key = ?", (key,)).fetchone()
        return None if row is None else cast(str, row[0])

    def put_reply(self, key: str, reply: str) -> None:
        self._replies[key] = reply
        self._defer(REPLIES, [(key, reply, self._w.now)])

    # --- formed batches ---
    def put_batch(self, step: int, header: bytes, item_ids: Sequence[int]) -> None:
        self._flush()
        ids = list(item_ids)
        present = sum(
            self._db.execute(
                f"SELECT count(*) FROM payloads WHERE item_id IN ({','.join('?' * len(c))})", c
            ).fetchone()[0]
            for c in chunks(ids)
        )
        if present != len(set(ids)):
            raise KeyError(f"batch {step} refers to items that were not popped with keep_for={step}")
        self._drop_batches("step = ?", step)
        blob = np.asarray(ids, dtype=_I64).tobytes()
        self._db.execute("INSERT INTO batches (step, header, items) VALUES (?, ?, ?)", (step, header, blob))

    def get_batch(self, step: int) -> bytes | None:
        self._flush()
        row = self._db.execute("SELECT header, items FROM batches WHERE step = ?", (step,)).fetchone()
        if row is None:
            return None
        ids = np.frombuffer(row[1], _I64).tolist()
        rows = [r for chunk in chunks(ids) for r in self._db.execute(_payloads_sql(len(chunk), False), chunk)]
        payloads = self._payloads.resolve(rows)
        return b"".join([row[0], *(payloads[i] for i in ids)])

    def drop_batches_before(self, step: int, *, retain: bool = False) -> None:
        self._drop_batches("step < ?", step, retain)

    def _drop_batches(self, where: str, step: int, retain: bool = False) -> None:
        self._flush()
        rows = self._db.execute(f"DELETE FROM batches WHERE {where} RETURNING items", (step,)).fetchall()
        if retain:
            return
        ids = [i for (items,) in rows for i in np.frombuffer(items, _I64).tolist()]
        for chunk in chunks(ids):
            self._db.execute(f"DELETE FROM payloads WHERE item_id IN ({','.join('?' * len(chunk))})", chunk)

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
        if deltas:  # an upsert that adds: written later, merged, it comes to the same
            self._defer(_ADD_COUNTER, [(kind, name, n) for name, n in deltas.items()])

    def get_counts(self, kind: str) -> dict[str, int]:
        self._flush()
        return dict(self._db.execute("SELECT name, n FROM counters WHERE kind = ?", (kind,)).fetchall())

    def payloads_with(self, marker: bytes) -> Iterator[bytes]:
        self._flush()
        db = self._db
        rows = db.execute(f"SELECT {COLUMNS} FROM payloads WHERE segment IS NOT NULL OR instr(payload, ?)", (marker,))
        while page := rows.fetchmany(_SCAN_PAGE):
            yield from (p for p in self._payloads.resolve(page).values() if marker in p)
        held = db.execute("SELECT payload FROM held WHERE instr(payload, ?)", (marker,))
        while page := held.fetchmany(_SCAN_PAGE):
            yield from (bytes(p) for (p,) in page)

    def clear(self) -> None:
        self._flush()
        self._w.deferred.cleared()
        self._replies.clear()
        self._values.clear()
        for table in CLEARED:
            self._db.execute(f"DELETE FROM {table}")  # meta (next_item_id) stays: ids keep increasing
        self._payloads.clear(self._db)


def flush(
    db: sqlite3.Connection,
    config: SqliteConfig,
    deferred: Deferred,
    now: float,
    ops: dict[str, list[Row]] | None = None,
    counts: Counts | None = None,
) -> None:
    """Write what waits in `deferred` (and a function's own `ops` and `counts`), trimming old replies every
    REPLY_TRIM_EVERY written."""
    deferred.flush(db, {} if ops is None else ops, {} if counts is None else counts)
    if deferred.replies_written >= REPLY_TRIM_EVERY:
        deferred.replies_written = 0
        trim_replies(db, config, now)


def trim_replies(db: sqlite3.Connection, config: SqliteConfig, now: float) -> None:
    """Forget all but the newest `max_replies` replies, and those older than `reply_ttl`.

    Rowids grow with every insert (a replaced reply gets a new one), so they order replies by age."""
    newest = db.execute("SELECT max(rowid) FROM replies").fetchone()[0]
    if newest is not None:
        db.execute("DELETE FROM replies WHERE rowid <= ?", (newest - config.max_replies,))
    if config.reply_ttl is not None:
        db.execute("DELETE FROM replies WHERE created < ?", (now - config.reply_ttl,))
