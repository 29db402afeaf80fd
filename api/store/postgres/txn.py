"""One transaction function's view of the PostgreSQL store (`PostgresTxn`): reads through the group's cache
(api/store/postgres/cache.py) to the database, writes into the cache or, where they cannot wait, to the
database under the function's own savepoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import psycopg

from api.store import overlay
from api.store.base import ANON_ENV, ItemMeta, QueueCounts, QueuedItem, Txn
from api.store.jobs import head_chunk_sizes
from api.store.postgres.cache import Group, db_key
from api.store.postgres.held import PostgresHeld
from api.store.postgres.ledger import PostgresLedger
from api.store.postgres.rollouts import PostgresOpenGroupTxn
from api.store.postgres.schema import CLEARED
from api.store.postgres.tasks import PostgresTaskTxn

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
_DROP_BATCHES_RETAINING = """
WITH old AS (DELETE FROM batches WHERE step {op} %b RETURNING items)
SELECT coalesce(array_agg(id), '{{}}') FROM (SELECT unnest(items) AS id FROM old) AS ids
"""
_DROP_BATCHES = """
WITH old AS (DELETE FROM batches WHERE step {op} %b RETURNING items),
ids AS (SELECT unnest(items) AS id FROM old),
gone AS (DELETE FROM payloads WHERE item_id IN (SELECT id FROM ids))
SELECT coalesce(array_agg(id), '{{}}') FROM ids
"""


_NONE: dict[int, tuple[ItemMeta, int]] = {}
"""The queue of an env this group appended nothing to."""


_SCAN_PAGE = 64
"""Payloads a scan (`payloads_with`) fetches at a time."""


def _meta(queued: tuple[ItemMeta, int]) -> ItemMeta:
    return queued[0]


def _item_id(meta: ItemMeta) -> int:
    return meta.item_id


class _Writes:
    """What a function's parts (held groups, the ledger, tasks, open groups) write through. Apart from
    `PostgresTxn` so that the parts hold no reference back to it: a transaction and its parts referring to each
    other were a reference cycle, which left every transaction's objects to the cyclic garbage collector (17 per
    ingested group) rather than freed as its function returned."""

    __slots__ = ("group", "pending", "db", "savepoint")

    def __init__(self, group: Group, savepoint: Callable[[], None]) -> None:
        self.group = group
        self.pending = group.pending
        self.db = group.conn
        self.savepoint = savepoint

    def write(self, query: str, params: Sequence[Any] | dict[str, Any] | None = None) -> psycopg.Cursor[Any]:
        self.writable()
        self.savepoint()
        return self.db.execute(query, params, binary=True)

    def writable(self) -> None:
        if self.group.read_only:
            raise RuntimeError("a function passed to Store.read wrote to the store: use Store.transact")

    def add(self, env_id: int, items: int, groups: int, seqs: int, tokens: int, size: int) -> None:
        c = self.pending.counts.setdefault(env_id, [0, 0, 0, 0, 0])
        c[0] += items
        c[1] += groups
        c[2] += seqs
        c[3] += tokens
        c[4] += size
        self.pending.dirty_counts.add(env_id)


class PostgresTxn(Txn):
    """One transaction function's view: reads go to the database (after the writes it must see), most writes
    wait in `_Pending` for the COMMIT. `savepoint` is called before the function writes to the database."""

    def __init__(self, group: Group, savepoint: Callable[[], None]) -> None:
        self._g = group
        self._p = group.pending
        self._db = group.conn
        w = _Writes(group, savepoint)
        self._write, self._writable, self._add, self._savepoint = w.write, w.writable, w.add, savepoint
        self.held = PostgresHeld(self._db, self._p, w.write, w.add)
        self.ledger = PostgresLedger(self._db, self._p, w.write, w.writable)
        self.tasks = PostgresTaskTxn(self._db, self._p, w.write, w.writable)
        self.rollouts = PostgresOpenGroupTxn(self._db, w.write)

    # --- values: read once per group ---
    def get_value(self, key: str) -> str | None:
        return self._p.values.get(key)

    def set_value(self, key: str, value: str) -> None:
        self._writable()
        self._p.values[key] = value
        self._p.dirty_values.add(key)

    def delete_value(self, key: str) -> None:
        self._writable()
        self._p.values.pop(key, None)
        self._p.dirty_values.add(key)  # dirty and absent: deleted with the COMMIT

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
        self._add(env_id, 1, item.n_groups, item.meta.seqs, item.meta.tokens, len(item.payload))
        p.appended = True

    def head(self, env_id: int) -> Iterator[ItemMeta]:
        # Keyset pages, not one open cursor: pops and appends between two reads of the iterator are safe.
        db, p = self._db, self._p

        def read(after: int | None, limit: int) -> list[ItemMeta]:
            first = -(2**63) if after is None else after
            return [ItemMeta(*row) for row in db.execute(_HEAD, (env_id, first, limit), binary=True).fetchall()]

        return overlay.paged(read, lambda: p.queued.get(env_id, _NONE), _meta, _item_id, head_chunk_sizes())

    def pop(
        self, env_id: int, item_ids: Iterable[int], *, keep_for: int | None = None, retain: bool = False
    ) -> list[QueuedItem]:
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
                _POP_KEEP if keep_for is not None or retain else _POP, {"env": env_id, "ids": stored, "n": len(stored)}
            ).fetchall()
            if len(rows) != len(stored):  # nothing was deleted
                missing = sorted(set(stored) - {row[0] for row in rows})
                raise KeyError(f"items {missing or stored} are not all queued for env {env_id}")
            for item_id, seqs, tokens, policy_step, n_groups, payload in rows:
                found[item_id] = QueuedItem(ItemMeta(item_id, seqs, tokens, policy_step), n_groups, payload)
        for item_id in wanted:
            if item_id in local:
                meta, n_groups = local.pop(item_id)
                payload = p.payloads[item_id] if keep_for is not None or retain else p.payloads.pop(item_id)
                found[item_id] = QueuedItem(meta, n_groups, payload)
        items = [found[i] for i in wanted]
        gone = QueueCounts.of(items)
        self._add(env_id, -gone.items, -gone.groups, -gone.seqs, -gone.tokens, -gone.bytes)
        return items

    def counts(self) -> dict[int, QueueCounts]:
        return {env: QueueCounts(*c) for env, c in self._p.counts.items() if c[0] > 0 and env >= ANON_ENV}

    # --- envs: written through to the database (rare), read from it ---
    def put_env(self, env_id: int, name: str, version: int, record: str) -> None:
        self._write(
            "INSERT INTO envs (env_id, name, version, record) VALUES (%b, %b, %b, %b) ON CONFLICT (env_id) DO UPDATE "
            "SET name = excluded.name, version = excluded.version, record = excluded.record",
            (env_id, name, version, record),
        )

    def envs_since(self, version: int) -> list[tuple[int, str]]:
        cur = self._db.execute(
            "SELECT env_id, record FROM envs WHERE version > %b ORDER BY env_id", (version,), binary=True
        )
        return [(int(row[0]), str(row[1])) for row in cur.fetchall()]

    def count_named(self, name: str) -> int:
        row = self._db.execute("SELECT count(*) FROM envs WHERE name = %b", (name,), binary=True).fetchone()
        return int(row[0]) if row else 0

    # --- counters: deltas wait for the COMMIT ---
    def add_counts(self, kind: str, deltas: Mapping[str, int]) -> None:
        self._writable()
        pending = self._p.counters
        for name, n in deltas.items():
            pending[kind, name] = pending.get((kind, name), 0) + n

    def get_counts(self, kind: str) -> dict[str, int]:
        cur = self._db.execute("SELECT name, n FROM counters WHERE kind = %b", (kind,), binary=True)
        out = {str(name): int(n) for name, n in cur.fetchall()}
        for (k, name), n in self._p.counters.items():
            if k == kind:
                out[name] = out.get(name, 0) + n
        return out

    # --- idempotency replies ---
    def get_reply(self, key: str) -> str | None:
        # Written by this group, else read at BEGIN (the keys announced to `transact`), else read now.
        p = self._p
        return overlay.one(key, p.replies, lambda k: overlay.one(k, p.fetched_replies, self._reply))

    def _reply(self, key: str) -> str | None:
        row = self._db.execute("SELECT reply FROM replies WHERE key = %b", (db_key(key),), binary=True).fetchone()
        return None if row is None else cast(str, row[0])

    def put_reply(self, key: str, reply: str) -> None:
        self._writable()
        self._p.replies[key] = reply

    # --- formed batches ---
    def put_batch(self, step: int, header: bytes, item_ids: Sequence[int]) -> None:
        self._writable()
        ids = list(item_ids)
        if len(overlay.point(set(ids), self._p.payloads, self._payload_ids)) != len(set(ids)):
            raise KeyError(f"batch {step} refers to items that were not popped with keep_for={step}")
        self._drop_batches("=", step)
        self._write("INSERT INTO batches (step, header, items) VALUES (%b, %b, %b)", (step, header, ids))

    def get_batch(self, step: int) -> bytes | None:
        row = self._db.execute("SELECT header, items FROM batches WHERE step = %b", (step,), binary=True).fetchone()
        if row is None:
            return None
        header, ids = row
        payloads = overlay.point(ids, self._p.payloads, self._payloads)
        return b"".join([header, *(payloads[i] for i in ids)])

    def _payloads(self, ids: list[int]) -> list[tuple[int, bytes]]:
        cur = self._db.execute("SELECT item_id, payload FROM payloads WHERE item_id = ANY(%b)", (ids,), binary=True)
        return cur.fetchall()

    def _payload_ids(self, ids: list[int]) -> list[tuple[int, bytes]]:
        """Which of `ids` have a stored payload, each with b"" (the payload is not read)."""
        cur = self._db.execute("SELECT item_id FROM payloads WHERE item_id = ANY(%b)", (ids,), binary=True)
        return [(int(r[0]), b"") for r in cur.fetchall()]

    def payloads_with(self, marker: bytes) -> Iterator[bytes]:
        pending = dict(self._p.payloads)  # rows of this group not written yet: they replace stored ones
        for table in ("payloads", "held"):
            with self._db.cursor(name=f"rollbuf_{table}_scan", binary=True) as cur:
                cur.itersize = _SCAN_PAGE
                cur.execute(f"SELECT item_id, payload FROM {table} WHERE position(%b in payload) > 0", (marker,))
                for item_id, payload in cur:
                    if table == "held" or int(item_id) not in pending:
                        yield bytes(payload)
        yield from (p for p in pending.values() if marker in p)

    def drop_batches_before(self, step: int, *, retain: bool = False) -> None:
        self._drop_batches("<", step, retain)

    def _drop_batches(self, op: str, step: int, retain: bool = False) -> None:
        if retain:
            self._write(_DROP_BATCHES_RETAINING.format(op=op), (step,))
            return
        row = self._write(_DROP_BATCHES.format(op=op), (step,)).fetchone()
        for item_id in row[0] if row else ():
            self._p.payloads.pop(item_id, None)

    def clear(self) -> None:
        self._writable()
        self._savepoint()
        self._db.execute("; ".join(f"DELETE FROM {table}" for table in CLEARED))  # meta (next_item_id) stays
        p = self._p
        p.values.clear()
        p.dirty_values.clear()
        p.counts.clear()
        p.dirty_counts.clear()
        p.queued.clear()
        p.payloads.clear()
        p.replies.clear()
        p.fetched_replies = {}
        p.counters.clear()
        p.ledger.clear()
        p.steps.clear()
        p.committed.clear()
