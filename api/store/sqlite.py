"""Durable embedded backend: one SQLite file in WAL mode, the default of `rollbuf serve`.

Every transaction is `BEGIN IMMEDIATE ... COMMIT` on one dedicated thread that owns the connection, so
the event loop never blocks on disk and SQLite's single-writer rule is the only lock needed — also across
processes sharing the file. `transact` returns after COMMIT: with `synchronous=NORMAL` (the default) a
committed transaction survives `kill -9` of the server; `?synchronous=FULL` also survives power loss.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar
from urllib.parse import parse_qs, urlsplit

import msgpack

from api.store.base import BufferedGroup, ItemMeta, QueueCounts, QueuedItem, Store, Txn

T = TypeVar("T")

SCHEMA_VERSION = 1
REPLY_RETENTION = 1_000_000
"""Idempotency replies kept (newest first): at ~100 bytes each, ~100 MB of disk at most, and far more
retries than any client makes."""
HEAD_CHUNK = 256
"""Rows fetched at a time while reading the head of a queue: a window rarely needs more."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS items (
    item_id INTEGER PRIMARY KEY, env_id INTEGER NOT NULL, seqs INTEGER NOT NULL, tokens INTEGER NOT NULL,
    policy_step INTEGER NOT NULL, n_groups INTEGER NOT NULL, payload BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS items_by_env ON items (env_id, item_id);
