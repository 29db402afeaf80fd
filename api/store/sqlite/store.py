"""The SQLite store: one connection, owned by one writer thread, fed through a `Lane` of transaction functions
and committing them in groups (api/store/commit.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, TypeVar, cast

from api.store.base import Store, StoreUnavailable, Txn
from api.store.commit import Driver, Loss, serve
from api.store.jobs import Job, Lane, deliver, refuse_left
from api.store.sqlite.checkpoint import Checkpointer
from api.store.sqlite.config import BUSY_TIMEOUT_S, SqliteConfig, connect, parse_url
from api.store.sqlite.deferred import Deferred
from api.store.sqlite.payloads import PayloadTier, check_present, delete_orphans
from api.store.sqlite.schema import create_or_migrate
from api.store.sqlite.segments import segment_dir, sync_from
from api.store.sqlite.txn import ItemIds, SqliteTxn, flush, trim_replies
from api.store.sqlite.write_lock import WriteLock

T = TypeVar("T")
log = logging.getLogger("rollbuf")

RETRY_AFTER_S = 2.0
"""Retry-After of a 503 when the file cannot be written (a full disk, an I/O error, the lock held too long)."""
TROUBLE = ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_CANTOPEN", "SQLITE_NOMEM")
"""SQLite errors that say "not now" (the disk, the lock, memory), never "this request is wrong"."""


def trouble(exc: BaseException) -> str | None:
    """What is wrong with the file or the disk, when `exc` (or what caused it) is one of TROUBLE."""
    seen: BaseException | None = exc
    while seen is not None:
        name = getattr(seen, "sqlite_errorname", None)
        if isinstance(name, str) and name.startswith(TROUBLE):
            return f"{seen} ({name})"
        seen = seen.__cause__
    return None


class Health:
    """Whether writes go through: failing from a write that hit TROUBLE until one goes through again, logged
    once each way (a handler retrying into a full disk must not write a line per attempt)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._failing: str | None = None

    def failing(self, why: str) -> None:
        if self._failing is None:
            log.warning("%s cannot be written: %s; answering 503 until a write goes through", self.where, why)
        self._failing = why

    def wrote(self) -> None:
        if self._failing is not None:
            log.info("%s is written again", self.where)
            self._failing = None

    def reason(self) -> str | None:
        return None if self._failing is None else f"writes fail: {self._failing}"


WATCH_S = 0.25
"""How often a subscribed store looks for commits of other processes (long-polls they may end)."""


