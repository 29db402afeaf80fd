"""The PostgreSQL schema's layout, as the versioned steps that build it (api/store/migrations.py).

Statements name the schema `{s}` (rollbuf's, or the URL's `?schema=`). Step 1 is the first released layout,
exactly as that release created it; every later change is a step of its own, never an edit of an earlier one.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import psycopg
from psycopg import sql

from api.store.base import held_slot
from api.store.migrations import Step, migrate
from api.store.postgres.config import PostgresConfig
from api.store.rollouts import lean_record, packed_slot, turn_counts


def _held_rows(db: _Schema) -> None:
    """Version 4: each side-buffer blob (msgpack of (seqs, tokens, policy_step, payload), oldest first) becomes
    one row per group, with a new item id and counts beside the queue's; held since the migration."""
    s = db.schema
    conn = db.conn
    now = time.time()
    row = conn.execute(sql.SQL("SELECT value FROM {}.meta WHERE key = 'next_item_id'").format(s)).fetchone()
    next_id = int(row[0]) if row else 1
    hold = sql.SQL(
        "INSERT INTO {}.held (item_id, env_id, seqs, tokens, policy_step, held_at, bytes, payload) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
    ).format(s)
    count = sql.SQL(
        "INSERT INTO {}.counts (env_id, items, groups, seqs, tokens, bytes) VALUES (%s, %s, %s, %s, %s, %s)"
    )
    for env_id, data in conn.execute(
        sql.SQL("SELECT env_id, data FROM {}.buffers ORDER BY env_id").format(s)
    ).fetchall():
        counts = [0, 0, 0, 0, 0]
        for seqs, tokens, step, payload in msgpack.unpackb(bytes(data)):
            conn.execute(hold, (next_id, env_id, seqs, tokens, step, now, len(payload), payload))
            next_id += 1
            counts = [counts[0] + 1, counts[1] + 1, counts[2] + seqs, counts[3] + tokens, counts[4] + len(payload)]
        if counts[0]:
            conn.execute(count.format(s), (held_slot(int(env_id)), *counts))
    conn.execute(sql.SQL("UPDATE {}.meta SET value = %s WHERE key = 'next_item_id'").format(s), (next_id,))
    conn.execute(sql.SQL("DROP TABLE {}.buffers").format(s))


