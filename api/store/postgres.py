"""Shared durable backend: PostgreSQL, so that server replicas on many hosts serve one buffer.

Every transaction takes one transaction-scoped advisory lock before it reads anything, so transactions of
all replicas run one after another, exactly as on one process: "take a batch" is atomic across replicas, a
group id seen by one replica is a duplicate on every other, and `?step=N` is one stored batch whoever
serves it. The lock ends with the transaction (commit, rollback or a dropped connection): nothing to
expire, nothing to clean up after a replica dies.

Within a replica, as in the SQLite store, one thread owns the connection and commits the transactions
queued meanwhile together (group commit): one PostgreSQL transaction, one lock acquisition and one WAL
flush for up to `GROUP_MAX` functions, each rolled back alone if it raises (a SAVEPOINT, taken only once a
function writes to the database directly). Most writes are buffered in memory and sent with the COMMIT in
one pipeline; small tables (values, counts) are read once per transaction. A caller is answered only after
COMMIT returned. If the outcome is unknown (the connection dropped) or the database cannot be reached, the
caller gets `StoreUnavailable` (HTTP 503); a retried submission with a group id or Idempotency-Key is then
recognised as a duplicate if the first attempt did commit. See docs/stores.md and docs/deployment.md.

A transaction that queued data ends with a NOTIFY; each replica LISTENs on its own connection and wakes its
long-polling trainers when another replica committed data.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import queue
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import msgpack
import psycopg
import psycopg_pool
from psycopg import sql

from api.store import redacted
from api.store.base import BufferedGroup, ItemMeta, QueueCounts, QueuedItem, Store, StoreUnavailable, Txn
from api.store.jobs import GROUP_MAX, Job, Jobs, Stop, deliver, head_chunk_sizes, next_group, refuse_left

T = TypeVar("T")
log = logging.getLogger("rollbuf")

SCHEMA_VERSION = 1
"""Version of the layout below. Older layouts are migrated (MIGRATIONS), newer ones refused."""
MIGRATIONS: dict[int, list[str]] = {}
"""Statements that bring a schema of version v to v + 1, run in one transaction under the store lock."""
POOL_SIZE = 2
"""Connections per store (per server process): the writer's and the reader's, one in use by each at a time."""
REPLY_TRIM_EVERY = 1024
"""Old idempotency replies are trimmed once per this many replies stored by a replica."""
RESET_S = 1.0
"""A broken connection that failed faster than this was reset (worth replacing at once), not cut off."""
RETRY_AFTER_S = 1.0
"""Retry-After sent with a 503 when the database cannot be reached or a commit's outcome is unknown."""
RECONNECT_ROUND_S = 2.0
"""How long the pool keeps re-trying to connect after a failure, before it waits for the next transaction."""
LISTEN_RETRY_S = (0.1, 0.5, 1.0, 2.0)
"""Pauses between attempts to re-open the LISTEN connection (the last one repeats)."""

LIBPQ_DEFAULTS = {
    "connect_timeout": "5",
    "application_name": "rollbuf",
    # A database that stops answering (a network partition: no reset, just silence) is given up on within about
    # 10 s, so the request gets its 503 and the connection is replaced, instead of waiting out the kernel's
    # retransmissions (15 minutes): unacknowledged data for 10 s, or 5 s idle and then 3 probes 2 s apart.
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "10000",
}
"""libpq parameters a store URL gets unless it sets them."""
SESSION_SETTINGS = {
    # The server's side of the same: a replica cut off while it holds the store lock loses its session, and
    # the other replicas the lock, within about 11 s (not the two hours of the kernel's default keepalive).
    "tcp_keepalives_idle": "5",
    "tcp_keepalives_interval": "2",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "10000",
    # A replica that stops mid-transaction without losing its connection (stopped, hung) frees the lock after
    # this; rollbuf's own transactions never wait for anything between statements.
    "idle_in_transaction_session_timeout": "15000",
}
"""Settings of every session a replica opens (lock_timeout and search_path come from the URL)."""
_OWN_PARAMS = {"schema", "max_replies", "reply_ttl", "lock_timeout", "pool_timeout"}
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,40}")
_TRANSIENT_CLASSES = {"08", "40", "53", "55", "57", "58"}
"""SQLSTATE classes that say "not now", never "wrong": connection, rollback, resources, lock not available,
operator intervention (shutdown), system error."""

