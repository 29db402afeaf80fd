"""The SQLite file's layout, as the versioned steps that build it (api/store/migrations.py).

Step 1 is the first released layout, exactly as that release created it; every later change is a step of its
own, never an edit of an earlier one: a file of any earlier version is brought to the latest at start.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import msgpack

from api.store.base import held_slot
from api.store.migrations import Step, migrate
from api.store.rollouts import lean_record, packed_slot, turn_counts


def _held_rows(f: _File) -> None:
    """Version 5: each side-buffer blob (msgpack of (seqs, tokens, policy_step, payload), oldest first) becomes
    one row per group, with a new item id and counts beside the queue's; held since the migration."""
    db = f.db
    now = time.time()
    next_id = int(db.execute("SELECT value FROM meta WHERE key = 'next_item_id'").fetchone()[0])
    for env_id, data in db.execute("SELECT env_id, data FROM buffers ORDER BY env_id").fetchall():
        counts = [0, 0, 0, 0, 0]
        for seqs, tokens, step, payload in msgpack.unpackb(data):
            db.execute(
                "INSERT INTO held (item_id, env_id, seqs, tokens, policy_step, held_at, bytes, payload) "
                "VALUES (?,?,?,?,?,?,?,?)",
                (next_id, env_id, seqs, tokens, step, now, len(payload), payload),
            )
            next_id += 1
            counts = [counts[0] + 1, counts[1] + 1, counts[2] + seqs, counts[3] + tokens, counts[4] + len(payload)]
        if counts[0]:
            db.execute(
                "INSERT INTO counts (env_id, items, groups, seqs, tokens, bytes) VALUES (?,?,?,?,?,?)",
                (held_slot(env_id), *counts),
            )
    db.execute("UPDATE meta SET value = ? WHERE key = 'next_item_id'", (next_id,))
    db.execute("DROP TABLE buffers")


def _packed_slots(f: _File) -> None:
    """Version 13: each acknowledged slot's JSON becomes its packed record (with its tokens, score and policy_step
    beside it), each group's record loses what its slots' rows say, and its counters count its slots."""
    db = f.db
    rows = db.execute("SELECT key, slot, data FROM rollout_slots").fetchall()
    for key, slot, data in rows:
        packed, tokens, score, step = packed_slot(data)
        db.execute(
            "UPDATE rollout_slots SET data = ?, tokens = ?, score = ?, policy_step = ? WHERE key = ? AND slot = ?",
            (packed, tokens, score, step, key, slot),
        )
    for key, record in db.execute("SELECT key, record FROM rollout_groups").fetchall():
        db.execute("UPDATE rollout_groups SET record = ? WHERE key = ?", (lean_record(record), key))
    db.execute(
        "UPDATE rollout_groups SET done = (SELECT count(*) FROM rollout_slots s WHERE s.key = rollout_groups.key), "
        "tokens = (SELECT coalesce(sum(s.tokens), 0) FROM rollout_slots s WHERE s.key = rollout_groups.key)"
    )


def _turn_summaries(f: _File) -> None:
    """Version 15: each turn's tokens counted from its JSON, each slot's turns summed in its summary row, and each
    group's `turn_tokens` the tokens of its slots' turns not acknowledged whole."""
    db = f.db
    rows = db.execute("SELECT key, slot, turn, data, bytes FROM rollout_turns ORDER BY key, slot, turn").fetchall()
    for key, slot, turn, data, size in rows:
        tokens, fields = turn_counts(data)
        db.execute(
            "UPDATE rollout_turns SET tokens = ? WHERE key = ? AND slot = ? AND turn = ?", (tokens, key, slot, turn)
        )
        db.execute(
            "INSERT INTO rollout_slot_turns (key, slot, turns, tokens, bytes, fields) VALUES (?,?,1,?,?,?) "
            "ON CONFLICT (key, slot) DO UPDATE SET turns = turns + 1, tokens = tokens + excluded.tokens, "
            "bytes = bytes + excluded.bytes, fields = CASE WHEN fields = 0 THEN excluded.fields ELSE fields END",
            (key, slot, tokens, size, fields),
        )
    db.execute(
        "UPDATE rollout_groups SET turn_tokens = (SELECT coalesce(sum(t.tokens), 0) FROM rollout_slot_turns t "
        "WHERE t.key = rollout_groups.key AND NOT EXISTS (SELECT 1 FROM rollout_slots s WHERE s.key = t.key "
        "AND s.slot = t.slot))"
    )


