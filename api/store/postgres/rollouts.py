"""The PostgreSQL store's open groups (`OpenGroupTxn`): written through to the database under the function's
savepoint, in the enclosing transaction (writers hold the store lock, so replicas never seal a group twice)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import psycopg

from api.store.rollouts import GroupRow, OpenGroupTxn, SlotRow, TurnKey, TurnRow, TurnSummary

_G = "key, env_id, state, deadline, expires_at, bytes, record, done, tokens, turn_tokens"
_S = "key, slot, producer, digest, data, tokens, score, policy_step"
_T = "key, slot, turn, producer, digest, data, bytes, tokens"
_LIVE = "state IN ('open', 'sealing')"
Write = Callable[[str, Sequence[Any]], psycopg.Cursor[Any]]


class PostgresOpenGroupTxn(OpenGroupTxn):
    def __init__(self, db: psycopg.Connection[Any], write: Write) -> None:
        self._db = db
        self._write = write

    def _read(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        return self._db.execute(query, params, binary=True).fetchall()

    def get(self, key: str) -> GroupRow | None:
        rows = self._read(f"SELECT {_G} FROM rollout_groups WHERE key = %b", (key,))
        return GroupRow(*rows[0]) if rows else None

    def put(self, row: GroupRow) -> None:
        self._write(
            f"INSERT INTO rollout_groups ({_G}) VALUES (%b,%b,%b,%b,%b,%b,%b,%b,%b,%b) ON CONFLICT (key) DO UPDATE "
            "SET env_id = excluded.env_id, state = excluded.state, deadline = excluded.deadline, "
            "expires_at = excluded.expires_at, bytes = excluded.bytes, record = excluded.record, "
            "done = excluded.done, tokens = excluded.tokens, turn_tokens = excluded.turn_tokens",
            (
                row.key,
                row.env_id,
                row.state,
                row.deadline,
                row.expires_at,
                row.bytes,
                row.record,
                row.done,
                row.tokens,
                row.turn_tokens,
            ),
        )

    def due(self, now: float, limit: int) -> list[GroupRow]:
        rows = self._read(
            f"SELECT {_G} FROM rollout_groups WHERE {_LIVE} AND (deadline <= %b OR state = 'sealing') "
            "ORDER BY deadline LIMIT %b",
            (now, limit),
        )
        return [GroupRow(*r) for r in rows]

    def lapsed(self, now: float, limit: int, envs: Collection[int] | None = None) -> list[GroupRow]:
        if envs is None:
            rows = self._read(
                f"SELECT {_G} FROM rollout_groups WHERE state = 'open' AND expires_at <= %b "
                "ORDER BY expires_at LIMIT %b",
                (now, limit),
            )
        else:
            rows = self._read(
                f"SELECT {_G} FROM rollout_groups WHERE state = 'open' AND expires_at <= %b AND env_id = ANY(%b) "
                "ORDER BY expires_at LIMIT %b",
                (now, list(envs), limit),
            )
        return [GroupRow(*r) for r in rows]

    def lapsed_since(self, after: tuple[float, str], now: float, limit: int) -> list[GroupRow]:
        at, key = after
        rows = self._read(
            f"SELECT {_G} FROM rollout_groups WHERE state = 'open' AND expires_at <= %b AND expires_at >= %b "
            "AND (expires_at > %b OR key > %b) ORDER BY expires_at, key LIMIT %b",
            (now, at, at, key, limit),
        )
        return [GroupRow(*r) for r in rows]

    def decided(self, before: float, limit: int) -> list[str]:
        # No index holds decided groups (schema v8): this scans the table, which retention keeps to what is
        # decided in `rollout_keep_s` (and the sweep asks at most every `PRUNE_EVERY_S`).
        rows = self._read(
            "SELECT key FROM rollout_groups WHERE state IN ('sealed', 'expired') AND expires_at <= %b LIMIT %b",
            (before, limit),
        )
        return [r[0] for r in rows]

    def delete(self, keys: Collection[str]) -> None:
        ids = list(keys)
        if ids:
            self._write("DELETE FROM rollout_groups WHERE key = ANY(%b)", (ids,))
            self._write("DELETE FROM rollout_slots WHERE key = ANY(%b)", (ids,))
            self._write("DELETE FROM rollout_turns WHERE key = ANY(%b)", (ids,))
            self._write("DELETE FROM rollout_slot_turns WHERE key = ANY(%b)", (ids,))

    def scan(self, after: str, limit: int) -> list[GroupRow]:
        rows = self._read(f"SELECT {_G} FROM rollout_groups WHERE key > %b ORDER BY key LIMIT %b", (after, limit))
        return [GroupRow(*r) for r in rows]

    def open_totals(self, env_id: int) -> tuple[int, int]:
        rows = self._read(
            f"SELECT count(*), coalesce(sum(bytes), 0) FROM rollout_groups WHERE {_LIVE} AND env_id = %b", (env_id,)
        )
        return int(rows[0][0]), int(rows[0][1])

    def slots(self, key: str) -> list[SlotRow]:
        rows = self._read(f"SELECT {_S} FROM rollout_slots WHERE key = %b ORDER BY slot", (key,))
        return [SlotRow(*r) for r in rows]

    def slot(self, key: str, slot: int) -> SlotRow | None:
        rows = self._read(f"SELECT {_S} FROM rollout_slots WHERE key = %b AND slot = %b", (key, slot))
        return SlotRow(*rows[0]) if rows else None

    def done(self, key: str) -> dict[int, str]:
        rows = self._read("SELECT slot, producer FROM rollout_slots WHERE key = %b ORDER BY slot", (key,))
        return {int(r[0]): r[1] for r in rows}

    def add_slot(self, row: SlotRow, size: int) -> None:
        # One statement: the slot's row, and its group's counters only if the slot was new.
        self._write(
            f"WITH added AS (INSERT INTO rollout_slots ({_S}) VALUES (%b,%b,%b,%b,%b,%b,%b,%b) "
            "ON CONFLICT (key, slot) DO NOTHING RETURNING key) "
            "UPDATE rollout_groups SET done = done + 1, tokens = tokens + %b, bytes = bytes + %b, "
            "turn_tokens = turn_tokens - coalesce((SELECT t.tokens FROM rollout_slot_turns t WHERE t.key = %b "
            "AND t.slot = %b), 0) WHERE key IN (SELECT key FROM added)",
            (
                row.key,
                row.slot,
                row.producer,
                row.digest,
                row.data,
                row.tokens,
                row.score,
                row.policy_step,
                row.tokens,
                size,
                row.key,
                row.slot,
            ),
        )

    def turns(self, key: str, slot: int) -> list[TurnRow]:
        rows = self._read(f"SELECT {_T} FROM rollout_turns WHERE key = %b AND slot = %b ORDER BY turn", (key, slot))
        return [TurnRow(*r) for r in rows]

    def turn_keys(self, key: str) -> list[TurnKey]:
        rows = self._read(
            "SELECT slot, turn, producer, bytes, tokens FROM rollout_turns WHERE key = %b ORDER BY slot, turn", (key,)
        )
        return [TurnKey(int(r[0]), int(r[1]), r[2], int(r[3]), int(r[4])) for r in rows]

    def turn(self, key: str, slot: int, turn: int) -> TurnRow | None:
        rows = self._read(
            f"SELECT {_T} FROM rollout_turns WHERE key = %b AND slot = %b AND turn = %b", (key, slot, turn)
        )
        return TurnRow(*rows[0]) if rows else None

    def turn_summary(self, key: str, slot: int) -> TurnSummary | None:
        rows = self._read(
            "SELECT turns, tokens, bytes, fields FROM rollout_slot_turns WHERE key = %b AND slot = %b", (key, slot)
        )
        return TurnSummary(*(int(x) for x in rows[0])) if rows else None

    def add_turn(self, row: TurnRow, fields: int) -> None:
        # One statement: the turn's row, and its slot's summary and group's counter only if the turn was new.
        self._write(
            f"WITH added AS (INSERT INTO rollout_turns ({_T}) VALUES (%b,%b,%b,%b,%b,%b,%b,%b) "
            "ON CONFLICT (key, slot, turn) DO NOTHING RETURNING key, slot, tokens, bytes), "
            "summed AS (INSERT INTO rollout_slot_turns (key, slot, turns, tokens, bytes, fields) "
            "SELECT key, slot, 1, tokens, bytes, %b FROM added ON CONFLICT (key, slot) DO UPDATE SET "
            "turns = rollout_slot_turns.turns + 1, tokens = rollout_slot_turns.tokens + excluded.tokens, "
            "bytes = rollout_slot_turns.bytes + excluded.bytes, fields = excluded.fields) "
            "UPDATE rollout_groups g SET turn_tokens = g.turn_tokens + a.tokens FROM added a WHERE g.key = a.key",
            (row.key, row.slot, row.turn, row.producer, row.digest, row.data, row.bytes, row.tokens, fields),
        )

    def drop_turns(self, key: str) -> None:
        self._write("DELETE FROM rollout_turns WHERE key = %b", (key,))
        self._write("DELETE FROM rollout_slot_turns WHERE key = %b", (key,))
        self._write("UPDATE rollout_groups SET turn_tokens = 0 WHERE key = %b", (key,))
