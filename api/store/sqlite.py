"""Durable embedded backend: one SQLite file in WAL mode, the default of `rollbuf serve`.

All SQLite work happens on one dedicated thread that owns the connection: the event loop never blocks on
disk, the connection is never shared between threads, and SQLite's single-writer lock is the only lock
needed (also between processes sharing the file). Transactions queued while the thread is busy are
committed together (group commit): one `BEGIN IMMEDIATE ... COMMIT` with a SAVEPOINT per function, so a
function that raises rolls back only itself. `transact` returns after COMMIT: with `synchronous=NORMAL`
(the default) a committed transaction survives `kill -9` of the server; `?synchronous=FULL` also survives
power loss. See docs/stores.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import parse_qs, unquote, urlsplit

import msgpack
import numpy as np

from api.store.base import BufferedGroup, ItemMeta, QueueCounts, QueuedItem, Store, Txn
from api.store.jobs import GROUP_MAX, Job, Jobs, Stop, deliver, head_chunk_sizes, next_group, refuse_left

T = TypeVar("T")

SCHEMA_VERSION = 1
"""Bumped with every change of layout; a file of another version is refused, never silently reinterpreted."""
POP_CHUNK = 500
"""Ids per DELETE statement: stays under SQLite's host-parameter limit on any build."""
REPLY_TRIM_EVERY = 1024
"""Old replies are trimmed every this many inserted replies, not on every insert."""
CHECKPOINT_EVERY = 256
"""Commits between two WAL checkpoints (each also runs at least once a second while there are commits)."""
PAGE_SIZE = 65536
"""SQLite's largest page, for new files. A group's payload (~200 KB at 8 x 2k tokens) spans 4 pages instead
of 49, so popping a 1024 x 2k batch (25 MB) reads ~400 pages instead of ~6000: the store thread's CPU per
binary /batch fell from ~45 to ~12 ms (in-process, 1024 x 2048), ingest CPU per group did not rise. 16 and
32 KiB pages did not help. A file created with another page size keeps it (WAL mode fixes it)."""
BUSY_TIMEOUT_S = 30.0
"""How long BEGIN IMMEDIATE waits for another process holding the write lock before failing."""

_INT64_MIN = -(2**63)
_I64 = np.dtype("<i8")

_DDL = {
    "values": 'CREATE TABLE "values" (key TEXT PRIMARY KEY, value TEXT NOT NULL)',
    # The queues, clustered by env and age: reading a queue's head never touches a payload page.
    "queue": "CREATE TABLE queue (env_id INTEGER NOT NULL, item_id INTEGER NOT NULL, seqs INTEGER NOT NULL, "
    "tokens INTEGER NOT NULL, policy_step INTEGER NOT NULL, n_groups INTEGER NOT NULL, "
    "PRIMARY KEY (env_id, item_id)) WITHOUT ROWID",
    # Payloads of queued items, and of popped items a kept batch refers to (batches.items).
    "payloads": "CREATE TABLE payloads (item_id INTEGER PRIMARY KEY, payload BLOB NOT NULL)",
    "counts": "CREATE TABLE counts (env_id INTEGER PRIMARY KEY, items INTEGER NOT NULL, groups INTEGER NOT NULL, "
    "seqs INTEGER NOT NULL, tokens INTEGER NOT NULL)",
    "buffers": "CREATE TABLE buffers (env_id INTEGER PRIMARY KEY, data BLOB NOT NULL)",
    "replies": "CREATE TABLE replies (key TEXT PRIMARY KEY, reply TEXT NOT NULL, created REAL NOT NULL)",
    "replies_by_age": "CREATE INDEX replies_by_age ON replies (created)",
    "batches": "CREATE TABLE batches (step INTEGER PRIMARY KEY, header BLOB NOT NULL, items BLOB NOT NULL)",
    # Internal state that clear() keeps: schema_version, next_item_id.
    "meta": "CREATE TABLE meta (key TEXT PRIMARY KEY, value NOT NULL)",
}
_CLEARED = ('"values"', "queue", "payloads", "counts", "buffers", "replies", "batches")