_TABLES = {
    "meta": "CREATE TABLE {s}.meta (key text PRIMARY KEY, value bigint NOT NULL)",
    "kv": "CREATE TABLE {s}.kv (key text PRIMARY KEY, value text NOT NULL)",
    # What batch formation reads, clustered by env and age; payloads apart, so heads never touch them.
    "queue": "CREATE TABLE {s}.queue (env_id bigint NOT NULL, item_id bigint NOT NULL, seqs bigint NOT NULL, "
    "tokens bigint NOT NULL, policy_step bigint NOT NULL, n_groups bigint NOT NULL, PRIMARY KEY (env_id, item_id))",
    # Payloads of queued items and of popped items a kept batch refers to. Stored uncompressed (EXTERNAL):
    # token ids compress poorly and pglz would cost the database's CPU on every write and read.
    "payloads": "CREATE TABLE {s}.payloads (item_id bigint PRIMARY KEY, payload bytea NOT NULL)",
    "payloads_storage": "ALTER TABLE {s}.payloads ALTER COLUMN payload SET STORAGE EXTERNAL",
    "counts": "CREATE TABLE {s}.counts (env_id bigint PRIMARY KEY, items bigint NOT NULL, groups bigint NOT NULL, "
    "seqs bigint NOT NULL, tokens bigint NOT NULL)",
    "buffers": "CREATE TABLE {s}.buffers (env_id bigint PRIMARY KEY, data bytea NOT NULL)",
    "replies": "CREATE TABLE {s}.replies (key text PRIMARY KEY, reply text NOT NULL, created double precision "
    "NOT NULL, seq bigint GENERATED ALWAYS AS IDENTITY)",
    "replies_by_seq": "CREATE INDEX replies_by_seq ON {s}.replies (seq)",
    "replies_by_age": "CREATE INDEX replies_by_age ON {s}.replies (created)",
    "batches": "CREATE TABLE {s}.batches (step bigint PRIMARY KEY, header bytea NOT NULL, items bigint[] NOT NULL)",
}
_CLEARED = ("kv", "queue", "payloads", "counts", "buffers", "replies", "batches")