CREATE TABLE IF NOT EXISTS counts (
    env_id INTEGER PRIMARY KEY, items INTEGER NOT NULL, groups INTEGER NOT NULL, seqs INTEGER NOT NULL,
    tokens INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS buffers (env_id INTEGER PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS replies (seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT UNIQUE NOT NULL,
    reply TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (step INTEGER PRIMARY KEY, payload BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS ids (name TEXT PRIMARY KEY, next INTEGER NOT NULL);
"""


def sqlite_path(url: str) -> tuple[Path, str]:
    """`sqlite:///rel/path.db` is relative to the working directory, `sqlite:////abs/path.db` absolute."""
    parts = urlsplit(url)
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    if not path:
        raise ValueError(f"store URL {url!r} names no file: use sqlite:///path/to/rollbuf.db")
    sync = parse_qs(parts.query).get("synchronous", ["NORMAL"])[-1].upper()
    if sync not in ("NORMAL", "FULL"):
        raise ValueError(f"store URL {url!r}: synchronous must be NORMAL or FULL")
    return Path(path), sync


class SqliteTxn(Txn):
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def get_value(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_value(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, value))

    def next_item_id(self) -> int:
        row = self._db.execute("UPDATE ids SET next = next + 1 WHERE name = 'item' RETURNING next - 1").fetchone()
        return int(row[0])

    def append(self, env_id: int, item: QueuedItem) -> None:
        m = item.meta
        self._db.execute(
            "INSERT INTO items (item_id, env_id, seqs, tokens, policy_step, n_groups, payload) VALUES (?,?,?,?,?,?,?)",
            (m.item_id, env_id, m.seqs, m.tokens, m.policy_step, item.n_groups, item.payload),
        )
        self._add_counts(env_id, QueueCounts(1, item.n_groups, m.seqs, m.tokens))

    def _add_counts(self, env_id: int, c: QueueCounts) -> None:
        self._db.execute(
            "INSERT INTO counts (env_id, items, groups, seqs, tokens) VALUES (?,?,?,?,?) ON CONFLICT (env_id) DO "
            "UPDATE SET items = items + excluded.items, groups = groups + excluded.groups, "
            "seqs = seqs + excluded.seqs, tokens = tokens + excluded.tokens",
            (env_id, c.items, c.groups, c.seqs, c.tokens),
        )

    def head(self, env_id: int) -> Iterator[ItemMeta]:
        after = 0
        while True:
            rows = self._db.execute(
                "SELECT item_id, seqs, tokens, policy_step FROM items WHERE env_id = ? AND item_id > ? "
                "ORDER BY item_id LIMIT ?",
                (env_id, after, HEAD_CHUNK),
            ).fetchall()
            for row in rows:
                yield ItemMeta(*row)
            if len(rows) < HEAD_CHUNK:
                return
            after = rows[-1][0]

    def pop(self, env_id: int, item_ids: Iterable[int]) -> list[QueuedItem]:
        wanted = list(item_ids)
        if not wanted:
            return []
        marks = ",".join("?" * len(wanted))
        self._db.execute("SAVEPOINT pop")  # a failed pop leaves the queue as it was, even if the caller goes on
        rows = self._db.execute(
            f"DELETE FROM items WHERE env_id = ? AND item_id IN ({marks}) "
            "RETURNING item_id, seqs, tokens, policy_step, n_groups, payload",
            (env_id, *wanted),
        ).fetchall()
        found = {row[0]: QueuedItem(ItemMeta(*row[:4]), row[4], row[5]) for row in rows}
        if len(found) != len(wanted):
            self._db.execute("ROLLBACK TO pop")
            self._db.execute("RELEASE pop")
            raise KeyError(f"items {sorted(set(wanted) - set(found))} are not queued for env {env_id}")
        self._db.execute("RELEASE pop")
        items = [found[i] for i in wanted]
        total = QueueCounts()
        for it in items:
            total = total + QueueCounts(1, it.n_groups, it.meta.seqs, it.meta.tokens)
        self._add_counts(env_id, QueueCounts() - total)
        return items

    def counts(self) -> dict[int, QueueCounts]:
        rows = self._db.execute("SELECT env_id, items, groups, seqs, tokens FROM counts WHERE items > 0")
        return {row[0]: QueueCounts(*row[1:]) for row in rows}

    def get_buffer(self, env_id: int) -> list[BufferedGroup]:
        row = self._db.execute("SELECT data FROM buffers WHERE env_id = ?", (env_id,)).fetchone()
        return [] if row is None else [BufferedGroup(*g) for g in msgpack.unpackb(row[0])]

    def set_buffer(self, env_id: int, groups: list[BufferedGroup]) -> None:
        if not groups:
            self._db.execute("DELETE FROM buffers WHERE env_id = ?", (env_id,))
            return
        data = msgpack.packb([[g.seqs, g.tokens, g.policy_step, g.payload] for g in groups], use_bin_type=True)
        self._db.execute("INSERT OR REPLACE INTO buffers (env_id, data) VALUES (?, ?)", (env_id, data))

    def get_reply(self, key: str) -> str | None:
        row = self._db.execute("SELECT reply FROM replies WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def put_reply(self, key: str, reply: str) -> None:
        cur = self._db.execute("INSERT OR REPLACE INTO replies (key, reply) VALUES (?, ?) RETURNING seq", (key, reply))
        seq = int(cur.fetchone()[0])
        if seq % 1024 == 0:  # trim now and then, not on every insert
            self._db.execute("DELETE FROM replies WHERE seq <= ?", (seq - REPLY_RETENTION,))

    def put_batch(self, step: int, payload: bytes) -> None:
        self._db.execute("INSERT OR REPLACE INTO batches (step, payload) VALUES (?, ?)", (step, payload))

    def get_batch(self, step: int) -> bytes | None:
        row = self._db.execute("SELECT payload FROM batches WHERE step = ?", (step,)).fetchone()
        return None if row is None else bytes(row[0])

    def drop_batches_before(self, step: int) -> None:
        self._db.execute("DELETE FROM batches WHERE step < ?", (step,))

    def clear(self) -> None:
        for table in ("kv", "items", "counts", "buffers", "replies", "batches"):
            self._db.execute(f"DELETE FROM {table}")
        self._db.execute("INSERT INTO kv (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))


class SqliteStore(Store):
    def __init__(self, url: str) -> None:
        self.url = url
        self.path, sync = sqlite_path(url)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollbuf-sqlite")
        self._db = self._executor.submit(self._open, sync).result()
        self._closed = threading.Event()

    def _open(self, sync: str) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=True, timeout=30.0)
        db.execute("PRAGMA journal_mode = WAL")
        db.execute(f"PRAGMA synchronous = {sync}")
        db.execute("PRAGMA busy_timeout = 30000")
        db.executescript(_SCHEMA)  # idempotent; executescript commits on its own
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("INSERT OR IGNORE INTO ids (name, next) VALUES ('item', 1)")
            row = db.execute("SELECT value FROM kv WHERE key = 'schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO kv (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise RuntimeError(f"{self.path}: schema version {row[0]}, this rollbuf reads {SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            db.close()
            raise
        return db

    def _run(self, fn: Callable[[Txn], T]) -> T:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            result = fn(SqliteTxn(db))
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result

    async def transact(self, fn: Callable[[Txn], T]) -> T:
        if self._closed.is_set():
            raise RuntimeError("the store is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._run, fn)

    async def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._db.close)
        self._executor.shutdown(wait=True)
