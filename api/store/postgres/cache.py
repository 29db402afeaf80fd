"""The PostgreSQL store's write-back cache: what one group of transaction functions read once and wrote, held
in memory between BEGIN and COMMIT.

A `Group` is one PostgreSQL transaction. BEGIN, the store lock, the small tables (values, counts, the item id
counter, the task datasets' records) and the replies the functions announced are read in one round trip; most
writes (appended items, their payloads, replies, counts, values, ledger and task rows) wait in `Pending` and go
with the COMMIT, as one statement (api/store/postgres/flush.py), in one round trip. Reads that miss the cache
go to the database (api/store/postgres/txn.py) and lay the pending rows over what it returns, all through
api/store/overlay.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import psycopg
from psycopg.pq import Escaping

from api.store import sql as queries
from api.store.base import ItemMeta, LedgerGroup, LedgerStep
from api.store.ledger_rows import group_values, step_values
from api.store.postgres import flush
from api.store.postgres.config import PostgresConfig
from api.store.postgres.flush import Writes
from api.store.tasks import TaskRow, values_of

_FLUSH_STEP = queries.postgres("ledger_put_step")
_FLUSH_COMMITTED = queries.postgres("ledger_committed")


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
    """Task rows written in this group, by (dataset, epoch, index): reads lay them over the stored ones
    (api/store/overlay.py), the COMMIT writes them."""

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
        query = (
            f"{begin}; SELECT value FROM meta WHERE key = 'next_item_id'; SELECT key, value FROM kv; "
            "SELECT env_id, items, groups, seqs, tokens, bytes FROM counts; SELECT name, record FROM task_sets"
        ).encode()
        stored_keys = {db_key(k): k for k in replies}
        if replies:  # the keys are quoted by libpq (PQescapeLiteral), not by us; psycopg's sql.Literal of a list
            # costs 16 us of Python per transaction
            escape, encoding = Escaping(conn.pgconn).escape_literal, conn.info.encoding
            keys = b", ".join(escape(k.encode(encoding)) for k in stored_keys)
            query += b"; SELECT key, reply FROM replies WHERE key = ANY(ARRAY[" + keys + b"]::text[])"
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
        """Send the buffered writes and COMMIT: one statement (api/store/postgres/flush.py) and the COMMIT in
        one round trip; step rows and their commit marks (one per formed batch) go as statements of their own
        before the COMMIT (a mark may update a row written with it), as do named values deleted (the values' part
        writes the same table)."""
        p = self.pending
        w = Writes()
        queued = [(m, n, env) for env, items in p.queued.items() for m, n in items.values()]
        w.insert(flush.QUEUE, [(m.item_id, env, m.seqs, m.tokens, m.policy_step, n) for m, n, env in queued])
        w.insert(flush.PAYLOADS, list(p.payloads.items()))
        if p.replies:
            now = time.time()
            w.insert(flush.REPLIES, [(db_key(k), r, now) for k, r in p.replies.items()])
            self.replies_added += len(p.replies)
        w.insert(flush.COUNTS, [(env, *p.counts.get(env, [0, 0, 0, 0, 0])) for env in sorted(p.dirty_counts)])
        dirty = sorted(p.dirty_values)
        w.insert(flush.VALUES, [(k, p.values[k]) for k in dirty if k in p.values])
        deleted = [k for k in dirty if k not in p.values]
        w.insert(flush.COUNTERS, [(*k, p.counters[k]) for k in sorted(p.counters)])
        w.insert(flush.LEDGER, [group_values(r) for r in p.ledger.values()])
        w.insert(flush.TASK_SETS, [(k, p.task_sets[k]) for k in sorted(p.dirty_task_sets)])
        w.insert(flush.TASKS, [values_of(r) for r in p.task_rows.values()])
        if self.next_id != self.stored_next_id:
            w.add(flush.NEXT_ID, [self.next_id])
        if notify is not None and (p.appended or p.dirty_values):  # data queued, or the run or an env changed
            w.add(flush.NOTIFY, [self.config.channel, notify])
        conn = self.conn
        with conn.pipeline():
            if (statement := w.statement()) is not None:
                conn.execute(statement, w.params, binary=True)
            if deleted:  # a statement of its own: the one statement's parts write a table each (flush.py)
                conn.execute("DELETE FROM kv WHERE key = ANY(%b::text[])", [deleted], binary=True)
            if p.steps:
                conn.cursor().executemany(_FLUSH_STEP, [step_values(r) for r in p.steps.values()])
            for first, before, at in p.committed:
                conn.execute(_FLUSH_COMMITTED, [at, first, before])
            conn.execute("COMMIT", prepare=False)
