"""The PostgreSQL store's write-back cache: what one group of transaction functions read once and wrote, held
in memory between BEGIN and COMMIT.

A `Group` is one PostgreSQL transaction. BEGIN, the store lock, the small tables (values, counts, the item id
counter, the task datasets' records) and the replies the functions announced are read in one round trip; most
writes (appended items, their payloads, replies, counts, values, ledger and task rows) wait in `Pending` and go
with the COMMIT in one pipeline. Reads that miss the cache go to the database (api/store/postgres/txn.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import psycopg
from psycopg import sql

from api.store import sql as queries
from api.store.base import ItemMeta, LedgerGroup, LedgerStep
from api.store.ledger_rows import GROUP_COLUMNS, group_values, pg_unnest, step_values
from api.store.postgres.config import PostgresConfig
from api.store.tasks import COLUMNS as TASK_COLUMNS
from api.store.tasks import TaskRow, values_of

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
    "INSERT INTO counts (env_id, items, groups, seqs, tokens, bytes) "
    "SELECT * FROM unnest(%b::int8[], %b::int8[], %b::int8[], %b::int8[], %b::int8[], %b::int8[]) "
    "ON CONFLICT (env_id) DO UPDATE SET items = excluded.items, groups = excluded.groups, seqs = excluded.seqs, "
    "tokens = excluded.tokens, bytes = excluded.bytes"
)
_FLUSH_VALUES = (
    "INSERT INTO kv (key, value) SELECT * FROM unnest(%b::text[], %b::text[]) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)

_FLUSH_LEDGER = f"INSERT INTO ledger ({GROUP_COLUMNS}) SELECT * FROM {pg_unnest()}"
_FLUSH_STEP = queries.postgres("ledger_put_step")
_FLUSH_COMMITTED = queries.postgres("ledger_committed")

_FLUSH_TASK_SETS = (
    "INSERT INTO task_sets (name, record) SELECT * FROM unnest(%b::text[], %b::text[]) "
    "ON CONFLICT (name) DO UPDATE SET record = excluded.record"
)
FLUSH_TASKS = (
    f"INSERT INTO tasks ({TASK_COLUMNS}) SELECT * FROM unnest(%b::text[], %b::int8[], %b::int8[], %b::text[], "
    "%b::int8[], %b::text[], %b::float8[], %b::int8[], %b::int8[], %b::int8[], %b::text[], %b::float8[], %b::int8[]) "
    "ON CONFLICT (dataset, epoch, idx) DO UPDATE SET state = excluded.state, leases = excluded.leases, "
    "producer = excluded.producer, expires_at = excluded.expires_at, retries = excluded.retries, "
    "ledger_id = excluded.ledger_id, step = excluded.step, reason = excluded.reason, "
    "updated_at = excluded.updated_at, seq = excluded.seq"
)

_FLUSH_COUNTERS = (
    "INSERT INTO counters (kind, name, n) SELECT * FROM unnest(%b::text[], %b::text[], %b::int8[]) "
    "ON CONFLICT (kind, name) DO UPDATE SET n = counters.n + excluded.n"
)


def db_key(key: str) -> str:
    """An idempotency key as the `replies` table holds it. PostgreSQL text cannot hold NUL, which a group id
    may contain: such keys (and, to stay one-to-one, keys starting with \\x01) are escaped behind a \\x01
    prefix; every other key is stored as it is."""
    if "\0" not in key and not key.startswith("\x01"):
        return key
    return "\x01" + key.replace("\x01", "\x01\x01").replace("\0", "\x01\x02")


@dataclass(slots=True)
class Pending:
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
    appended: bool = False
    counters: dict[tuple[str, str], int] = field(default_factory=dict)
    """Deltas to add to the counters table, by (kind, name)."""
    ledger: dict[int, LedgerGroup] = field(default_factory=dict)
    """Ledger rows added (and decided since) in this group, by id: inserted with the COMMIT."""
    steps: dict[int, LedgerStep] = field(default_factory=dict)
    """Step rows written in this group (formed batches), by step: written with the COMMIT."""
    committed: list[tuple[int, int, float]] = field(default_factory=list)
    """Commit marks of stored step rows, (first, before, at) as `ledger.committed` took them: with the COMMIT."""
    task_sets: dict[str, str] = field(default_factory=dict)
    """Dataset records (docs/tasks.md), read at BEGIN: one row per dataset, read and rewritten by every lease."""
    dirty_task_sets: set[str] = field(default_factory=set)
    task_rows: dict[tuple[str, int, int], TaskRow] = field(default_factory=dict)
    """Task rows written in this group, by (dataset, epoch, index): reads overlay them, the COMMIT writes them."""

    def copy(self) -> Pending:
        return Pending(
            dict(self.values),
            set(self.dirty_values),
            {k: list(v) for k, v in self.counts.items()},
            set(self.dirty_counts),
            {env: dict(items) for env, items in self.queued.items()},
            dict(self.payloads),
            dict(self.replies),
            self.fetched_replies,
            self.appended,
            dict(self.counters),
            dict(self.ledger),
            dict(self.steps),
            list(self.committed),
            dict(self.task_sets),
            set(self.dirty_task_sets),
            dict(self.task_rows),
        )


class Group:
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
            "SELECT env_id, items, groups, seqs, tokens, bytes FROM counts; SELECT name, record FROM task_sets"
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
        cur.nextset()
        task_sets = {str(k): str(v) for k, v in cur.fetchall()}
        fetched: dict[str, str | None] = dict.fromkeys(replies)
        if replies:
            cur.nextset()
            fetched.update((stored_keys[k], v) for k, v in cur.fetchall())
        self.pending = Pending(values, set(), counts, set(), fetched_replies=fetched, task_sets=task_sets)
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
                cols = [p.counts.get(env, [0, 0, 0, 0, 0]) for env in envs]
                conn.execute(_FLUSH_COUNTS, [envs, *([c[i] for c in cols] for i in range(5))])
            if p.dirty_values:
                keys = sorted(p.dirty_values)
                conn.execute(_FLUSH_VALUES, [keys, [p.values[k] for k in keys]])
            if p.counters:
                counted = sorted(p.counters)
                conn.execute(
                    _FLUSH_COUNTERS,
                    [[k for k, _ in counted], [n for _, n in counted], [p.counters[k] for k in counted]],
                )
            if p.ledger:
                rows = [group_values(r) for r in p.ledger.values()]
                conn.execute(_FLUSH_LEDGER, [list(col) for col in zip(*rows, strict=True)], binary=True)
            if p.steps:
                conn.cursor().executemany(_FLUSH_STEP, [step_values(r) for r in p.steps.values()])
            for first, before, at in p.committed:
                conn.execute(_FLUSH_COMMITTED, [at, first, before])
            if p.dirty_task_sets:
                names = sorted(p.dirty_task_sets)
                conn.execute(_FLUSH_TASK_SETS, [names, [p.task_sets[k] for k in names]])
            if p.task_rows:
                rows_ = [values_of(r) for r in p.task_rows.values()]
                conn.execute(FLUSH_TASKS, [list(col) for col in zip(*rows_, strict=True)], binary=True)
            if self.next_id != self.stored_next_id:
                conn.execute("UPDATE meta SET value = %b WHERE key = 'next_item_id'", [self.next_id])
            if notify is not None and (p.appended or p.dirty_values):  # data queued, or the run or an env changed
                conn.execute("SELECT pg_notify(%b, %b)", [self.config.channel, notify])
            conn.execute("COMMIT", prepare=False)