_HEAD = (
    "SELECT item_id, seqs, tokens, policy_step FROM queue WHERE env_id = %b AND item_id > %b ORDER BY item_id LIMIT %b"
)
# Pops all of these items or, if one of them is not queued for this env, none.
_POP = """
WITH q AS (
  DELETE FROM queue WHERE env_id = %(env)b AND item_id = ANY(%(ids)b)
    AND (SELECT count(*) FROM queue WHERE env_id = %(env)b AND item_id = ANY(%(ids)b)) = %(n)b
  RETURNING item_id, seqs, tokens, policy_step, n_groups
), p AS (DELETE FROM payloads WHERE item_id IN (SELECT item_id FROM q) RETURNING item_id, payload)
SELECT q.item_id, q.seqs, q.tokens, q.policy_step, q.n_groups, p.payload FROM q JOIN p USING (item_id)
"""
_POP_KEEP = """
WITH q AS (
  DELETE FROM queue WHERE env_id = %(env)b AND item_id = ANY(%(ids)b)
    AND (SELECT count(*) FROM queue WHERE env_id = %(env)b AND item_id = ANY(%(ids)b)) = %(n)b
  RETURNING item_id, seqs, tokens, policy_step, n_groups
)
SELECT q.item_id, q.seqs, q.tokens, q.policy_step, q.n_groups, p.payload FROM q JOIN payloads p USING (item_id)
"""
_DROP_BATCHES = """
WITH old AS (DELETE FROM batches WHERE step {op} %b RETURNING items),
ids AS (SELECT unnest(items) AS id FROM old),
gone AS (DELETE FROM payloads WHERE item_id IN (SELECT id FROM ids))
SELECT coalesce(array_agg(id), '{{}}') FROM ids
"""
_FLUSH_QUEUE = (
    "INSERT INTO queue (item_id, env_id, seqs, tokens, policy_step, n_groups) "
    "SELECT * FROM unnest(%b::int8[], %b::int8[], %b::int8[], %b::int8[], %b::int8[], %b::int8[])"
)
_FLUSH_PAYLOADS = "INSERT INTO payloads (item_id, payload) SELECT * FROM unnest(%b::int8[], %b::bytea[])"
_FLUSH_REPLIES = (
    "INSERT INTO replies (key, reply, created) SELECT k, r, %b FROM unnest(%b::text[], %b::text[]) AS u(k, r) "
    "ON CONFLICT (key) DO UPDATE SET reply = excluded.reply, created = excluded.created"
)
_FLUSH_COUNTS = (
    "INSERT INTO counts (env_id, items, groups, seqs, tokens) "
    "SELECT * FROM unnest(%b::int8[], %b::int8[], %b::int8[], %b::int8[], %b::int8[]) ON CONFLICT (env_id) DO UPDATE "
    "SET items = excluded.items, groups = excluded.groups, seqs = excluded.seqs, tokens = excluded.tokens"
)
_FLUSH_VALUES = (
    "INSERT INTO kv (key, value) SELECT * FROM unnest(%b::text[], %b::text[]) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)
_FLUSH_BUFFERS = (
    "INSERT INTO buffers (env_id, data) SELECT * FROM unnest(%b::int8[], %b::bytea[]) "
    "ON CONFLICT (env_id) DO UPDATE SET data = excluded.data"
)


@dataclass(frozen=True, slots=True)
class PostgresConfig:
    """What a `postgresql://user@host:port/dbname?...` URL says."""

    conninfo: str
    """The URL without rollbuf's own parameters: everything else (sslmode, connect_timeout, ...) is libpq's."""
    schema: str = "rollbuf"
    """Schema holding rollbuf's tables: runs that share a database use different schemas."""
    max_replies: int = 1_000_000
    """Idempotency replies kept, newest first."""
    reply_ttl: float | None = None
    """Replies older than this many seconds are forgotten at the next trim; None: no time limit."""
    lock_timeout: float = 10.0
    """Seconds a transaction waits for the store lock (held by another replica's transaction) before a 503."""
    pool_timeout: float = 3.0
    """Seconds a transaction waits for a connection to the database before a 503."""

    @property
    def lock_key(self) -> int:
        """Advisory lock id of this schema (advisory locks are per database already)."""
        digest = hashlib.blake2b(f"rollbuf:{self.schema}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big", signed=True)

    @property
    def channel(self) -> str:
        return f"rollbuf_{self.schema}"


def parse_url(url: str) -> PostgresConfig:
    """`postgresql://user[:password]@host[:port]/dbname[?param=value&...]`.

    rollbuf's parameters: `schema` (default rollbuf), `max_replies`, `reply_ttl` (seconds), `lock_timeout`
    and `pool_timeout` (seconds). Every other parameter goes to libpq as it is (`sslmode`, `connect_timeout`,
    `application_name`, ...).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError(f"store URL {redacted(url)!r}: use postgresql://user@host:port/dbname")
    if not parts.path.strip("/"):
        raise ValueError(f"store URL {redacted(url)!r} names no database: postgresql://user@host:port/dbname")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    own = {k: v for k, v in pairs if k in _OWN_PARAMS}
    libpq = [(k, v) for k, v in pairs if k not in _OWN_PARAMS]
    given = {k for k, _ in libpq}
    libpq += [(k, v) for k, v in LIBPQ_DEFAULTS.items() if k not in given]
    conninfo = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(libpq), ""))
    try:
        psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"store URL {redacted(url)!r}: {exc}") from None
    schema = own.get("schema", "rollbuf")
    if not _IDENTIFIER.fullmatch(schema):
        raise ValueError(f"store URL {redacted(url)!r}: schema must be a lower-case identifier ([a-z_][a-z0-9_]*)")
    try:
        max_replies = int(own.get("max_replies", 1_000_000))
        ttl = float(own["reply_ttl"]) if "reply_ttl" in own else None
        lock_timeout = float(own.get("lock_timeout", 10.0))
        pool_timeout = float(own.get("pool_timeout", 3.0))
    except ValueError:
        raise ValueError(
            f"store URL {redacted(url)!r}: max_replies must be an integer; "
            "reply_ttl, lock_timeout, pool_timeout seconds"
        ) from None
    if max_replies < 0 or (ttl is not None and not ttl >= 0) or not lock_timeout > 0 or not pool_timeout > 0:
        raise ValueError(
            f"store URL {redacted(url)!r}: max_replies and reply_ttl must not be negative, timeouts positive"
        )
    return PostgresConfig(conninfo, schema, max_replies, ttl, lock_timeout, pool_timeout)


def db_key(key: str) -> str:
    """An idempotency key as the `replies` table holds it. PostgreSQL text cannot hold NUL, which a group id
    may contain: such keys (and, to stay one-to-one, keys starting with \\x01) are escaped behind a \\x01
    prefix; every other key is stored as it is."""
    if "\0" not in key and not key.startswith("\x01"):
        return key
    return "\x01" + key.replace("\x01", "\x01\x01").replace("\0", "\x01\x02")


def is_transient(exc: BaseException) -> bool:
    """A database error that says "not now" (retry later), not "this request is wrong"."""
    if isinstance(exc, psycopg_pool.PoolTimeout | psycopg.OperationalError | psycopg.InterfaceError):
        return True
    sqlstate = getattr(exc, "sqlstate", None)
    if not isinstance(sqlstate, str):
        return False
    return sqlstate[:2] in _TRANSIENT_CLASSES or sqlstate == "25006"  # 25006: a read-only (standby) server


def unavailable(what: str, cause: BaseException) -> StoreUnavailable:
    """One exception per waiting caller (an exception object raised in several tasks gets its traceback mixed)."""
    exc = StoreUnavailable(f"the database is unavailable ({what}: {type(cause).__name__}: {cause}); retry",
                           RETRY_AFTER_S)  # fmt: skip
    exc.__cause__ = cause
    return exc


# ---------------------------------------------------------------------------------------------- transactions


@dataclass(slots=True)
class _Pending:
    """What the transactions of one group wrote that is not in the database yet (sent with COMMIT), and the
    small tables read once per group. Copied before each function and restored if it raises."""

    values: dict[str, str]
    dirty_values: set[str]
    counts: dict[int, list[int]]
    dirty_counts: set[int]
    queued: dict[int, dict[int, tuple[ItemMeta, int]]] = field(default_factory=dict)
    """Appended items per env, oldest first: (meta, n_groups)."""
    payloads: dict[int, bytes] = field(default_factory=dict)
    """Payloads of appended items, queued or popped for a kept batch."""
    replies: dict[str, str] = field(default_factory=dict)
    fetched_replies: dict[str, str | None] = field(default_factory=dict)
    """Stored replies read at BEGIN, None where there is none: replaced, never changed in place (not copied)."""
    buffers: dict[int, list[BufferedGroup]] = field(default_factory=dict)
    """Buffers read or written in this group; `dirty_buffers` to be written."""
    dirty_buffers: set[int] = field(default_factory=set)
    appended: bool = False

    def copy(self) -> _Pending:
        return _Pending(
            dict(self.values),
            set(self.dirty_values),
            {k: list(v) for k, v in self.counts.items()},
            set(self.dirty_counts),
            {env: dict(items) for env, items in self.queued.items()},
            dict(self.payloads),
            dict(self.replies),
            self.fetched_replies,
            dict(self.buffers),
            set(self.dirty_buffers),
            self.appended,
        )


class _Group:
    """One PostgreSQL transaction running the functions of one group, one after another."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        config: PostgresConfig,
        read_only: bool = False,
        replies: Sequence[str] = (),
    ) -> None:
        self.conn = conn
        self.config = config
        self.read_only = read_only
        # One round trip, one simple-protocol query (a pipeline of statements costs twice the client CPU): BEGIN,
        # the lock, the small tables and the replies the functions announced. Writers take the lock first: every
        # statement after it sees every transaction committed before it. Readers read one snapshot of committed
        # state, without the lock.
        begin = (
            "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SELECT 1"
            if read_only
            else f"BEGIN; SELECT pg_advisory_xact_lock({config.lock_key})"
        )
        query: sql.SQL | sql.Composed = sql.SQL(
            f"{begin}; SELECT value FROM meta WHERE key = 'next_item_id'; SELECT key, value FROM kv; "
            "SELECT env_id, items, groups, seqs, tokens FROM counts"
        )
        stored_keys = {db_key(k): k for k in replies}
        if replies:  # the keys are quoted by psycopg (a literal text[]), not by us
            keys = sql.Literal(list(stored_keys))
            query += sql.SQL("; SELECT key, reply FROM replies WHERE key = ANY({})").format(keys)
        cur = conn.execute(query, prepare=False)
        cur.nextset()
        cur.nextset()
        self.next_id = int(cast(tuple[Any, ...], cur.fetchone())[0])
        self.stored_next_id = self.next_id
        cur.nextset()
        values = {str(k): str(v) for k, v in cur.fetchall()}
        cur.nextset()
        counts = {int(r[0]): [int(x) for x in r[1:]] for r in cur.fetchall()}
        fetched: dict[str, str | None] = dict.fromkeys(replies)
        if replies:
            cur.nextset()
            fetched.update((stored_keys[k], v) for k, v in cur.fetchall())
        self.pending = _Pending(values, set(), counts, set(), fetched_replies=fetched)
        self.replies_added = 0

    def commit(self, notify: str | None) -> None:
        """Send the buffered writes and COMMIT in one round trip."""
        p = self.pending
        conn = self.conn
        with conn.pipeline():
            queued = [(m, n, env) for env, items in p.queued.items() for m, n in items.values()]
            if queued:
                conn.execute(
                    _FLUSH_QUEUE,
                    [[m.item_id for m, _, _ in queued], [env for _, _, env in queued], [m.seqs for m, _, _ in queued],
                     [m.tokens for m, _, _ in queued], [m.policy_step for m, _, _ in queued],
                     [n for _, n, _ in queued]],
                )  # fmt: skip
            if p.payloads:
                conn.execute(_FLUSH_PAYLOADS, [list(p.payloads), list(p.payloads.values())], binary=True)
            if p.replies:
                conn.execute(_FLUSH_REPLIES, [time.time(), [db_key(k) for k in p.replies], list(p.replies.values())])
                self.replies_added += len(p.replies)
            if p.dirty_counts:
                envs = sorted(p.dirty_counts)
                cols = [p.counts.get(env, [0, 0, 0, 0]) for env in envs]
                conn.execute(_FLUSH_COUNTS, [envs, *([c[i] for c in cols] for i in range(4))])
            if p.dirty_values:
                keys = sorted(p.dirty_values)
                conn.execute(_FLUSH_VALUES, [keys, [p.values[k] for k in keys]])
            if p.dirty_buffers:
                keep = sorted(e for e in p.dirty_buffers if p.buffers.get(e))
                empty = sorted(e for e in p.dirty_buffers if not p.buffers.get(e))
                if keep:
                    data = [_pack_buffer(p.buffers[e]) for e in keep]
                    conn.execute(_FLUSH_BUFFERS, [keep, data], binary=True)
                if empty:
                    conn.execute("DELETE FROM buffers WHERE env_id = ANY(%b)", [empty])
            if self.next_id != self.stored_next_id:
                conn.execute("UPDATE meta SET value = %b WHERE key = 'next_item_id'", [self.next_id])
            if notify is not None and p.appended:
                conn.execute("SELECT pg_notify(%b, %b)", [self.config.channel, notify])
            conn.execute("COMMIT", prepare=False)


