-- The SQL stores' named queries: one text for SQLite and PostgreSQL (loaded by api/store/sql/__init__.py).
-- Written with `?` placeholders (PostgreSQL: binary `%b`), `= ANY(?)` for a list of ids (SQLite: `IN (?,...)`,
-- one placeholder per id), `{true}` / `{false}` for booleans (SQLite: 1 / 0, which its partial indexes match)
-- and `{group_columns}` / `{group_marks}` / `{step_columns}` for the ledger's columns (api/store/ledger_rows.py).

-- name: held_add
INSERT INTO held (item_id, env_id, seqs, tokens, policy_step, held_at, bytes, payload) VALUES (?, ?, ?, ?, ?, ?, ?, ?)

-- name: held_groups
SELECT item_id, seqs, tokens, policy_step, held_at, bytes FROM held WHERE env_id = ? ORDER BY item_id

-- name: ledger_add
INSERT INTO ledger ({group_columns}) VALUES ({group_marks})

-- name: ledger_decide
UPDATE ledger SET fate = ?, step = ?, reason = ?, decided_at = ?, kept = ? WHERE id = ANY(?)

-- name: ledger_requeue
UPDATE ledger SET id = ?, fate = ? WHERE id = ?

-- name: ledger_groups
SELECT {group_columns} FROM ledger WHERE id = ANY(?)

-- name: ledger_named
SELECT {group_columns} FROM ledger WHERE group_id = ? ORDER BY id

-- name: ledger_scan
SELECT {group_columns} FROM ledger WHERE id > ? ORDER BY id LIMIT ?

-- name: ledger_dropped
SELECT {group_columns} FROM ledger WHERE fate = 'dropped' AND step >= ? AND step <= ? ORDER BY step, id LIMIT ?

-- name: ledger_put_step
INSERT INTO ledger_steps ({step_columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (step) DO UPDATE SET
formed_at = excluded.formed_at, formation_s = excluded.formation_s, group_ids = excluded.group_ids,
seqs = excluded.seqs, tokens = excluded.tokens, groups_by_env = excluded.groups_by_env,
seqs_by_env = excluded.seqs_by_env, staleness = excluded.staleness, committed_at = excluded.committed_at

-- name: ledger_committed
UPDATE ledger_steps SET committed_at = ? WHERE step >= ? AND step < ? AND committed_at IS NULL

-- name: ledger_steps
SELECT {step_columns} FROM ledger_steps WHERE step >= ? AND step <= ? ORDER BY step

-- name: ledger_prune
DELETE FROM ledger WHERE id < ? AND fate IN ('served', 'dropped') AND kept = {false}

-- name: ledger_prune_steps
DELETE FROM ledger_steps WHERE step < ?

-- name: keep_payloads
INSERT INTO payloads (item_id, payload) VALUES (?, ?)

-- name: kept_payloads
SELECT item_id, payload FROM payloads WHERE item_id = ANY(?)

-- name: kept_oldest
SELECT id, coalesce(step, 0), bytes FROM ledger WHERE kept = {true} ORDER BY step, id LIMIT ?

-- name: prune_payloads
DELETE FROM payloads WHERE item_id = ANY(?)

-- name: prune_kept
UPDATE ledger SET kept = {false} WHERE id = ANY(?)
