"""The PostgreSQL store: a pool of two connections, each used by one thread (a lane) that runs the functions
queued for it a group at a time (api/store/commit.py): the writer (transactions, under the store lock) and the
reader (`Store.read`: snapshots, beside the writer and other replicas)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar, cast

import psycopg
import psycopg_pool

from api.store.base import Store, Txn
from api.store.commit import Driver, Loss, serve
from api.store.jobs import Job, Lane, deliver, refuse_left
from api.store.postgres.cache import Group, Pending
from api.store.postgres.config import connect_kwargs, parse_url
from api.store.postgres.errors import is_transient, unavailable
from api.store.postgres.listen import Wakeups
from api.store.postgres.schema import create_or_migrate
from api.store.postgres.txn import PostgresTxn
from api.store.url import redacted

T = TypeVar("T")
log = logging.getLogger("rollbuf")

POOL_SIZE = 2
"""Connections per store (per server process): the writer's and the reader's, one in use by each at a time."""
REPLY_TRIM_EVERY = 1024
"""Old idempotency replies are trimmed once per this many replies stored by a replica."""
RESET_S = 1.0
"""A broken connection that failed faster than this was reset (worth replacing at once), not cut off."""
RECONNECT_ROUND_S = 2.0
"""How long the pool keeps re-trying to connect after a failure, before it waits for the next transaction."""


class PostgresStore(Store):
    """A pool of two connections (the writer's and the reader's) and one LISTEN connection."""

    def __init__(self, url: str) -> None:
        self.url = redacted(url)
        self.config = parse_url(url)
        replica = secrets.token_hex(8)
        """Sent with NOTIFY, so a replica ignores its own notifications (it woke its trainers itself)."""
        self._closed = False
        self._wakeups = Wakeups(self.config, self.url, replica)
        kwargs = connect_kwargs(self.config)
        # Connected once directly first: a wrong URL, password or database name fails here, with libpq's words.
        with psycopg.connect(self.config.conninfo, **kwargs) as conn:
            create_or_migrate(conn, self.config)
            warn_without_autovacuum(conn, self.config.schema)
        self._pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]] = psycopg_pool.ConnectionPool(
            self.config.conninfo,
            kwargs=kwargs,
            min_size=POOL_SIZE,
            max_size=POOL_SIZE,
            open=False,
            timeout=self.config.pool_timeout,
            # Reconnect attempts back off (1 s, 2 s) and end after this; the next transaction starts a new round
            # with an immediate attempt, so a replica serves again within about a second of the database.
            reconnect_timeout=RECONNECT_ROUND_S,
            name=f"rollbuf-{self.config.schema}",
        )
        self._pool.open()
        self._writer, self._reader = Lane(self.url, self.config.commit_delay), Lane(self.url)
        self._threads = [
            threading.Thread(target=self._main, args=(lane, _Driver(self, read_only, replica)), name=name, daemon=True)
            for lane, read_only, name in (
                (self._writer, False, "rollbuf-postgres"),
                (self._reader, True, "rollbuf-postgres-read"),
            )
        ]
        self._replies_since_trim = 0
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ the event loop's side

    def expecting(self) -> AbstractContextManager[None]:
        return self._writer.expecting()

    async def transact(self, fn: Callable[[Txn], T], *, replies: Sequence[str] = ()) -> T:
        return await self._submit(self._writer, fn, replies)

    async def read(self, fn: Callable[[Txn], T]) -> T:
        """A snapshot of committed state, read beside the writer: no store lock, no WAL flush."""
        return await self._submit(self._reader, fn)

    async def _submit(self, lane: Lane, fn: Callable[[Txn], T], replies: Sequence[str] = ()) -> T:
        if self._closed:
            raise RuntimeError(f"store {self.url} is closed")
        return cast(T, await lane.submit(fn, replies))

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._wakeups.subscribe(callback, listen=not self._closed)

    async def close(self) -> None:
        """Finish the transactions already queued, then close the connections and end the threads."""
        if self._closed:
            return
        self._closed = True
        for lane in (self._reader, self._writer):
            await lane.stop()
        await asyncio.to_thread(self._join)

    def _join(self) -> None:
        for thread in self._threads:
            thread.join()
        self._wakeups.stop()
        self._pool.close()

    # ------------------------------------------------------------------ the lanes' threads

    def _main(self, lane: Lane, driver: _Driver) -> None:
        stop = None
        try:
            stop = serve(lane, driver)
        finally:
            lane.refuse()
            refuse_left(lane.jobs, self.url, stop)

    def connect_and_begin(self, read_only: bool, replies: Sequence[str]) -> tuple[psycopg.Connection[Any], Group]:
        """A connection in a transaction (holding the store lock, for the writer). A connection found broken at
        BEGIN at once (the server restarted since it was last used: a reset) is replaced, as many times as the
        pool holds connections: nothing was sent on it that could apply. One that took long to fail (the
        database stopped answering) is not: the next would only make the caller wait as long again."""
        for attempt in range(POOL_SIZE + 1):
            conn = self._pool.getconn()
            began = time.monotonic()
            try:
                return conn, Group(conn, self.config, read_only, replies)
            except BaseException as exc:
                self.release(conn)
                reset = isinstance(exc, psycopg.OperationalError) and conn.broken
                if attempt == POOL_SIZE or not reset or time.monotonic() - began > RESET_S:
                    raise
        raise AssertionError("unreachable")

    def release(self, conn: psycopg.Connection[Any]) -> None:
        """Give a connection back to the pool, its transaction (if any) rolled back."""
        if not conn.broken and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK", prepare=False)
        self._pool.putconn(conn)

    def trim_replies(self, conn: psycopg.Connection[Any], group: Group) -> None:
        """Forget all but the newest `max_replies` replies, and those older than `reply_ttl` (best effort)."""
        self._replies_since_trim += group.replies_added
        if self._replies_since_trim < REPLY_TRIM_EVERY:
            return
        self._replies_since_trim = 0
        cfg = self.config
        with contextlib.suppress(psycopg.Error):
            conn.execute(
                "DELETE FROM replies WHERE seq <= (SELECT max(seq) FROM replies) - %b OR created < %b",
                (cfg.max_replies, -1.0 if cfg.reply_ttl is None else time.time() - cfg.reply_ttl),
            )

    def wake(self) -> None:
        """Wake this replica's subscribers (it queued data)."""
        self._wakeups.wake()