def _pack_buffer(groups: list[BufferedGroup]) -> bytes:
    return cast(bytes, msgpack.packb([(g.seqs, g.tokens, g.policy_step, g.payload) for g in groups], use_bin_type=True))


class PostgresTxn(Txn):
    """One transaction function's view: reads go to the database (after the writes it must see), most writes
    wait in `_Pending` for the COMMIT. `savepoint` is called before the function writes to the database."""

    def __init__(self, group: _Group, savepoint: Callable[[], None]) -> None:
        self._g = group
        self._p = group.pending
        self._db = group.conn
        self._savepoint = savepoint

    def _write(self, query: str, params: Sequence[Any] | dict[str, Any] | None = None) -> psycopg.Cursor[Any]:
        self._writable()
        self._savepoint()
        return self._db.execute(query, params, binary=True)

    def _writable(self) -> None:
        if self._g.read_only:
            raise RuntimeError("a function passed to Store.read wrote to the store: use Store.transact")

    # --- values: read once per group ---
    def get_value(self, key: str) -> str | None:
        return self._p.values.get(key)

    def set_value(self, key: str, value: str) -> None:
        self._writable()
        self._p.values[key] = value
        self._p.dirty_values.add(key)

    # --- the queue ---
    def next_item_id(self) -> int:
        self._writable()
        item_id = self._g.next_id
        self._g.next_id += 1  # not undone by a function that raises: harmless gaps, never a reused id
        return item_id

    def append(self, env_id: int, item: QueuedItem) -> None:
        self._writable()
        p = self._p
        p.queued.setdefault(env_id, {})[item.meta.item_id] = (item.meta, item.n_groups)
        p.payloads[item.meta.item_id] = item.payload
        self._add(env_id, 1, item.n_groups, item.meta.seqs, item.meta.tokens)
        p.appended = True

    def _add(self, env_id: int, items: int, groups: int, seqs: int, tokens: int) -> None:
        c = self._p.counts.setdefault(env_id, [0, 0, 0, 0])
        c[0] += items
        c[1] += groups
        c[2] += seqs
        c[3] += tokens
        self._p.dirty_counts.add(env_id)

    def head(self, env_id: int) -> Iterator[ItemMeta]:
        # Keyset pages, not one open cursor: pops and appends between two reads of the iterator are safe.
        # Items appended in this group come after every stored one (ids only grow).
        after = -(2**63)
        for limit in head_chunk_sizes():
            rows = self._db.execute(_HEAD, (env_id, after, limit), binary=True).fetchall()
            for row in rows:
                yield ItemMeta(*row)
            if len(rows) < limit:
                break
            after = rows[-1][0]
        for meta, _ in list(self._p.queued.get(env_id, {}).values()):
            if meta.item_id in self._p.queued.get(env_id, {}):
                yield meta

    def pop(self, env_id: int, item_ids: Iterable[int], *, keep_for: int | None = None) -> list[QueuedItem]:
        wanted = list(item_ids)
        if not wanted:
            return []
        self._writable()
        if len(set(wanted)) != len(wanted):
            raise KeyError(f"items {wanted} are not all queued (once) for env {env_id}")
        p = self._p
        local = p.queued.get(env_id, {})
        stored = [i for i in wanted if i not in local]
        found: dict[int, QueuedItem] = {}
        if stored:
            rows = self._write(
                _POP_KEEP if keep_for is not None else _POP, {"env": env_id, "ids": stored, "n": len(stored)}
            ).fetchall()
            if len(rows) != len(stored):  # nothing was deleted
                missing = sorted(set(stored) - {row[0] for row in rows})
                raise KeyError(f"items {missing or stored} are not all queued for env {env_id}")
            for item_id, seqs, tokens, policy_step, n_groups, payload in rows:
                found[item_id] = QueuedItem(ItemMeta(item_id, seqs, tokens, policy_step), n_groups, payload)
        for item_id in wanted:
            if item_id in local:
                meta, n_groups = local.pop(item_id)
                payload = p.payloads[item_id] if keep_for is not None else p.payloads.pop(item_id)
                found[item_id] = QueuedItem(meta, n_groups, payload)
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
        return {env: QueueCounts(*c) for env, c in self._p.counts.items() if c[0] > 0}

    # --- side buffers ---
    def get_buffer(self, env_id: int) -> list[BufferedGroup]:
        p = self._p
        if env_id not in p.buffers:
            row = self._db.execute("SELECT data FROM buffers WHERE env_id = %b", (env_id,), binary=True).fetchone()
            p.buffers[env_id] = [] if row is None else [BufferedGroup(*g) for g in msgpack.unpackb(row[0])]
        return list(p.buffers[env_id])

    def set_buffer(self, env_id: int, groups: list[BufferedGroup]) -> None:
        self._writable()
        self._p.buffers[env_id] = list(groups)
        self._p.dirty_buffers.add(env_id)

    # --- idempotency replies ---
    def get_reply(self, key: str) -> str | None:
        if key in self._p.replies:
            return self._p.replies[key]
        if key in self._p.fetched_replies:
            return self._p.fetched_replies[key]
        row = self._db.execute("SELECT reply FROM replies WHERE key = %b", (db_key(key),), binary=True).fetchone()
        return None if row is None else cast(str, row[0])

    def put_reply(self, key: str, reply: str) -> None:
        self._writable()
        self._p.replies[key] = reply

    # --- formed batches ---
    def put_batch(self, step: int, header: bytes, item_ids: Sequence[int]) -> None:
        self._writable()
        ids = list(item_ids)
        stored = [i for i in set(ids) if i not in self._p.payloads]
        if stored:
            row = self._db.execute(
                "SELECT count(*) FROM payloads WHERE item_id = ANY(%b)", (stored,), binary=True
            ).fetchone()
            if row is None or row[0] != len(stored):
                raise KeyError(f"batch {step} refers to items that were not popped with keep_for={step}")
        self._drop_batches("=", step)
        self._write("INSERT INTO batches (step, header, items) VALUES (%b, %b, %b)", (step, header, ids))

    def get_batch(self, step: int) -> bytes | None:
        row = self._db.execute("SELECT header, items FROM batches WHERE step = %b", (step,), binary=True).fetchone()
        if row is None:
            return None
        header, ids = row
        payloads = {i: self._p.payloads[i] for i in ids if i in self._p.payloads}
        stored = [i for i in ids if i not in payloads]
        if stored:
            cur = self._db.execute(
                "SELECT item_id, payload FROM payloads WHERE item_id = ANY(%b)", (stored,), binary=True
            )
            payloads.update(cur.fetchall())
        return b"".join([header, *(payloads[i] for i in ids)])

    def drop_batches_before(self, step: int) -> None:
        self._drop_batches("<", step)

    def _drop_batches(self, op: str, step: int) -> None:
        row = self._write(_DROP_BATCHES.format(op=op), (step,)).fetchone()
        for item_id in row[0] if row else ():
            self._p.payloads.pop(item_id, None)

    def clear(self) -> None:
        self._writable()
        self._savepoint()
        self._db.execute("; ".join(f"DELETE FROM {table}" for table in _CLEARED))  # meta (next_item_id) stays
        p = self._p
        p.values.clear()
        p.dirty_values.clear()
        p.counts.clear()
        p.dirty_counts.clear()
        p.queued.clear()
        p.payloads.clear()
        p.replies.clear()
        p.fetched_replies = {}
        p.buffers.clear()
        p.dirty_buffers.clear()


