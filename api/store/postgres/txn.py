"""One transaction function's view of the PostgreSQL store (`PostgresTxn`): reads through the group's cache
(api/store/postgres/cache.py) to the database, writes into the cache or, where they cannot wait, to the
database under the function's own savepoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import psycopg

from api.store.base import (
    ANON_ENV,
    DROPPED,
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
from api.store.ledger_rows import GROUP_COLUMNS, STEP_COLUMNS, gid_bytes, group_of, step_of
from api.store.postgres.cache import Group, db_key
from api.store.postgres.schema import CLEARED
from api.store.postgres.tasks import PostgresTaskTxn
from api.store.tasks import TaskTxn

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
_HOLD = (
    "INSERT INTO held (item_id, env_id, seqs, tokens, policy_step, held_at, bytes, payload) "
    "VALUES (%b, %b, %b, %b, %b, %b, %b, %b)"
)
_HELD = "SELECT item_id, seqs, tokens, policy_step, held_at, bytes FROM held WHERE env_id = %b ORDER BY item_id"
# Releases all of these groups or, if one of them is not held for this env, none.
_RELEASE = """
DELETE FROM held WHERE env_id = %(env)b AND item_id = ANY(%(ids)b)
  AND (SELECT count(*) FROM held WHERE env_id = %(env)b AND item_id = ANY(%(ids)b)) = %(n)b