STEPS = (
    Step(
        "the first layout",
        (
            'CREATE TABLE "values" (key TEXT PRIMARY KEY, value TEXT NOT NULL)',
            # The queues, clustered by env and age: reading a queue's head never touches a payload page.
            "CREATE TABLE queue (env_id INTEGER NOT NULL, item_id INTEGER NOT NULL, seqs INTEGER NOT NULL, "
            "tokens INTEGER NOT NULL, policy_step INTEGER NOT NULL, n_groups INTEGER NOT NULL, "
            "PRIMARY KEY (env_id, item_id)) WITHOUT ROWID",
            # Payloads of queued items, and of popped items a kept batch refers to (batches.items).
            "CREATE TABLE payloads (item_id INTEGER PRIMARY KEY, payload BLOB NOT NULL)",
            "CREATE TABLE counts (env_id INTEGER PRIMARY KEY, items INTEGER NOT NULL, groups INTEGER NOT NULL, "
            "seqs INTEGER NOT NULL, tokens INTEGER NOT NULL)",
            "CREATE TABLE buffers (env_id INTEGER PRIMARY KEY, data BLOB NOT NULL)",
            "CREATE TABLE replies (key TEXT PRIMARY KEY, reply TEXT NOT NULL, created REAL NOT NULL)",
            "CREATE INDEX replies_by_age ON replies (created)",
            "CREATE TABLE batches (step INTEGER PRIMARY KEY, header BLOB NOT NULL, items BLOB NOT NULL)",
            # Internal state that clear() keeps: schema_version, next_item_id.
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value NOT NULL)",
            "INSERT INTO meta (key, value) VALUES ('schema_version', 1), ('next_item_id', 1)",
        ),
    ),
    Step(
        'the named values\' table is "kv", as in PostgreSQL (its name no longer needs quoting)',
        ('ALTER TABLE "values" RENAME TO kv',),
    ),
    Step(
        "queued payload bytes are counted per env, for the queue's byte limit",
        (
            "ALTER TABLE counts ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0",
            "UPDATE counts SET bytes = (SELECT coalesce(sum(length(p.payload)), 0) FROM queue q "
            "JOIN payloads p ON p.item_id = q.item_id WHERE q.env_id = counts.env_id)",
        ),
    ),
    Step(
        "one row per env and per counter, moved out of named values that every request parsed whole",
        (
            "CREATE TABLE envs (env_id INTEGER PRIMARY KEY, name TEXT NOT NULL, version INTEGER NOT NULL, "
            "record TEXT NOT NULL)",
            "CREATE INDEX envs_by_version ON envs (version)",
            "CREATE INDEX envs_by_name ON envs (name)",
            "CREATE TABLE counters (kind TEXT NOT NULL, name TEXT NOT NULL, n INTEGER NOT NULL, "
            "PRIMARY KEY (kind, name)) WITHOUT ROWID",
            "INSERT INTO envs SELECT json_extract(e.value, '$.env_id'), json_extract(e.value, '$.desired_name'), 0, "
            "e.value FROM kv, json_each(kv.value) AS e WHERE kv.key = 'envs'",
            "INSERT INTO kv SELECT 'env_dir', json_object('epoch', lower(hex(randomblob(8))), 'version', 0, "
            "'count', json_array_length(value)) FROM kv WHERE key = 'envs'",
            "INSERT INTO counters SELECT 'received', e.key, e.value FROM kv, json_each(kv.value) AS e "
            "WHERE kv.key = 'stats:received'",
            "INSERT INTO counters SELECT 'backpressure', e.key, e.value FROM kv, json_each(kv.value) AS e "
            "WHERE kv.key = 'stats:backpressure'",
            "INSERT INTO counters SELECT 'served_groups', e.key, e.value FROM kv, json_each(kv.value, '$.groups') AS e "
            "WHERE kv.key = 'stats:served'",
            "INSERT INTO counters SELECT 'served_seqs', e.key, e.value FROM kv, json_each(kv.value, '$.seqs') AS e "
            "WHERE kv.key = 'stats:served'",
            "INSERT INTO counters SELECT 'dropped', r.key || ':' || e.key, r.value "
            "FROM kv, json_each(kv.value) AS e, json_each(e.value) AS r WHERE kv.key = 'dropped'",
            "UPDATE kv SET value = json_remove(value, '$.groups', '$.seqs') WHERE key = 'stats:served'",
            "DELETE FROM kv WHERE key IN ('envs', 'stats:received', 'stats:backpressure', 'dropped')",
        ),
    ),
    Step(
        "the side buffer holds one row per group, counted beside the queues (it was one blob per env, rewritten "
        "whole on every change)",
        (
            "CREATE TABLE held (item_id INTEGER PRIMARY KEY, env_id INTEGER NOT NULL, seqs INTEGER NOT NULL, "
            "tokens INTEGER NOT NULL, policy_step INTEGER NOT NULL, held_at REAL NOT NULL, bytes INTEGER NOT NULL, "
            "payload BLOB NOT NULL)",
            "CREATE INDEX held_by_env ON held (env_id, item_id, seqs, tokens, policy_step, held_at, bytes)",  # covering
        ),
        convert=_held_rows,
    ),
    Step(
        "the ledger: one row per acknowledged group and its fate, one per formed batch (docs/ledger.md); retained "
        "payloads stay in payloads, under their group's id",
        (
            "CREATE TABLE ledger (id INTEGER PRIMARY KEY, env_id INTEGER NOT NULL, group_id BLOB, handler TEXT, "
            "acked_at REAL NOT NULL, policy_step INTEGER NOT NULL, seqs INTEGER NOT NULL, tokens INTEGER NOT NULL, "
            "bytes INTEGER NOT NULL, score_mean REAL NOT NULL, score_min REAL NOT NULL, score_max REAL NOT NULL, "
            "score_std REAL NOT NULL, fate TEXT NOT NULL, step INTEGER, reason TEXT, decided_at REAL, "
            "kept INTEGER NOT NULL DEFAULT 0)",
            "CREATE INDEX ledger_by_group_id ON ledger (group_id) WHERE group_id IS NOT NULL",
            "CREATE INDEX ledger_kept ON ledger (step, id) WHERE kept = 1",
            "CREATE INDEX ledger_dropped ON ledger (step, id) WHERE fate = 'dropped'",  # the drop-bias monitor's
            "CREATE TABLE ledger_steps (step INTEGER PRIMARY KEY, formed_at REAL NOT NULL, formation_s REAL NOT NULL, "
            "group_ids BLOB NOT NULL, seqs INTEGER NOT NULL, tokens INTEGER NOT NULL, groups_by_env TEXT NOT NULL, "
            "seqs_by_env TEXT NOT NULL, staleness TEXT NOT NULL, committed_at REAL)",
        ),
    ),
    Step(
        "the ledger names the producer of each group (its heartbeat id, when the group carried one)",
        ("ALTER TABLE ledger ADD COLUMN producer_id TEXT",),
    ),
    Step(
        "tasks leased to producers (docs/tasks.md): datasets with their cursors, their tasks, and a row per task "
        "handed out, with its fate",
        (
            "CREATE TABLE task_sets (name TEXT PRIMARY KEY, record TEXT NOT NULL)",
            "CREATE TABLE task_data (dataset TEXT NOT NULL, idx INTEGER NOT NULL, data TEXT NOT NULL, "
            "PRIMARY KEY (dataset, idx)) WITHOUT ROWID",
            "CREATE TABLE tasks (dataset TEXT NOT NULL, epoch INTEGER NOT NULL, idx INTEGER NOT NULL, "
            "state TEXT NOT NULL, leases INTEGER NOT NULL, producer TEXT, expires_at REAL, retries INTEGER NOT NULL, "
            "ledger_id INTEGER, step INTEGER, reason TEXT, updated_at REAL NOT NULL, seq INTEGER NOT NULL, "
            "PRIMARY KEY (dataset, epoch, idx)) WITHOUT ROWID",
            "CREATE INDEX tasks_front ON tasks (dataset, seq) WHERE state = 'waiting'",
            "CREATE INDEX tasks_leased ON tasks (dataset, expires_at) WHERE state = 'leased'",
            "CREATE INDEX tasks_by_ledger ON tasks (ledger_id) WHERE ledger_id IS NOT NULL",
        ),
    ),
    Step(
        "groups whose rollouts arrive one by one (docs/rollouts.md): the open groups, and each acknowledged slot",
        (
            "CREATE TABLE rollout_groups (key TEXT PRIMARY KEY, env_id INTEGER NOT NULL, state TEXT NOT NULL, "
            "deadline REAL NOT NULL, expires_at REAL NOT NULL, bytes INTEGER NOT NULL, record TEXT NOT NULL)",
            "CREATE INDEX rollout_groups_due ON rollout_groups (deadline) WHERE state IN ('open', 'sealing')",
            "CREATE INDEX rollout_groups_lapsed ON rollout_groups (expires_at) WHERE state = 'open'",
            "CREATE INDEX rollout_groups_env ON rollout_groups (env_id) WHERE state IN ('open', 'sealing')",
            "CREATE TABLE rollout_slots (key TEXT NOT NULL, slot INTEGER NOT NULL, producer TEXT NOT NULL, "
            "digest TEXT NOT NULL, data TEXT NOT NULL, PRIMARY KEY (key, slot)) WITHOUT ROWID",
        ),
    ),
    Step(
        "payloads live in segment files beside the database (api/store/sqlite/segments.py), their rows saying "
        "where (a small one, and every payload written before, stays in its row: `payload`, empty when the bytes "
        "are in a segment); each segment's live payloads counted by triggers, so every write of a row keeps them",
        (
            "ALTER TABLE payloads ADD COLUMN segment INTEGER",
            "ALTER TABLE payloads ADD COLUMN pos INTEGER",
            "ALTER TABLE payloads ADD COLUMN length INTEGER",
            "ALTER TABLE payloads ADD COLUMN crc INTEGER",
            "CREATE TABLE segments (segment INTEGER PRIMARY KEY, items INTEGER NOT NULL, bytes INTEGER NOT NULL)",
            "CREATE TRIGGER payloads_in AFTER INSERT ON payloads WHEN new.segment IS NOT NULL BEGIN "
            "INSERT INTO segments (segment, items, bytes) VALUES (new.segment, 1, new.length) ON CONFLICT (segment) "
            "DO UPDATE SET items = items + 1, bytes = bytes + excluded.bytes; END",
            "CREATE TRIGGER payloads_out AFTER DELETE ON payloads WHEN old.segment IS NOT NULL BEGIN "
            "UPDATE segments SET items = items - 1, bytes = bytes - old.length WHERE segment = old.segment; END",
        ),
    ),
    Step(
        "every resource records the key that owns it (docs/security.md): a task's lease its key and a random part "
        "of its token; a dataset made before owns to the one key that registered envs of its env's name (no key "
        "if none or several did), an open group to its env's key",
        (
            "ALTER TABLE tasks ADD COLUMN holder TEXT",
            "ALTER TABLE tasks ADD COLUMN nonce TEXT",
            "UPDATE task_sets SET record = json_set(record, '$.owner', (SELECT CASE WHEN count(*) > 0 AND "
            "count(json_extract(e.record, '$.owner')) = count(*) AND count(DISTINCT json_extract(e.record, "
            "'$.owner')) = 1 THEN min(json_extract(e.record, '$.owner')) END FROM envs e "
            "WHERE e.name = json_extract(task_sets.record, '$.env')))",
            "UPDATE rollout_groups SET record = json_set(record, '$.owner', (SELECT json_extract(e.record, "
            "'$.owner') FROM envs e WHERE e.env_id = rollout_groups.env_id))",
        ),
    ),
    Step(
        "a task whose group is in a batch the trainer has not acknowledged is stored `served` (docs/tasks-fates.md), "
        "and turns `trained` when the batch is acknowledged: the rows stored `trained` in a step at or after the "
        "committed mark (the kept value's, else the run's step) become `served`, their datasets' tallies with them",
        (
            "UPDATE tasks SET state = 'served' WHERE state = 'trained' AND step >= coalesce((SELECT "
            "json_extract(value, '$.committed') FROM kv WHERE key = 'kept'), (SELECT json_extract(value, '$') "
            "FROM kv WHERE key = 'step'))",
            "UPDATE task_sets SET record = json_set(record, '$.counts.trained', "
            "coalesce(json_extract(record, '$.counts.trained'), 0) - (SELECT count(*) FROM tasks t WHERE "
            "t.dataset = task_sets.name AND t.state = 'served'), '$.counts.served', (SELECT count(*) FROM tasks t "
            "WHERE t.dataset = task_sets.name AND t.state = 'served')) WHERE EXISTS (SELECT 1 FROM tasks t WHERE "
            "t.dataset = task_sets.name AND t.state = 'served')",
        ),
    ),
    Step(
        "a post writes its slot's row and moves its group's counters, never rewriting the group's record or reading "
        "another slot (docs/rollouts.md, Costs): a group counts its acknowledged slots and their tokens; a slot "
        "keeps its rollout packed as the seal concatenates it, with its tokens, score and policy_step beside it",
        (
            "ALTER TABLE rollout_groups ADD COLUMN done INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE rollout_groups ADD COLUMN tokens INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE rollout_slots ADD COLUMN tokens INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE rollout_slots ADD COLUMN score REAL",
            "ALTER TABLE rollout_slots ADD COLUMN policy_step INTEGER",
            # Which slots are in and whose (views, leases, a post's reply) read this index, not the records.
            "CREATE INDEX rollout_slots_done ON rollout_slots (key, slot, producer)",
        ),
        _packed_slots,
    ),
    Step(
        "a slot's turns, acknowledged as they end (docs/rollouts.md, Turns): what a sibling that takes the slot's "
        "lease continues from; freed with their group's decision",
        (
            "CREATE TABLE rollout_turns (key TEXT NOT NULL, slot INTEGER NOT NULL, turn INTEGER NOT NULL, "
            "producer TEXT NOT NULL, digest TEXT NOT NULL, data BLOB NOT NULL, bytes INTEGER NOT NULL, "
            "PRIMARY KEY (key, slot, turn)) WITHOUT ROWID",
        ),
    ),
    Step(
        "a turn post reads its group's row and its slot's summary, never the slot's turns (docs/rollouts.md, "
        "Costs): each turn counts its tokens, each slot with turns has a summary row (turns, tokens, bytes, the "
        "optional fields they send), and each group counts its acknowledged turns' tokens (the trainer's token "
        "budget counts them when a turn is acknowledged)",
        (
            "ALTER TABLE rollout_turns ADD COLUMN tokens INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE rollout_groups ADD COLUMN turn_tokens INTEGER NOT NULL DEFAULT 0",
            "CREATE TABLE rollout_slot_turns (key TEXT NOT NULL, slot INTEGER NOT NULL, turns INTEGER NOT NULL, "
            "tokens INTEGER NOT NULL, bytes INTEGER NOT NULL, fields INTEGER NOT NULL, PRIMARY KEY (key, slot)) "
            "WITHOUT ROWID",
        ),
        _turn_summaries,
    ),
    Step(
        "a sealed per-rollout group's ledger row says which of its slots were resumed from another producer's turns, "
        "and the tokens that saved (docs/ledger.md); rows written before read as null",
        ("ALTER TABLE ledger ADD COLUMN resumed TEXT", "ALTER TABLE ledger ADD COLUMN tokens_saved INTEGER"),
    ),
)
SCHEMA_VERSION = len(STEPS)
"""The layout this release writes. Earlier ones are migrated at start, newer ones refused."""
CLEARED = (
    "kv",
    "queue",
    "payloads",
    "counts",
    "held",
    "replies",
    "batches",
    "envs",
    "counters",
    "ledger",
    "ledger_steps",
    "task_sets",
    "task_data",
    "tasks",
    "rollout_groups",
    "rollout_slots",
    "rollout_turns",
    "rollout_slot_turns",
)
"""The tables `Txn.clear` empties: all but meta (next_item_id), so ids keep increasing."""


class _File:
    """`migrations.Database` over the writer's connection."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self.db = db
        self.where = str(path)

    def tables(self) -> set[str]:
        rows = self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
        return {row[0] for row in rows}

    def version(self) -> int:
        return int(self.db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])

    def execute(self, statement: str) -> None:
        self.db.execute(statement)

    def set_version(self, version: int) -> None:
        self.db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (version,))


def create_or_migrate(db: sqlite3.Connection, path: Path) -> int:
    """Bring the file to SCHEMA_VERSION, inside the caller's transaction; the version it had (0: new)."""
    return migrate(_File(db, path), STEPS)