# ---------------------------------------------------------------------------------------------- the store


class _AbortGroup(Exception):
    """A database error inside a function: the whole group's transaction is lost."""

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(cause)
        self.index = index
        self.cause = cause


@dataclass(slots=True)
class _Listener:
    """A `subscribe` callback, and whether a call of it is already scheduled on its loop."""

    callback: Callable[[], None]
    loop: asyncio.AbstractEventLoop
    pending: bool = False


@dataclass(slots=True)
class _Lane:
    """A thread running queued functions, a group at a time: the writer (transactions, under the store lock)
    or the reader (`Store.read`: snapshots, beside the writer and other replicas)."""

    read_only: bool
    jobs: Jobs = field(default_factory=queue.SimpleQueue)
    accepting: bool = True
    """False once the thread stops taking jobs; changed and checked under the store's lock."""
    thread: threading.Thread | None = None


class PostgresStore(Store):
    """A pool of two connections (the writer's and the reader's) and one LISTEN connection."""

    def __init__(self, url: str) -> None:
        self.url = redacted(url)
        self.config = parse_url(url)
        self._replica = secrets.token_hex(8)
        """Sent with NOTIFY, so a replica ignores its own notifications (it woke its trainers itself)."""
        self._closed = False
        self._lock = threading.Lock()
        self._listeners: list[_Listener] = []
        self._listen_stop = threading.Event()
        self._listen_thread: threading.Thread | None = None
        self._replies_since_trim = 0
        schema = self.config.schema
        settings = {"search_path": schema, "lock_timeout": str(round(self.config.lock_timeout * 1000)),
                    **SESSION_SETTINGS}  # fmt: skip
        options = " ".join(f"-c {name}={value}" for name, value in settings.items())
        kwargs: dict[str, Any] = {"autocommit": True, "options": options}
        # Connected once directly first: a wrong URL, password or database name fails here, with libpq's words.
        with psycopg.connect(self.config.conninfo, **kwargs) as conn:
            _create_or_migrate(conn, self.config)
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
            name=f"rollbuf-{schema}",
        )
        self._pool.open()
        self._writer, self._reader = _Lane(read_only=False), _Lane(read_only=True)
        for lane, name in ((self._writer, "rollbuf-postgres"), (self._reader, "rollbuf-postgres-read")):
            lane.thread = threading.Thread(target=self._main, args=(lane,), name=name, daemon=True)
            lane.thread.start()

    # ------------------------------------------------------------------ the event loop's side

    async def transact(self, fn: Callable[[Txn], T], *, replies: Sequence[str] = ()) -> T:
        return await self._submit(self._writer, fn, replies)

    async def read(self, fn: Callable[[Txn], T]) -> T:
        """A snapshot of committed state, read beside the writer: no store lock, no WAL flush."""
        return await self._submit(self._reader, fn)

    async def _submit(self, lane: _Lane, fn: Callable[[Txn], T], replies: Sequence[str] = ()) -> T:
        if self._closed:
            raise RuntimeError(f"store {self.url} is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            if not lane.accepting:
                raise RuntimeError(f"store {self.url} is closed")
            lane.jobs.put(Job(fn, future, loop, replies))
        return cast(T, await future)

    def subscribe(self, callback: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            self._listeners.append(_Listener(callback, loop))
            if self._listen_thread is None and not self._closed:
                self._listen_thread = threading.Thread(target=self._listen, name="rollbuf-listen", daemon=True)
                self._listen_thread.start()

    async def close(self) -> None:
        """Finish the transactions already queued, then close the connections and end the threads."""
        if self._closed:
            return
        self._closed = True
        for lane in (self._reader, self._writer):
            done: Future[None] = Future()
            with self._lock:
                if lane.accepting:
                    lane.jobs.put(Stop(done))
                else:
                    done.set_result(None)
            await asyncio.wrap_future(done)
        self._listen_stop.set()
        await asyncio.to_thread(self._join)

    def _join(self) -> None:
        for lane in (self._reader, self._writer):
            if lane.thread is not None:
                lane.thread.join()
        if self._listen_thread is not None:
            self._listen_thread.join()
        self._pool.close()

    # ------------------------------------------------------------------ LISTEN

    def _wake(self) -> None:
        """Call every subscriber on its loop, once for any number of wakes made before that call runs: commits
        come hundreds a second, and each wake-up of an event loop from another thread costs both threads."""
        with self._lock:
            due = [listener for listener in self._listeners if not listener.pending]
            for listener in due:
                listener.pending = True
        for listener in due:
            with contextlib.suppress(RuntimeError):  # that loop is closed
                listener.loop.call_soon_threadsafe(self._fire, listener)

    def _fire(self, listener: _Listener) -> None:
        with self._lock:
            listener.pending = False  # before the call: a commit after this point wakes it again
        listener.callback()

    def _listen(self) -> None:
        """Wake this replica's long-polls when another replica commits queued data. While the connection is
        down, long-polls still re-check on their own timer; once it listens (again), everyone wakes once (a
        notification may have been missed)."""
        failures = 0
        while not self._listen_stop.is_set():
            try:
                with psycopg.connect(self.config.conninfo, autocommit=True) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.config.channel)))
                    self._wake()  # what was committed before LISTEN took effect is seen by the re-check
                    failures = 0
                    while not self._listen_stop.is_set():
                        # What arrived together wakes once (`stop_after` ends the wait at the first packet).
                        notes = conn.notifies(timeout=0.2, stop_after=1)
                        if any(note.payload != self._replica for note in list(notes)):
                            self._wake()
            except psycopg.Error as exc:
                pause = LISTEN_RETRY_S[min(failures, len(LISTEN_RETRY_S) - 1)]
                failures += 1
                if failures == 1:
                    log.warning("LISTEN connection to %s lost (%s); reconnecting", self.url, exc)
                self._listen_stop.wait(pause)

    # ------------------------------------------------------------------ the lanes' threads

    def _main(self, lane: _Lane) -> None:
        stop: Stop | None = None
        try:
            while stop is None:
                group, stop = next_group(lane.jobs, GROUP_MAX)
                if not group:
                    break
                try:
                    self._run(lane, group)
                except BaseException as exc:  # never leave a caller waiting
                    log.exception("PostgreSQL store: unexpected failure")
                    for job in group:
                        deliver(job, False, unavailable("unexpected failure", exc))
        finally:
            with self._lock:
                lane.accepting = False
            refuse_left(lane.jobs, self.url, stop)

    def _run(self, lane: _Lane, jobs: list[Job]) -> None:
        """Run these functions in one transaction; answer each after COMMIT (or with why not)."""
        jobs = [job for job in jobs if not job.future.cancelled()]  # nobody waits for these: skip them
        while jobs:
            jobs = self._run_group(lane, jobs)

    def _connect_and_begin(self, read_only: bool, replies: Sequence[str]) -> tuple[psycopg.Connection[Any], _Group]:
        """A connection in a transaction (holding the store lock, for the writer). A connection found broken at
        BEGIN at once (the server restarted since it was last used: a reset) is replaced, as many times as the
        pool holds connections: nothing was sent on it that could apply. One that took long to fail (the
        database stopped answering) is not: the next would only make the caller wait as long again."""
        for attempt in range(POOL_SIZE + 1):
            conn = self._pool.getconn()
            began = time.monotonic()
            try:
                return conn, _Group(conn, self.config, read_only, replies)
            except BaseException as exc:
                self._release(conn)
                reset = isinstance(exc, psycopg.OperationalError) and conn.broken
                if attempt == POOL_SIZE or not reset or time.monotonic() - began > RESET_S:
                    raise
        raise AssertionError("unreachable")

    def _release(self, conn: psycopg.Connection[Any]) -> None:
        if not conn.broken and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK", prepare=False)
        self._pool.putconn(conn)

    def _run_group(self, lane: _Lane, jobs: list[Job]) -> list[Job]:
        """Run a prefix of `jobs` in one transaction and answer them; return those left to run."""
        try:
            keys = list(dict.fromkeys(key for job in jobs for key in job.replies))
            conn, group = self._connect_and_begin(lane.read_only, keys)
        except BaseException as exc:
            for job in jobs:
                deliver(job, False, unavailable("could not begin a transaction", exc) if is_transient(exc) else exc)
            return []
        try:
            outcomes, to_commit = self._call_all(conn, group, jobs)
        except _AbortGroup as abort:
            self._release(conn)
            cause = abort.cause
            if is_transient(cause):
                for job in jobs:
                    deliver(job, False, unavailable("transaction aborted", cause))
                return []
            # A database error no retry would fix (a bug): the function that hit it fails with it; the ones
            # before it were rolled back with it and run again, the ones after it have not run yet.
            deliver(jobs[abort.index], False, cause)
            return [job for i, job in enumerate(jobs) if i != abort.index]
        if not to_commit:
            self._release(conn)
            for job, ok, value in outcomes:
                deliver(job, ok, value)
            return []
        try:
            group.commit(None if not group.pending.appended else self._replica)
        except BaseException as exc:
            self._release(conn)
            for job, ok, value in outcomes:
                if not ok and not isinstance(value, StoreUnavailable):
                    deliver(job, False, value)  # it raised: rolled back whatever happened to the COMMIT
                else:
                    deliver(job, False, unavailable("commit outcome unknown", exc) if is_transient(exc) else exc)
            return []
        self._trim_replies(conn, group)
        self._release(conn)
        for job, ok, value in outcomes:
            deliver(job, ok, value)
        if group.pending.appended:
            self._wake()
        return []

    def _call_all(
        self, conn: psycopg.Connection[Any], group: _Group, jobs: list[Job]
    ) -> tuple[list[tuple[Job, bool, Any]], bool]:
        """Call each function; one that raises is undone alone (its SAVEPOINT, its copy of `_Pending`).

        Returns the outcomes, and whether anything is left to commit: a function alone in its group that
        raised rolled the whole transaction back (no SAVEPOINT needed)."""
        alone = len(jobs) == 1
        outcomes: list[tuple[Job, bool, Any]] = []
        for i, job in enumerate(jobs):
            before = group.pending if alone else group.pending.copy()
            taken = False

            def savepoint() -> None:
                nonlocal taken
                if not alone and not taken:
                    conn.execute("SAVEPOINT rollbuf_fn", prepare=False)
                    taken = True

            try:
                try:
                    value = job.fn(PostgresTxn(group, savepoint))
                except psycopg.Error:
                    raise
                except BaseException as exc:
                    outcomes.append((job, False, exc))
                    if alone:
                        conn.execute("ROLLBACK", prepare=False)
                        return outcomes, False
                    if taken:
                        conn.execute("ROLLBACK TO SAVEPOINT rollbuf_fn; RELEASE SAVEPOINT rollbuf_fn", prepare=False)
                    group.pending = before
                    continue
                if taken:
                    conn.execute("RELEASE SAVEPOINT rollbuf_fn", prepare=False)
            except psycopg.Error as exc:
                raise _AbortGroup(i, exc) from exc
            outcomes.append((job, True, value))
        return outcomes, True

    def _trim_replies(self, conn: psycopg.Connection[Any], group: _Group) -> None:
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