class SqliteStore(Store):
    """One connection, owned by one thread, fed through a queue of transaction functions."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.config = parse_url(url)
        self.path = self.config.path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._ids = ItemIds()
        self._lane = Lane(url, self.config.commit_delay)
        self._closed = False
        self.health = Health(self.url)
        self._checkpointer: Checkpointer | None = None
        self._stopping = threading.Event()
        self._watchers: list[threading.Thread] = []
        opened: Future[None] = Future()
        self._thread = threading.Thread(target=self._main, args=(opened,), name="rollbuf-sqlite", daemon=True)
        self._thread.start()
        try:
            opened.result()
        except BaseException:
            self._thread.join()
            raise

    def expecting(self) -> AbstractContextManager[None]:
        return self._lane.expecting()

    async def transact(self, fn: Callable[[Txn], T], *, replies: Sequence[str] = ()) -> T:
        if self._closed:
            raise RuntimeError(f"store {self.url} is closed")
        try:
            return cast(T, await self._lane.submit(fn))
        except sqlite3.Error as exc:
            why = trouble(exc)
            if why is None:
                raise  # a bug: a 500 with its traceback
            self.health.failing(why)
            raise StoreUnavailable(f"the SQLite store cannot write now ({why}); retry", RETRY_AFTER_S) from exc

    def not_ready(self) -> str | None:
        return self.health.reason() or self._checkpoint_failure()

    def _checkpoint_failure(self) -> str | None:
        checkpointer = self._checkpointer
        return None if checkpointer is None else checkpointer.failure

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on this event loop) when the file changes: another process sharing it (`--workers
        N`, a second server) committed. One thread per store reads SQLite's `data_version` every WATCH_S: a
        read of a counter in shared memory, not a transaction."""
        loop = asyncio.get_running_loop()
        watcher = threading.Thread(target=self._watch, args=(loop, callback), name="rollbuf-sqlite-watch", daemon=True)
        self._watchers.append(watcher)
        watcher.start()

    def _watch(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=True)
        try:
            seen = db.execute("PRAGMA data_version").fetchone()[0]
            while not self._stopping.wait(WATCH_S):
                now = db.execute("PRAGMA data_version").fetchone()[0]
                if now != seen:
                    seen = now
                    loop.call_soon_threadsafe(callback)
        except (sqlite3.Error, RuntimeError):  # the file is gone, or the loop closed: nothing left to wake
            pass
        finally:
            db.close()

    async def close(self) -> None:
        """Finish the transactions already queued, then close the connection and end the threads."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        await self._lane.stop()
        self._thread.join()
        for watcher in self._watchers:
            watcher.join()

    # ------------------------------------------------------------------ the writer thread

    def _main(self, opened: Future[None]) -> None:
        try:
            db = self._open()
        except BaseException as exc:
            opened.set_exception(exc)
            return
        checkpointer = self._checkpointer = Checkpointer(self.path, self.config.wal_limit)
        tier = PayloadTier.beside(self.path, self.config.synchronous, checkpointer.truncating.is_set)
        lock = WriteLock(segment_dir(self.path), BUSY_TIMEOUT_S)
        driver = _Driver(db, self.config, self._ids, checkpointer, self.health.wrote, tier, lock)
        opened.set_result(None)
        stop = None
        try:
            stop = serve(self._lane, driver)
        finally:
            self._lane.refuse()
            checkpointer.stop()
            driver.save_ids()
            tier.close()
            lock.close()
            with contextlib.suppress(OSError):  # what the closing checkpoint makes durable, its bytes first
                sync_from(segment_dir(self.path), 0)
            db.close()  # the last connection to close checkpoints what is left and removes the WAL
            refuse_left(self._lane.jobs, self.url, stop)  # submitted while close() ran, or after the thread failed

    def _open(self) -> sqlite3.Connection:
        db = connect(self.config)
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                create_or_migrate(db, self.path)
                trim_replies(db, self.config, time.time())
                check_present(db, self.path)
                delete_orphans(db, self.path)  # under the write lock
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except BaseException:
            db.close()
            raise
        return db


class _Driver(Driver):
    """Group commit over the writer's connection: `BEGIN IMMEDIATE ... COMMIT`, a SAVEPOINT per function."""

    def __init__(
        self,
        db: sqlite3.Connection,
        config: SqliteConfig,
        ids: ItemIds,
        checkpointer: Checkpointer,
        wrote: Callable[[], None],
        payloads: PayloadTier,
        lock: WriteLock,
    ) -> None:
        self.db = db
        self.payloads = payloads
        self.lock = lock
        """The writers' turn between processes, taken before BEGIN IMMEDIATE and given back after the COMMIT or
        ROLLBACK (write_lock.py: SQLite's own wait polls)."""
        self.config = config
        self.ids = ids
        self.checkpointer = checkpointer
        self.wrote = wrote
        self.changes_at_begin = db.total_changes
        self.values: dict[str, str | None] = {}
        """The kv values read or written (`SqliteTxn.get_value`), kept from one transaction to the next while no
        other connection commits (`PRAGMA data_version` tells, read under the write lock), and forgotten when a
        function's savepoint or a transaction is undone: the run state is read once, not once per commit."""
        self.data_version: int | None = None
        """`PRAGMA data_version` when `values`, the id counter and the counts (`Deferred.stored`) were last known
        to match the file; None: not."""
        self.deferred = Deferred()
        """The inserts and count deltas of the transaction's functions, written merged before its COMMIT."""

    def begin(self, jobs: Sequence[Job]) -> None:
        self.lock.acquire()  # fails if another process held it too long
        try:
            self.db.execute("BEGIN IMMEDIATE")  # fails if another program held SQLite's lock too long, disk trouble
        except BaseException:
            self.lock.release()
            raise
        self.changes_at_begin = self.db.total_changes  # it counts rows rolled back too
        try:
            version = self.db.execute("PRAGMA data_version").fetchone()[0]
        except BaseException:
            self.rollback()
            raise
        known = version == self.data_version
        if not known:  # another process committed (or nothing is known): read afresh
            self.values.clear()
            self.ids.begin()
        self.deferred.reset(keep_counts=known)
        self.data_version = version
        self.payloads.begin()

    def call(self, job: Job) -> Any:
        txn = SqliteTxn(self.db, self.config, self.ids, self.payloads, self.values, self.deferred)
        value = job.fn(txn)
        txn.finish()
        return value

    def savepoint(self) -> None:
        self.db.execute("SAVEPOINT rollbuf_fn")
        self.deferred.savepoint()

    def release(self) -> None:
        self.db.execute("RELEASE rollbuf_fn")
        self.deferred.release()

    def rollback_to(self) -> None:
        self.forget()
        self.db.execute("ROLLBACK TO rollbuf_fn")
        self.db.execute("RELEASE rollbuf_fn")
        self.deferred.undone()

    def forget(self) -> None:
        """What was read is no longer known to match the file (a function or the transaction was undone)."""
        self.values.clear()
        self.data_version = None

    def rollback(self) -> None:
        self.forget()
        self.deferred.reset()
        self.payloads.rolled_back()
        try:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            self.save_ids()
        finally:
            self.lock.release()

    def commit(self) -> None:
        try:
            flush(self.db, self.config, self.deferred, time.time())  # the functions' inserts, one statement each
            self.deferred.reset(keep_counts=True)
            self.ids.save(self.db)
            wrote = self.db.total_changes != self.changes_at_begin
            if wrote:
                self.payloads.before_commit(self.db)  # segments emptied go; with FULL, the bytes reach the disk
            self.db.execute("COMMIT")
        except BaseException:
            self.forget()
            raise
        self.lock.release()
        self.ids.committed()
        self.payloads.committed()  # and the emptied segments' files after the COMMIT
        if wrote:  # it wrote (one that did not gives a checkpoint no work)
            self.checkpointer.committed()
            self.wrote()  # and whatever failed writes before, passed

    def committed(self) -> None:
        """After the callers of a commit were answered: one mostly-empty payload segment rewritten, if any."""
        self.payloads.compact(self.db, self.config.synchronous, self.lock)

    def loss(self, exc: BaseException) -> Loss | None:
        # SQLite rolled the whole transaction back itself (disk full, I/O error): the functions before this one
        # are undone too and must not be acknowledged; those after it run in a fresh transaction.
        return None if self.db.in_transaction else Loss.FAIL_SO_FAR

    def failed(self, what: str, exc: BaseException) -> BaseException:
        failure = sqlite3.OperationalError(f"{what}: {exc!r}")
        failure.__cause__ = exc
        return failure

    def broken(self, exc: BaseException, jobs: Sequence[Job]) -> None:
        self.forget()
        self.deferred.reset()
        self.payloads.rolled_back()
        with contextlib.suppress(sqlite3.Error):
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
        self.lock.release()
        for job in jobs:  # ignored by those already answered (after COMMIT)
            deliver(job, False, self.failed("store failure", exc))

    def save_ids(self) -> None:
        """Store the id counter after a rollback undid it (best effort: the next COMMIT stores it anyway), in
        the writers' turn (taken here if it is not held: the thread's last call)."""
        if not self.ids.unsaved:
            return
        held = self.lock.held
        try:
            if not held:
                self.lock.acquire()
            self.db.execute("BEGIN IMMEDIATE")
            self.ids.begin()
            self.ids.save(self.db)
            self.db.execute("COMMIT")
            self.ids.committed()
        except sqlite3.Error:
            with contextlib.suppress(sqlite3.Error):
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
        finally:
            if not held:
                self.lock.release()