_HEAD = (
    "SELECT item_id, seqs, tokens, policy_step FROM queue WHERE env_id = ? AND item_id > ? ORDER BY env_id, item_id "
    "LIMIT ?"
)
_APPEND = "INSERT INTO queue (item_id, env_id, seqs, tokens, policy_step, n_groups) VALUES (?,?,?,?,?,?)"
_APPEND_PAYLOAD = "INSERT INTO payloads (item_id, payload) VALUES (?,?)"
_ADD_COUNTS = (
    "INSERT INTO counts (env_id, items, groups, seqs, tokens) VALUES (?,?,?,?,?) ON CONFLICT (env_id) DO UPDATE SET "
    "items = items + excluded.items, groups = groups + excluded.groups, seqs = seqs + excluded.seqs, "
    "tokens = tokens + excluded.tokens"
)


@cache
def _pop_sql(n: int) -> str:
    marks = ",".join("?" * n)
    return (
        f"DELETE FROM queue WHERE env_id = ? AND item_id IN ({marks}) "
        "RETURNING item_id, seqs, tokens, policy_step, n_groups"
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


@dataclass(frozen=True, slots=True)
class SqliteConfig:
    """What a `sqlite:///path.db?...` URL says."""

    path: Path
    synchronous: str = "NORMAL"
    """NORMAL: commits survive a crash of the process; FULL: also a crash of the machine (fsync per commit)."""
    max_replies: int = 1_000_000
    """Idempotency replies kept, newest first (~200 bytes each on disk): far more retries than clients make."""
    reply_ttl: float | None = None
    """Replies older than this many seconds are forgotten (at the next trim). Measured against the stored
    wall-clock creation time, so a restart neither resets nor extends the window. None: no time limit."""


def parse_url(url: str) -> SqliteConfig:
    """`sqlite:///rel/path.db` is relative to the working directory, `sqlite:////abs/path.db` absolute.

    Query parameters: `synchronous=NORMAL|FULL`, `max_replies=N`, `reply_ttl=SECONDS`.
    """
    parts = urlsplit(url)
    if parts.scheme != "sqlite" or parts.netloc:
        raise ValueError(f"store URL {url!r}: use sqlite:///relative/path.db or sqlite:////absolute/path.db")
    path = unquote(parts.path[1:] if parts.path.startswith("/") else parts.path)
    if not path or path.endswith("/") or path == ":memory:":
        raise ValueError(f"store URL {url!r} names no file: use sqlite:///path/to/rollbuf.db (or memory://)")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = set(query) - {"synchronous", "max_replies", "reply_ttl"}
    if unknown:
        raise ValueError(f"store URL {url!r}: unknown parameter(s) {', '.join(sorted(unknown))}")
    sync = query.get("synchronous", "NORMAL").upper()
    if sync not in ("NORMAL", "FULL"):
        raise ValueError(f"store URL {url!r}: synchronous must be NORMAL or FULL")
    try:
        max_replies = int(query.get("max_replies", 1_000_000))
        ttl = float(query["reply_ttl"]) if "reply_ttl" in query else None
    except ValueError:
        raise ValueError(f"store URL {url!r}: max_replies must be an integer, reply_ttl a number of seconds") from None
    if max_replies < 0 or (ttl is not None and not ttl >= 0):
        raise ValueError(f"store URL {url!r}: max_replies and reply_ttl must not be negative")
    return SqliteConfig(Path(path), sync, max_replies, ttl)


class _Ids:
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

    __slots__ = ("_db", "_config", "_ids", "_now", "_rows", "_payloads", "_delta")

    def __init__(self, db: sqlite3.Connection, config: SqliteConfig, ids: _Ids) -> None:
        self._db = db
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

    def _add(self, env_id: int, items: int, groups: int, seqs: int, tokens: int) -> None:
        d = self._delta.get(env_id)
        if d is None:
            self._delta[env_id] = [items, groups, seqs, tokens]
        else:
            d[0] += items
            d[1] += groups
            d[2] += seqs
            d[3] += tokens

    # --- values ---
    def get_value(self, key: str) -> str | None:
        row = self._db.execute('SELECT value FROM "values" WHERE key = ?', (key,)).fetchone()
        return None if row is None else cast(str, row[0])

    def set_value(self, key: str, value: str) -> None:
        self._db.execute('INSERT OR REPLACE INTO "values" (key, value) VALUES (?, ?)', (key, value))

    # --- the queue ---
    def next_item_id(self) -> int:
        return self._ids.take(self._db)

    def append(self, env_id: int, item: QueuedItem) -> None:
        m = item.meta
        self._rows.append((m.item_id, env_id, m.seqs, m.tokens, m.policy_step, item.n_groups))
        self._payloads.append((m.item_id, item.payload))
        self._add(env_id, 1, item.n_groups, m.seqs, m.tokens)

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

    def pop(self, env_id: int, item_ids: Iterable[int], *, keep_for: int | None = None) -> list[QueuedItem]:
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
                payloads.update(db.execute(_payloads_sql(len(chunk), keep_for is None), chunk).fetchall())
        except BaseException:
            db.execute("ROLLBACK TO rollbuf_pop")
            db.execute("RELEASE rollbuf_pop")
            raise
        db.execute("RELEASE rollbuf_pop")
        found = {row[0]: QueuedItem(ItemMeta(row[0], row[1], row[2], row[3]), row[4], payloads[row[0]]) for row in rows}
        items = [found[i] for i in wanted]
        self._add(
            env_id,
            -len(items),
            -sum(it.n_groups for it in items),
            -sum(it.meta.seqs for it in items),
            -sum(it.meta.tokens for it in items),
        )
        return items

    def counts(self) -> dict[int, QueueCounts]:
        self._flush_counts()
        rows = self._db.execute("SELECT env_id, items, groups, seqs, tokens FROM counts WHERE items > 0")
        return {row[0]: QueueCounts(row[1], row[2], row[3], row[4]) for row in rows}

    # --- side buffers ---
    def get_buffer(self, env_id: int) -> list[BufferedGroup]:
        row = self._db.execute("SELECT data FROM buffers WHERE env_id = ?", (env_id,)).fetchone()
        return [] if row is None else [BufferedGroup(*g) for g in msgpack.unpackb(row[0])]

    def set_buffer(self, env_id: int, groups: list[BufferedGroup]) -> None:
        if not groups:
            self._db.execute("DELETE FROM buffers WHERE env_id = ?", (env_id,))
            return
        data = msgpack.packb([(g.seqs, g.tokens, g.policy_step, g.payload) for g in groups], use_bin_type=True)
        self._db.execute("INSERT OR REPLACE INTO buffers (env_id, data) VALUES (?, ?)", (env_id, data))

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

    def drop_batches_before(self, step: int) -> None:
        self._drop_batches("step < ?", step)

    def _drop_batches(self, where: str, step: int) -> None:
        rows = self._db.execute(f"DELETE FROM batches WHERE {where} RETURNING items", (step,)).fetchall()
        ids = [i for (items,) in rows for i in np.frombuffer(items, _I64).tolist()]
        for chunk in _chunks(ids):
            self._db.execute(f"DELETE FROM payloads WHERE item_id IN ({','.join('?' * len(chunk))})", chunk)

    def clear(self) -> None:
        self._rows.clear()
        self._delta.clear()
        for table in _CLEARED:
            self._db.execute(f"DELETE FROM {table}")  # meta (next_item_id) stays: ids keep increasing


def trim_replies(db: sqlite3.Connection, config: SqliteConfig, now: float) -> None:
    """Forget all but the newest `max_replies` replies, and those older than `reply_ttl`.

    Rowids grow with every insert (a replaced reply gets a new one), so they order replies by age."""
    newest = db.execute("SELECT max(rowid) FROM replies").fetchone()[0]
    if newest is not None:
        db.execute("DELETE FROM replies WHERE rowid <= ?", (newest - config.max_replies,))
    if config.reply_ttl is not None:
        db.execute("DELETE FROM replies WHERE created < ?", (now - config.reply_ttl,))


class _Checkpointer:
    """Copies the WAL back into the database file on its own thread and connection.

    SQLite's automatic checkpoint runs inside the COMMIT that crosses its threshold, fsync included, so one
    writer transaction in ~40 would wait for it. A PASSIVE checkpoint from another connection never blocks
    the writer, and the WAL stays as short as if the writer had checkpointed itself."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._wake = threading.Event()
        self._stopping = False
        self._commits = 0
        self._thread = threading.Thread(target=self._main, name="rollbuf-sqlite-checkpoint", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """Called by the writer thread after each COMMIT."""
        self._commits += 1
        if self._commits >= CHECKPOINT_EVERY:
            self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def _main(self) -> None:
        db = sqlite3.connect(self._path, isolation_level=None, timeout=BUSY_TIMEOUT_S, check_same_thread=True)
        try:
            while not self._stopping:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                if self._commits and not self._stopping:
                    self._commits = 0
                    with contextlib.suppress(sqlite3.Error):  # busy now: the next round catches up
                        db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        finally:
            db.close()


class SqliteStore(Store):
    """One connection, owned by one thread, fed through a queue of transaction functions."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.config = parse_url(url)
        self.path = self.config.path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._ids = _Ids()
        self._jobs: Jobs = queue.SimpleQueue()
        self._closed = False
        # False once the thread stops taking jobs; changed and checked under _lock around every queue put.
        self._accepting = True
        self._lock = threading.Lock()
        opened: Future[sqlite3.Connection] = Future()
        self._thread = threading.Thread(target=self._main, args=(opened,), name="rollbuf-sqlite", daemon=True)
        self._thread.start()
        try:
            opened.result()
        except BaseException:
            self._thread.join()
            raise

    async def transact(self, fn: Callable[[Txn], T], *, replies: Sequence[str] = ()) -> T:
        if self._closed:
            raise RuntimeError(f"store {self.url} is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            if not self._accepting:
                raise RuntimeError(f"store {self.url} is closed")
            self._jobs.put(Job(fn, future, loop))
        return cast(T, await future)

    async def close(self) -> None:
        """Finish the transactions already queued, then close the connection and end the thread."""
        if self._closed:
            return
        self._closed = True
        done: Future[None] = Future()
        with self._lock:
            if self._accepting:
                self._jobs.put(Stop(done))
            else:  # the thread already ended
                done.set_result(None)
        await asyncio.wrap_future(done)
        self._thread.join()

    # ------------------------------------------------------------------ the worker thread

    def _main(self, opened: Future[sqlite3.Connection]) -> None:
        try:
            db = self._open()
        except BaseException as exc:
            opened.set_exception(exc)
            return
        self._checkpointer = _Checkpointer(self.path)
        opened.set_result(db)
        stop: Stop | None = None
        try:
            while stop is None:
                group, stop = next_group(self._jobs, GROUP_MAX)
                if not group:
                    break
                try:
                    self._run_group(db, group)
                except BaseException as exc:  # a broken connection: answer every caller, never leave one waiting
                    with contextlib.suppress(sqlite3.Error):
                        if db.in_transaction:
                            db.execute("ROLLBACK")
                    for job in group:  # ignored by those already answered (after COMMIT)
                        deliver(job, False, _failed("store failure", exc))
        finally:
            with self._lock:
                self._accepting = False
            self._checkpointer.stop()
            self._save_ids(db)
            db.close()  # the last connection to close checkpoints what is left and removes the WAL
            refuse_left(self._jobs, self.url, stop)  # submitted while close() ran, or after the thread failed

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_S, cached_statements=256)
        try:
            db.execute(f"PRAGMA page_size = {PAGE_SIZE}")  # a new file only: before WAL mode writes the header
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RuntimeError(f"{self.path}: SQLite cannot use WAL mode here (journal_mode is {mode})")
            db.execute(f"PRAGMA synchronous = {self.config.synchronous}")
            db.execute("PRAGMA journal_size_limit = 67108864")  # truncate a WAL that one big transaction grew
            db.execute("PRAGMA cache_size = -65536")  # 64 MiB: the queues' indexes stay in memory
            db.execute("PRAGMA wal_autocheckpoint = 0")  # the _Checkpointer does it, off the writer's path
            # Debian builds SQLite with SECURE_DELETE: every popped payload would be overwritten with zeros, as
            # many bytes written again as were queued. This buffer is no security boundary: free pages are reused.
            db.execute("PRAGMA secure_delete = OFF")
            db.execute("BEGIN IMMEDIATE")
            try:
                _create_or_migrate(db, self.path)
                trim_replies(db, self.config, time.time())
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except BaseException:
            db.close()
            raise
        return db

    def _save_ids(self, db: sqlite3.Connection) -> None:
        """Store the id counter after a rollback undid it (best effort: the next COMMIT stores it anyway)."""
        if not self._ids.unsaved:
            return
        try:
            db.execute("BEGIN IMMEDIATE")
            self._ids.begin()
            self._ids.save(db)
            db.execute("COMMIT")
            self._ids.committed()
        except sqlite3.Error:
            with contextlib.suppress(sqlite3.Error):
                if db.in_transaction:
                    db.execute("ROLLBACK")

    def _run_group(self, db: sqlite3.Connection, jobs: list[Job]) -> None:
        """Run these transaction functions in one SQLite transaction; answer each of them after COMMIT.

        With more than one, each runs inside its own SAVEPOINT, so one that raises undoes only itself."""
        jobs = [job for job in jobs if not job.future.cancelled()]  # nobody waits for these: skip them
        if not jobs:
            return
        try:
            db.execute("BEGIN IMMEDIATE")
        except BaseException as exc:  # another process held the write lock too long, disk trouble, ...
            for job in jobs:
                deliver(job, False, _failed("could not begin a transaction", exc))
            return
        self._ids.begin()
        alone = len(jobs) == 1
        outcomes: list[tuple[Job, bool, Any]] = []
        for i, job in enumerate(jobs):
            if not alone:
                db.execute("SAVEPOINT rollbuf_fn")
            try:
                txn = SqliteTxn(db, self.config, self._ids)
                value = job.fn(txn)
                txn.finish()
            except BaseException as exc:
                if alone or not db.in_transaction:
                    # Alone, the transaction is this function's. Otherwise SQLite rolled all of it back
                    # itself (disk full, I/O error): the functions before this one are undone too and must
                    # not be acknowledged; those after it run in a fresh transaction.
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    self._save_ids(db)
                    deliver(job, False, exc)
                    for done, ok, result in outcomes:
                        deliver(done, False, _failed("transaction rolled back by SQLite", exc) if ok else result)
                    self._run_group(db, jobs[i + 1 :])
                    return
                db.execute("ROLLBACK TO rollbuf_fn")
                db.execute("RELEASE rollbuf_fn")
                outcomes.append((job, False, exc))
            else:
                if not alone:
                    db.execute("RELEASE rollbuf_fn")
                outcomes.append((job, True, value))
        try:
            self._ids.save(db)
            db.execute("COMMIT")
            self._ids.committed()
            self._checkpointer.committed()
        except BaseException as exc:
            if db.in_transaction:
                db.execute("ROLLBACK")
            for job, ok, result in outcomes:
                deliver(job, False, _failed("commit failed", exc) if ok else result)
            return
        for job, ok, result in outcomes:
            deliver(job, ok, result)


def _failed(what: str, cause: BaseException) -> sqlite3.OperationalError:
    """One exception per waiting caller (an exception object raised in several tasks gets its traceback mixed)."""
    exc = sqlite3.OperationalError(f"{what}: {cause!r}")
    exc.__cause__ = cause
    return exc


def _create_or_migrate(db: sqlite3.Connection, path: Path) -> None:
    """Bring the file to SCHEMA_VERSION, inside the caller's transaction."""
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "meta" in tables:
        version = int(db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])
        if version != SCHEMA_VERSION:
            raise RuntimeError(f"{path}: schema version {version}; this rollbuf reads version {SCHEMA_VERSION}")
        return
    if {t for t in tables if not t.startswith("sqlite_")}:
        raise RuntimeError(f"{path} holds tables that are not rollbuf's ({', '.join(sorted(tables))}): not touching it")
    for ddl in _DDL.values():
        db.execute(ddl)
    db.executemany(
        "INSERT INTO meta (key, value) VALUES (?, ?)", [("schema_version", SCHEMA_VERSION), ("next_item_id", 1)]
    )