def _create_or_migrate(conn: psycopg.Connection[Any], config: PostgresConfig) -> None:
    """Create the schema's tables, or bring them to SCHEMA_VERSION, under the store lock (replicas starting
    together do it once)."""
    schema = sql.Identifier(config.schema)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%b)", (config.lock_key,))
        tables = {
            row[0] for row in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = %b", (config.schema,))
        }
        if "meta" not in tables:
            if tables:
                raise RuntimeError(
                    f"schema {config.schema!r} holds tables that are not rollbuf's ({', '.join(sorted(tables))}): "
                    "not touching it; choose another with ?schema="
                )
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema))
            for ddl in _TABLES.values():
                conn.execute(sql.SQL(ddl).format(s=schema))
            conn.execute(
                sql.SQL("INSERT INTO {}.meta (key, value) VALUES ('schema_version', %b), ('next_item_id', 1)").format(
                    schema
                ),
                (SCHEMA_VERSION,),
            )
            return
        row = conn.execute(sql.SQL("SELECT value FROM {}.meta WHERE key = 'schema_version'").format(schema)).fetchone()
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"schema {config.schema!r} has layout version {version}; this rollbuf reads up to {SCHEMA_VERSION}"
            )
        while version < SCHEMA_VERSION:
            for ddl in MIGRATIONS[version]:
                conn.execute(sql.SQL(ddl).format(s=schema))
            version += 1
            log.info("store schema %s migrated to version %d", config.schema, version)
        conn.execute(
            sql.SQL("UPDATE {}.meta SET value = %b WHERE key = 'schema_version'").format(schema), (SCHEMA_VERSION,)
        )