class _Driver(Driver):
    """Group commit over a pooled connection: BEGIN (and the store lock) with the cache's first reads, a
    SAVEPOINT only once a function writes to the database directly (most writes wait in the cache, restored
    from a copy if the function raises), the cache's writes (one statement) and COMMIT in one round trip."""

    def __init__(self, store: PostgresStore, read_only: bool, replica: str) -> None:
        self.store = store
        self.read_only = read_only
        self.replica = replica
        self.conn: psycopg.Connection[Any] | None = None
        self.group: Group | None = None
        self.marked = False
        """A function of several runs: a SAVEPOINT is due before its first write to the database."""
        self.taken = False
        """That SAVEPOINT was taken."""
        self.before: Pending | None = None
        """The cache as it was before the function (restored if it raises)."""

    def _open(self) -> tuple[psycopg.Connection[Any], Group]:
        assert self.conn is not None and self.group is not None, "no transaction is open"
        return self.conn, self.group

    def begin(self, jobs: Sequence[Job]) -> None:
        keys = list(dict.fromkeys(key for job in jobs for key in job.replies))
        self.conn, self.group = self.store.connect_and_begin(self.read_only, keys)

    def call(self, job: Job) -> Any:
        _, group = self._open()
        return job.fn(PostgresTxn(group, self._write_savepoint))

    def _write_savepoint(self) -> None:
        conn, _ = self._open()
        if self.marked and not self.taken:
            conn.execute("SAVEPOINT rollbuf_fn", prepare=False)
            self.taken = True

    def savepoint(self) -> None:
        _, group = self._open()
        self.before = group.pending.copy()
        self.marked, self.taken = True, False

    def release(self) -> None:
        conn, _ = self._open()
        if self.taken:
            conn.execute("RELEASE SAVEPOINT rollbuf_fn", prepare=False)
        self.marked = self.taken = False

    def rollback_to(self) -> None:
        conn, group = self._open()
        if self.taken:
            conn.execute("ROLLBACK TO SAVEPOINT rollbuf_fn; RELEASE SAVEPOINT rollbuf_fn", prepare=False)
        assert self.before is not None, "rollback_to without savepoint"
        group.pending = self.before
        self.marked = self.taken = False

    def rollback(self) -> None:
        conn, _ = self._open()
        self.marked = self.taken = False
        self.conn = self.group = None
        self.store.release(conn)

    def commit(self) -> None:
        conn, group = self._open()
        group.commit(self.replica if group.pending.appended else None)
        self.store.trim_replies(conn, group)
        self.conn = None
        self.store.release(conn)

    def committed(self) -> None:
        group, self.group = self.group, None
        if group is not None and group.pending.appended:
            self.store.wake()

    def loss(self, exc: BaseException) -> Loss | None:
        # A database error inside a function: the whole transaction is lost. If it says "not now", so will a
        # retry: every function fails. Otherwise it is this function's (a bug): it fails with it, the others
        # (rolled back with it) run again.
        if not isinstance(exc, psycopg.Error):
            return None
        return Loss.FAIL_GROUP if is_transient(exc) else Loss.RETRY_OTHERS

    def failed(self, what: str, exc: BaseException) -> BaseException:
        return unavailable(what, exc) if is_transient(exc) else exc

    def broken(self, exc: BaseException, jobs: Sequence[Job]) -> None:
        log.exception("PostgreSQL store: unexpected failure")
        if self.conn is not None:  # back to the pool, not lost to it
            self.rollback()
        for job in jobs:
            deliver(job, False, unavailable("unexpected failure", exc))


def warn_without_autovacuum(conn: psycopg.Connection[Any], schema: str) -> None:
    """One line at start when the queue tables will not be vacuumed: they churn (every group is inserted and
    deleted), and without autovacuum a 6-minute soak grew the database to 1.36 GB (docs/deployment.md)."""
    row = conn.execute("SHOW autovacuum").fetchone()
    off_tables = conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.reloptions::text LIKE %s",
        (schema, "%autovacuum_enabled=false%"),
    ).fetchall()
    if row is not None and row[0] != "on":
        log.warning(
            "PostgreSQL's autovacuum is off: the queue tables grow without bound as groups come and go; "
            "turn it on (ALTER SYSTEM SET autovacuum = on; SELECT pg_reload_conf()), see docs/deployment.md"
        )
    elif off_tables:
        names = ", ".join(sorted(r[0] for r in off_tables))
        log.warning("autovacuum is disabled on %s in schema %s: those tables grow without bound", names, schema)