STEPS = (
    Step(
        "the first layout",
        (
            "CREATE SCHEMA IF NOT EXISTS {s}",
            "CREATE TABLE {s}.meta (key text PRIMARY KEY, value bigint NOT NULL)",
            "CREATE TABLE {s}.kv (key text PRIMARY KEY, value text NOT NULL)",
            # What batch formation reads, clustered by env and age; payloads apart, so heads never touch them.
            "CREATE TABLE {s}.queue (env_id bigint NOT NULL, item_id bigint NOT NULL, seqs bigint NOT NULL, "
            "tokens bigint NOT NULL, policy_step bigint NOT NULL, n_groups bigint NOT NULL, "
            "PRIMARY KEY (env_id, item_id))",
            # Payloads of queued items and of popped items a kept batch refers to. Stored uncompressed (EXTERNAL):
            # token ids compress poorly and pglz would cost the database's CPU on every write and read.
            "CREATE TABLE {s}.payloads (item_id bigint PRIMARY KEY, payload bytea NOT NULL)",
            "ALTER TABLE {s}.payloads ALTER COLUMN payload SET STORAGE EXTERNAL",
            "CREATE TABLE {s}.counts (env_id bigint PRIMARY KEY, items bigint NOT NULL, groups bigint NOT NULL, "
            "seqs bigint NOT NULL, tokens bigint NOT NULL)",
            "CREATE TABLE {s}.buffers (env_id bigint PRIMARY KEY, data bytea NOT NULL)",
            "CREATE TABLE {s}.replies (key text PRIMARY KEY, reply text NOT NULL, created double precision "
            "NOT NULL, seq bigint GENERATED ALWAYS AS IDENTITY)",
            "CREATE INDEX replies_by_seq ON {s}.replies (seq)",
            "CREATE INDEX replies_by_age ON {s}.replies (created)",
            "CREATE TABLE {s}.batches (step bigint PRIMARY KEY, header bytea NOT NULL, items bigint[] NOT NULL)",
            "INSERT INTO {s}.meta (key, value) VALUES ('schema_version', 1), ('next_item_id', 1)",
        ),
    ),
    Step(
        "queued payload bytes are counted per env, for the queue's byte limit",
        (
            "ALTER TABLE {s}.counts ADD COLUMN bytes bigint NOT NULL DEFAULT 0",
            "UPDATE {s}.counts c SET bytes = (SELECT coalesce(sum(octet_length(p.payload)), 0) FROM {s}.queue q "
            "JOIN {s}.payloads p ON p.item_id = q.item_id WHERE q.env_id = c.env_id)",
        ),
    ),
    Step(
        "one row per env and per counter, moved out of named values that every transaction read whole",
        (
            "CREATE TABLE {s}.envs (env_id bigint PRIMARY KEY, name text NOT NULL, version bigint NOT NULL, "
            "record text NOT NULL)",
            "CREATE INDEX envs_by_version ON {s}.envs (version)",
            "CREATE INDEX envs_by_name ON {s}.envs (name)",
            "CREATE TABLE {s}.counters (kind text NOT NULL, name text NOT NULL, n bigint NOT NULL, "
            "PRIMARY KEY (kind, name))",
            "INSERT INTO {s}.envs SELECT (e->>'env_id')::bigint, e->>'desired_name', 0, e::text "
            "FROM {s}.kv, jsonb_array_elements(kv.value::jsonb) AS e WHERE kv.key = 'envs'",
            "INSERT INTO {s}.kv SELECT 'env_dir', jsonb_build_object('epoch', md5(random()::text), 'version', 0, "
            "'count', jsonb_array_length(value::jsonb))::text FROM {s}.kv WHERE key = 'envs'",
            "INSERT INTO {s}.counters SELECT 'received', e.key, e.value::bigint "
            "FROM {s}.kv, jsonb_each_text(kv.value::jsonb) AS e WHERE kv.key = 'stats:received'",
            "INSERT INTO {s}.counters SELECT 'backpressure', e.key, e.value::bigint "
            "FROM {s}.kv, jsonb_each_text(kv.value::jsonb) AS e WHERE kv.key = 'stats:backpressure'",
            "INSERT INTO {s}.counters SELECT 'served_groups', e.key, e.value::bigint "
            "FROM {s}.kv, jsonb_each_text(kv.value::jsonb -> 'groups') AS e WHERE kv.key = 'stats:served'",
            "INSERT INTO {s}.counters SELECT 'served_seqs', e.key, e.value::bigint "
            "FROM {s}.kv, jsonb_each_text(kv.value::jsonb -> 'seqs') AS e WHERE kv.key = 'stats:served'",
            "INSERT INTO {s}.counters SELECT 'dropped', r.key || ':' || e.key, r.value::bigint "
            "FROM {s}.kv, jsonb_each(kv.value::jsonb) AS e, jsonb_each_text(e.value) AS r WHERE kv.key = 'dropped'",
            "UPDATE {s}.kv SET value = (value::jsonb - 'groups' - 'seqs')::text WHERE key = 'stats:served'",
            "DELETE FROM {s}.kv WHERE key IN ('envs', 'stats:received', 'stats:backpressure', 'dropped')",
        ),
    ),
    Step(
        "the side buffer holds one row per group, counted beside the queues (it was one blob per env, rewritten "
        "whole on every change)",
        (
            "CREATE TABLE {s}.held (item_id bigint PRIMARY KEY, env_id bigint NOT NULL, seqs bigint NOT NULL, "
            "tokens bigint NOT NULL, policy_step bigint NOT NULL, held_at double precision NOT NULL, "
            "bytes bigint NOT NULL, payload bytea NOT NULL)",
            "ALTER TABLE {s}.held ALTER COLUMN payload SET STORAGE EXTERNAL",
            "CREATE INDEX held_by_env ON {s}.held (env_id, item_id)",
        ),
        convert=_held_rows,
    ),
    Step(
        "the ledger: one row per acknowledged group and its fate, one per formed batch (docs/ledger.md); retained "
        "payloads stay in payloads, under their group's id",
        (
            "CREATE TABLE {s}.ledger (id bigint PRIMARY KEY, env_id bigint NOT NULL, group_id bytea, handler text, "
            "acked_at double precision NOT NULL, policy_step bigint NOT NULL, seqs bigint NOT NULL, "
            "tokens bigint NOT NULL, bytes bigint NOT NULL, score_mean double precision NOT NULL, "
            "score_min double precision NOT NULL, score_max double precision NOT NULL, "
            "score_std double precision NOT NULL, fate text NOT NULL, step bigint, reason text, "
            "decided_at double precision, kept boolean NOT NULL DEFAULT false)",
            "CREATE INDEX ledger_by_group_id ON {s}.ledger (group_id) WHERE group_id IS NOT NULL",
            "CREATE INDEX ledger_kept ON {s}.ledger (step, id) WHERE kept",
            "CREATE INDEX ledger_dropped ON {s}.ledger (step, id) WHERE fate = 'dropped'",  # the drop-bias monitor's
            "CREATE TABLE {s}.ledger_steps (step bigint PRIMARY KEY, formed_at double precision NOT NULL, "
            "formation_s double precision NOT NULL, group_ids bytea NOT NULL, seqs bigint NOT NULL, "
            "tokens bigint NOT NULL, groups_by_env text NOT NULL, seqs_by_env text NOT NULL, staleness text NOT NULL, "
            "committed_at double precision)",
        ),
    ),
    Step(
        "the ledger names the producer of each group (its heartbeat id, when the group carried one)",
        ("ALTER TABLE {s}.ledger ADD COLUMN producer_id text",),
    ),
    Step(
        "tasks leased to producers (docs/tasks.md): datasets with their cursors, their tasks, and a row per task "
        "handed out, with its fate",
        (
            "CREATE TABLE {s}.task_sets (name text PRIMARY KEY, record text NOT NULL)",
            "CREATE TABLE {s}.task_data (dataset text NOT NULL, idx bigint NOT NULL, data text NOT NULL, "
            "PRIMARY KEY (dataset, idx))",
            "CREATE TABLE {s}.tasks (dataset text NOT NULL, epoch bigint NOT NULL, idx bigint NOT NULL, "
            "state text NOT NULL, leases bigint NOT NULL, producer text, expires_at double precision, "
            "retries bigint NOT NULL, ledger_id bigint, step bigint, reason text, "
            "updated_at double precision NOT NULL, seq bigint NOT NULL, PRIMARY KEY (dataset, epoch, idx))",
            "CREATE INDEX tasks_front ON {s}.tasks (dataset, seq) WHERE state = 'waiting'",
            "CREATE INDEX tasks_leased ON {s}.tasks (dataset, expires_at) WHERE state = 'leased'",
            "CREATE INDEX tasks_by_ledger ON {s}.tasks (ledger_id) WHERE ledger_id IS NOT NULL",
        ),
    ),
    Step(
        "groups whose rollouts arrive one by one (docs/rollouts.md): the open groups, and each acknowledged slot",
        (
            "CREATE TABLE {s}.rollout_groups (key text PRIMARY KEY, env_id bigint NOT NULL, state text NOT NULL, "
            "deadline double precision NOT NULL, expires_at double precision NOT NULL, bytes bigint NOT NULL, "
            "record text NOT NULL)",
            "CREATE INDEX rollout_groups_due ON {s}.rollout_groups (deadline) WHERE state IN ('open', 'sealing')",
            "CREATE INDEX rollout_groups_lapsed ON {s}.rollout_groups (expires_at) WHERE state = 'open'",
            "CREATE INDEX rollout_groups_env ON {s}.rollout_groups (env_id) WHERE state IN ('open', 'sealing')",
            "CREATE TABLE {s}.rollout_slots (key text NOT NULL, slot bigint NOT NULL, producer text NOT NULL, "
            "digest text NOT NULL, data text NOT NULL, PRIMARY KEY (key, slot))",
        ),
    ),
    Step(
        "every resource records the key that owns it (docs/security.md): a task's lease its key and a random part "
        "of its token; a dataset made before owns to the one key that registered envs of its env's name (no key "
        "if none or several did), an open group to its env's key",
        (
            "ALTER TABLE {s}.tasks ADD COLUMN holder text",
            "ALTER TABLE {s}.tasks ADD COLUMN nonce text",
            "UPDATE {s}.task_sets t SET record = jsonb_set(t.record::jsonb, '{{owner}}', coalesce((SELECT CASE "
            "WHEN count(*) > 0 AND count(e.record::jsonb->>'owner') = count(*) AND count(DISTINCT "
            "e.record::jsonb->>'owner') = 1 THEN to_jsonb(min(e.record::jsonb->>'owner')) END FROM {s}.envs e "
            "WHERE e.name = t.record::jsonb->>'env'), 'null'::jsonb))::text",
            "UPDATE {s}.rollout_groups g SET record = jsonb_set(g.record::jsonb, '{{owner}}', coalesce((SELECT "
            "e.record::jsonb->'owner' FROM {s}.envs e WHERE e.env_id = g.env_id), 'null'::jsonb))::text",
        ),
    ),
    Step(
        "a task whose group is in a batch the trainer has not acknowledged is stored `served` (docs/tasks-fates.md), "
        "and turns `trained` when the batch is acknowledged: the rows stored `trained` in a step at or after the "
        "committed mark (the kept value's, else the run's step) become `served`, their datasets' tallies with them",
        (
            "UPDATE {s}.tasks SET state = 'served' WHERE state = 'trained' AND step >= coalesce((SELECT "
            "(value::jsonb->>'committed')::bigint FROM {s}.kv WHERE key = 'kept'), (SELECT value::bigint FROM {s}.kv "
            "WHERE key = 'step'))",
            "UPDATE {s}.task_sets t SET record = jsonb_set(jsonb_set(t.record::jsonb, '{{counts,trained}}', "
            "to_jsonb(coalesce((t.record::jsonb#>>'{{counts,trained}}')::bigint, 0) - c.n)), '{{counts,served}}', "
            "to_jsonb(c.n))::text FROM (SELECT dataset, count(*) AS n FROM {s}.tasks WHERE state = 'served' "
            "GROUP BY dataset) c WHERE c.dataset = t.name",
        ),
    ),
    Step(
        "a post writes its slot's row and moves its group's counters, never rewriting the group's record or reading "
        "another slot (docs/rollouts.md, Costs): a group counts its acknowledged slots and their tokens; a slot "
        "keeps its rollout packed as the seal concatenates it, with its tokens, score and policy_step beside it",
        (
            "ALTER TABLE {s}.rollout_groups ADD COLUMN done bigint NOT NULL DEFAULT 0",
            "ALTER TABLE {s}.rollout_groups ADD COLUMN tokens bigint NOT NULL DEFAULT 0",
            "ALTER TABLE {s}.rollout_slots ALTER COLUMN data TYPE bytea USING convert_to(data, 'UTF8')",
            "ALTER TABLE {s}.rollout_slots ADD COLUMN tokens bigint NOT NULL DEFAULT 0",
            "ALTER TABLE {s}.rollout_slots ADD COLUMN score double precision",
            "ALTER TABLE {s}.rollout_slots ADD COLUMN policy_step bigint",
            # Which slots are in and whose (views, leases, a post's reply) read this index, not the records.
            "CREATE INDEX rollout_slots_done ON {s}.rollout_slots (key, slot, producer)",
        ),
        lambda db: _packed_slots(db),
    ),
    Step(
        "a slot's turns, acknowledged as they end (docs/rollouts.md, Turns): what a sibling that takes the slot's "
        "lease continues from; freed with their group's decision",
        (
            "CREATE TABLE {s}.rollout_turns (key text NOT NULL, slot bigint NOT NULL, turn bigint NOT NULL, "
            "producer text NOT NULL, digest text NOT NULL, data bytea NOT NULL, bytes bigint NOT NULL, "
            "PRIMARY KEY (key, slot, turn))",
        ),
    ),
    Step(
        "a turn post reads its group's row and its slot's summary, never the slot's turns (docs/rollouts.md, "
        "Costs): each turn counts its tokens, each slot with turns has a summary row (turns, tokens, bytes, the "
        "optional fields they send), and each group counts its acknowledged turns' tokens (the trainer's token "
        "budget counts them when a turn is acknowledged)",
        (
            "ALTER TABLE {s}.rollout_turns ADD COLUMN tokens bigint NOT NULL DEFAULT 0",
            "ALTER TABLE {s}.rollout_groups ADD COLUMN turn_tokens bigint NOT NULL DEFAULT 0",
            "CREATE TABLE {s}.rollout_slot_turns (key text NOT NULL, slot bigint NOT NULL, turns bigint NOT NULL, "
            "tokens bigint NOT NULL, bytes bigint NOT NULL, fields bigint NOT NULL, PRIMARY KEY (key, slot))",
        ),
        lambda db: _turn_summaries(db),
    ),
    Step(
        "a sealed per-rollout group's ledger row says which of its slots were resumed from another producer's turns, "
        "and the tokens that saved (docs/ledger.md); rows written before read as null",
        ("ALTER TABLE {s}.ledger ADD COLUMN resumed text", "ALTER TABLE {s}.ledger ADD COLUMN tokens_saved bigint"),
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


def _packed_slots(db: _Schema) -> None:
    """Version 11: each acknowledged slot's JSON becomes its packed record (with its tokens, score and policy_step
    beside it), each group's record loses what its slots' rows say, and its counters count its slots."""
    c, s = db.conn, db.schema
    for key, slot, data in c.execute(sql.SQL("SELECT key, slot, data FROM {}.rollout_slots").format(s)).fetchall():
        packed, tokens, score, step = packed_slot(bytes(data).decode())
        c.execute(
            sql.SQL(
                "UPDATE {}.rollout_slots SET data = %b, tokens = %b, score = %b, policy_step = %b "
                "WHERE key = %b AND slot = %b"
            ).format(s),
            (packed, tokens, score, step, key, slot),
        )
    for key, record in c.execute(sql.SQL("SELECT key, record FROM {}.rollout_groups").format(s)).fetchall():
        c.execute(
            sql.SQL("UPDATE {}.rollout_groups SET record = %b WHERE key = %b").format(s), (lean_record(record), key)
        )
    counted = (
        "UPDATE {0}.rollout_groups g SET done = (SELECT count(*) FROM {0}.rollout_slots x WHERE x.key = g.key), "
        "tokens = (SELECT coalesce(sum(x.tokens), 0) FROM {0}.rollout_slots x WHERE x.key = g.key)"
    )
    c.execute(sql.SQL(counted).format(s))


def _turn_summaries(db: _Schema) -> None:
    """Version 13: each turn's tokens counted from its JSON, each slot's turns summed in its summary row, and each
    group's `turn_tokens` the tokens of its slots' turns not acknowledged whole."""
    c, s = db.conn, db.schema
    rows = c.execute(
        sql.SQL("SELECT key, slot, turn, data, bytes FROM {}.rollout_turns ORDER BY key, slot, turn").format(s)
    ).fetchall()
    for key, slot, turn, data, size in rows:
        tokens, fields = turn_counts(bytes(data))
        c.execute(
            sql.SQL("UPDATE {}.rollout_turns SET tokens = %b WHERE key = %b AND slot = %b AND turn = %b").format(s),
            (tokens, key, slot, turn),
        )
        c.execute(
            sql.SQL(
                "INSERT INTO {0}.rollout_slot_turns AS x (key, slot, turns, tokens, bytes, fields) "
                "VALUES (%b,%b,1,%b,%b,%b) ON CONFLICT (key, slot) DO UPDATE SET turns = x.turns + 1, "
                "tokens = x.tokens + excluded.tokens, bytes = x.bytes + excluded.bytes, "
                "fields = CASE WHEN x.fields = 0 THEN excluded.fields ELSE x.fields END"
            ).format(s),
            (key, slot, tokens, size, fields),
        )
    counted = (
        "UPDATE {0}.rollout_groups g SET turn_tokens = (SELECT coalesce(sum(t.tokens), 0) FROM "
        "{0}.rollout_slot_turns t WHERE t.key = g.key AND NOT EXISTS (SELECT 1 FROM {0}.rollout_slots x "
        "WHERE x.key = t.key AND x.slot = t.slot))"
    )
    c.execute(sql.SQL(counted).format(s))


class _Schema:
    """`migrations.Database` over a connection in a transaction that holds the store lock."""

    def __init__(self, conn: psycopg.Connection[Any], config: PostgresConfig) -> None:
        self.conn = conn
        self.name = config.schema
        self.schema = sql.Identifier(config.schema)
        self.where = f"schema {config.schema!r}"

    def tables(self) -> set[str]:
        rows = self.conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = %b", (self.name,))
        return {row[0] for row in rows}

    def version(self) -> int:
        query = sql.SQL("SELECT value FROM {}.meta WHERE key = 'schema_version'").format(self.schema)
        row = self.conn.execute(query).fetchone()
        if row is None:
            raise RuntimeError(f"{self.where}: its meta table holds no schema_version: not touching it")
        return int(row[0])

    def execute(self, statement: str) -> None:
        self.conn.execute(sql.SQL(statement).format(s=self.schema))

    def set_version(self, version: int) -> None:
        query = sql.SQL("UPDATE {}.meta SET value = %b WHERE key = 'schema_version'").format(self.schema)
        self.conn.execute(query, (version,))


def create_or_migrate(conn: psycopg.Connection[Any], config: PostgresConfig) -> int:
    """Create the schema's tables, or bring them to SCHEMA_VERSION, under the store lock (replicas starting
    together do it once); the version found (0: new)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%b)", (config.lock_key,))
        return migrate(_Schema(conn, config), STEPS, hint="; choose another with ?schema=")