RETURNING item_id, seqs, tokens, policy_step, held_at, payload
"""
_DROP_BATCHES_RETAINING = """
WITH old AS (DELETE FROM batches WHERE step {op} %b RETURNING items)
SELECT coalesce(array_agg(id), '{{}}') FROM (SELECT unnest(items) AS id FROM old) AS ids
"""
_LEDGER_DECIDE = """
UPDATE ledger SET fate = %b, step = %b, reason = %b, decided_at = %b, kept = %b WHERE id = ANY(%b)
"""
_DROP_BATCHES = """
WITH old AS (DELETE FROM batches WHERE step {op} %b RETURNING items),
ids AS (SELECT unnest(items) AS id FROM old),
gone AS (DELETE FROM payloads WHERE item_id IN (SELECT id FROM ids))
SELECT coalesce(array_agg(id), '{{}}') FROM ids
"""


class PostgresTxn(Txn):
    """One transaction function's view: reads go to the database (after the writes it must see), most writes
    wait in `_Pending` for the COMMIT. `savepoint` is called before the function writes to the database."""

    def __init__(self, group: Group, savepoint: Callable[[], None]) -> None:
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

    @property
    def tasks(self) -> TaskTxn:
        return PostgresTaskTxn(self._db, self._write)

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
        self._add(env_id, 1, item.n_groups, item.meta.seqs, item.meta.tokens, len(item.payload))
        p.appended = True

    def _add(self, env_id: int, items: int, groups: int, seqs: int, tokens: int, size: int) -> None:
        c = self._p.counts.setdefault(env_id, [0, 0, 0, 0, 0])
        c[0] += items
        c[1] += groups
        c[2] += seqs
        c[3] += tokens
        c[4] += size
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

    # --- side buffers: rows written through (a rare path), counted in the cache beside the queues ---
    def hold(self, env_id: int, group: HeldGroup) -> None:
        m = group.meta
        size = len(group.payload)
        self._write(_HOLD, (m.item_id, env_id, m.seqs, m.tokens, m.policy_step, group.held_at, size, group.payload))
        self._add(held_slot(env_id), 1, 1, m.seqs, m.tokens, size)

    def held(self, env_id: int) -> list[HeldMeta]:
        rows = self._db.execute(_HELD, (env_id,), binary=True).fetchall()
        return [HeldMeta(ItemMeta(r[0], r[1], r[2], r[3]), r[4], r[5]) for r in rows]

    def release(self, env_id: int, item_ids: Iterable[int]) -> list[HeldGroup]:
        wanted = list(item_ids)
        if not wanted:
            return []
        if len(set(wanted)) != len(wanted):
            raise KeyError(f"groups {wanted} are not all held (once) for env {env_id}")
        rows = self._write(_RELEASE, {"env": env_id, "ids": wanted, "n": len(wanted)}).fetchall()
        if len(rows) != len(wanted):
            raise KeyError(f"groups {wanted} are not all held for env {env_id}")
        found = {r[0]: HeldGroup(ItemMeta(r[0], r[1], r[2], r[3]), r[4], bytes(r[5])) for r in rows}
        out = [found[i] for i in wanted]
        for g in out:
            self._add(held_slot(env_id), -1, -1, -g.meta.seqs, -g.meta.tokens, -len(g.payload))
        return out

    def held_counts(self) -> dict[int, QueueCounts]:
        return {held_slot(env): QueueCounts(*c) for env, c in self._p.counts.items() if c[0] > 0 and env < ANON_ENV}

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

    def drop_batches_before(self, step: int, *, retain: bool = False) -> None:
        self._drop_batches("<", step, retain)

    def _drop_batches(self, op: str, step: int, retain: bool = False) -> None:
        if retain:
            self._write(_DROP_BATCHES_RETAINING.format(op=op), (step,))
            return
        row = self._write(_DROP_BATCHES.format(op=op), (step,)).fetchone()
        for item_id in row[0] if row else ():
            self._p.payloads.pop(item_id, None)

    # --- the ledger: rows added wait for the COMMIT (the ingest path); decisions on stored rows write through ---
    def ledger_add(self, rows: Sequence[LedgerGroup]) -> None:
        self._writable()
        for r in rows:
            self._p.ledger[r.id] = r

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
        self._writable()
        pending = self._p.ledger
        stored = []
        for i in ids:
            row = pending.get(i)
            if row is None:
                stored.append(i)
            else:
                pending[i] = replace(row, fate=fate, step=step, reason=reason, decided_at=at, kept=kept)
        if stored:
            self._write(_LEDGER_DECIDE, (fate, step, reason, at, kept, stored))

    def ledger_requeue(self, old_id: int, new_id: int) -> None:
        self._writable()
        row = self._p.ledger.pop(old_id, None)
        if row is not None:
            self._p.ledger[new_id] = replace(row, id=new_id, fate=QUEUED)
        else:
            self._write("UPDATE ledger SET id = %b, fate = %b WHERE id = %b", (new_id, QUEUED, old_id))

    def _ledger_query(self, where: str, params: Sequence[Any]) -> list[LedgerGroup]:
        cur = self._db.execute(f"SELECT {GROUP_COLUMNS} FROM ledger WHERE {where}", params, binary=True)
        return [group_of(r) for r in cur.fetchall()]

    def ledger_groups(self, ids: Iterable[int]) -> list[LedgerGroup]:
        wanted = list(ids)
        found = {i: self._p.ledger[i] for i in wanted if i in self._p.ledger}
        stored = [i for i in wanted if i not in found]
        if stored:
            found.update((r.id, r) for r in self._ledger_query("id = ANY(%b)", (stored,)))
        return [found[i] for i in wanted if i in found]

    def ledger_named(self, group_id: str) -> list[LedgerGroup]:
        rows = {r.id: r for r in self._ledger_query("group_id = %b", (gid_bytes(group_id),))}
        rows.update((r.id, r) for r in self._p.ledger.values() if r.group_id == group_id)
        return [rows[i] for i in sorted(rows)]

    def ledger_scan(self, after_id: int, limit: int) -> list[LedgerGroup]:
        rows = {r.id: r for r in self._ledger_query("id > %b ORDER BY id LIMIT %b", (after_id, limit))}
        rows.update((r.id, r) for r in self._p.ledger.values() if r.id > after_id)
        return [rows[i] for i in sorted(rows)[:limit]]

    def ledger_dropped(self, first_step: int, last_step: int, limit: int) -> list[LedgerGroup]:
        where = "fate = 'dropped' AND step >= %b AND step <= %b ORDER BY step, id LIMIT %b"
        rows = {r.id: r for r in self._ledger_query(where, (first_step, last_step, limit))}
        rows.update((r.id, r) for r in self._p.ledger.values())  # rows written by this transaction, as they are now
        found = [(r.step, r.id, r) for r in rows.values() if r.fate == DROPPED and r.step is not None]
        return [r for step, _, r in sorted(found, key=lambda f: f[:2]) if first_step <= step <= last_step][:limit]

    # Step rows and their commit marks wait for the COMMIT too: a batch's formation and a commit cost no round
    # trip of their own for them.
    def ledger_put_step(self, row: LedgerStep) -> None:
        self._writable()
        self._p.steps[row.step] = row

    def ledger_committed(self, first: int, before: int, at: float) -> None:
        self._writable()
        p = self._p
        for step, row in p.steps.items():
            if first <= step < before and row.committed_at is None:
                p.steps[step] = replace(row, committed_at=at)
        p.committed.append((first, before, at))

    def ledger_steps(self, first: int, last: int) -> list[LedgerStep]:
        cur = self._db.execute(
            f"SELECT {STEP_COLUMNS} FROM ledger_steps WHERE step >= %b AND step <= %b ORDER BY step",
            (first, last),
            binary=True,
        )
        rows = {r.step: r for r in map(step_of, cur.fetchall())}
        for step, row in rows.items():  # marks not written yet
            if row.committed_at is None:
                at = next((at for f, b, at in self._p.committed if f <= step < b), None)
                if at is not None:
                    rows[step] = replace(row, committed_at=at)
        rows.update((s, r) for s, r in self._p.steps.items() if first <= s <= last)
        return [rows[s] for s in sorted(rows)]

    def ledger_prune(self, below_id: int, below_step: int) -> int:
        cur = self._write(
            "DELETE FROM ledger WHERE id < %b AND fate IN ('served', 'dropped') AND NOT kept", (below_id,)
        )
        gone = cur.rowcount
        self._write("DELETE FROM ledger_steps WHERE step < %b", (below_step,))
        for step in [s for s in self._p.steps if s < below_step]:
            del self._p.steps[step]
        return gone

    # --- retained payloads: rows of payloads, under their group's id ---
    def keep_payloads(self, items: Sequence[tuple[int, bytes]]) -> None:
        self._writable()
        for item_id, payload in items:
            self._p.payloads[item_id] = payload

    def kept_payloads(self, ids: Iterable[int]) -> dict[int, bytes]:
        wanted = list(ids)
        out = {i: self._p.payloads[i] for i in wanted if i in self._p.payloads}
        stored = [i for i in wanted if i not in out]
        if stored:
            cur = self._db.execute(
                "SELECT item_id, payload FROM payloads WHERE item_id = ANY(%b)", (stored,), binary=True
            )
            out.update((int(i), bytes(p)) for i, p in cur.fetchall())
        return out

    def kept_oldest(self, limit: int) -> list[KeptPayload]:
        cur = self._db.execute(
            "SELECT id, coalesce(step, 0), bytes FROM ledger WHERE kept ORDER BY step, id LIMIT %b",
            (limit,),
            binary=True,
        )
        out = {int(r[0]): KeptPayload(int(r[0]), int(r[1]), int(r[2])) for r in cur.fetchall()}
        out.update((r.id, KeptPayload(r.id, r.step or 0, r.bytes)) for r in self._p.ledger.values() if r.kept)
        return sorted(out.values(), key=lambda k: (k.step, k.id))[:limit]

    def prune_payloads(self, ids: Sequence[int]) -> None:
        wanted = list(ids)
        if not wanted:
            return
        self._writable()
        for i in wanted:
            self._p.payloads.pop(i, None)
            row = self._p.ledger.get(i)
            if row is not None:
                self._p.ledger[i] = replace(row, kept=False)
        self._write("DELETE FROM payloads WHERE item_id = ANY(%b)", (wanted,))
        self._write("UPDATE ledger SET kept = false WHERE id = ANY(%b)", (wanted,))

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
