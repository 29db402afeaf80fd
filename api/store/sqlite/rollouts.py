"""The SQLite file's open groups (`OpenGroupTxn`): written through on the writer's connection, inside the
enclosing transaction. Each method is one indexed statement."""

from __future__ import annotations

import sqlite3
from collections.abc import Collection

from api.store.rollouts import GroupRow, OpenGroupTxn, SlotRow, TurnKey, TurnRow, TurnSummary

_G = "key, env_id, state, deadline, expires_at, bytes, record, done, tokens, turn_tokens"
_S = "key, slot, producer, digest, data, tokens, score, policy_step"
_T = "key, slot, turn, producer, digest, data, bytes, tokens"
_LIVE = "state IN ('open', 'sealing')"


class SqliteOpenGroupTxn(OpenGroupTxn):
    __slots__ = ("_db",)

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def get(self, key: str) -> GroupRow | None:
        row = self._db.execute(f"SELECT {_G} FROM rollout_groups WHERE key = ?", (key,)).fetchone()
        return None if row is None else GroupRow(*row)

    def put(self, row: GroupRow) -> None:
        self._db.execute(
            f"INSERT OR REPLACE INTO rollout_groups ({_G}) VALUES (?,?,?,?,?,?,?,?,?,?)",
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
        cur = self._db.execute(
            f"SELECT {_G} FROM rollout_groups WHERE {_LIVE} AND (deadline <= ? OR state = 'sealing') "
            "ORDER BY deadline LIMIT ?",
            (now, limit),
        )
        return [GroupRow(*r) for r in cur]

    def lapsed(self, now: float, limit: int, envs: Collection[int] | None = None) -> list[GroupRow]:
        only, ids = "", list(envs) if envs is not None else []
        if envs is not None:
            if not ids:
                return []
            only = f"AND env_id IN ({','.join('?' * len(ids))}) "
        cur = self._db.execute(
            f"SELECT {_G} FROM rollout_groups WHERE {_LIVE} AND state = 'open' AND expires_at <= ? {only}"
            "ORDER BY expires_at LIMIT ?",
            (now, *ids, limit),
        )
        return [GroupRow(*r) for r in cur]

    def lapsed_since(self, after: tuple[float, str], now: float, limit: int) -> list[GroupRow]:
        at, key = after
        cur = self._db.execute(
            f"SELECT {_G} FROM rollout_groups WHERE state = 'open' AND expires_at <= ? AND expires_at >= ? "
            "AND (expires_at > ? OR key > ?) ORDER BY expires_at, key LIMIT ?",
            (now, at, at, key, limit),
        )
        return [GroupRow(*r) for r in cur]

    def decided(self, before: float, limit: int) -> list[str]:
        # A row is replaced whole on each write (a new rowid, past the others): decided groups are never written
        # again, so rowid order is the order they were decided in, and live ones (rewritten as they change) are
        # the only rows the walk skips.
        cur = self._db.execute(
            "SELECT key, expires_at FROM rollout_groups WHERE state IN ('sealed', 'expired') ORDER BY rowid LIMIT ?",
            (limit,),
        )
        return [key for key, at in cur if at <= before]

    def delete(self, keys: Collection[str]) -> None:
        rows = [(k,) for k in keys]
        self._db.executemany("DELETE FROM rollout_groups WHERE key = ?", rows)
        self._db.executemany("DELETE FROM rollout_slots WHERE key = ?", rows)
        self._db.executemany("DELETE FROM rollout_turns WHERE key = ?", rows)
        self._db.executemany("DELETE FROM rollout_slot_turns WHERE key = ?", rows)

    def scan(self, after: str, limit: int) -> list[GroupRow]:
        cur = self._db.execute(f"SELECT {_G} FROM rollout_groups WHERE key > ? ORDER BY key LIMIT ?", (after, limit))
        return [GroupRow(*r) for r in cur]

    def open_totals(self, env_id: int) -> tuple[int, int]:
        n, size = self._db.execute(
            f"SELECT count(*), coalesce(sum(bytes), 0) FROM rollout_groups WHERE {_LIVE} AND env_id = ?", (env_id,)
        ).fetchone()
        return int(n), int(size)

    def slots(self, key: str) -> list[SlotRow]:
        cur = self._db.execute(f"SELECT {_S} FROM rollout_slots WHERE key = ? ORDER BY slot", (key,))
        return [SlotRow(*r) for r in cur]

    def slot(self, key: str, slot: int) -> SlotRow | None:
        row = self._db.execute(f"SELECT {_S} FROM rollout_slots WHERE key = ? AND slot = ?", (key, slot)).fetchone()
        return None if row is None else SlotRow(*row)

    def done(self, key: str) -> dict[int, str]:
        cur = self._db.execute("SELECT slot, producer FROM rollout_slots WHERE key = ? ORDER BY slot", (key,))
        return dict(cur.fetchall())

    def add_slot(self, row: SlotRow, size: int) -> None:
        added = self._db.execute(
            f"INSERT OR IGNORE INTO rollout_slots ({_S}) VALUES (?,?,?,?,?,?,?,?)",
            (row.key, row.slot, row.producer, row.digest, row.data, row.tokens, row.score, row.policy_step),
        ).rowcount
        if added:
            self._db.execute(
                "UPDATE rollout_groups SET done = done + 1, tokens = tokens + ?, bytes = bytes + ?, "
                "turn_tokens = turn_tokens - coalesce((SELECT tokens FROM rollout_slot_turns WHERE key = ? "
                "AND slot = ?), 0) WHERE key = ?",
                (row.tokens, size, row.key, row.slot, row.key),
            )

    def turns(self, key: str, slot: int) -> list[TurnRow]:
        cur = self._db.execute(f"SELECT {_T} FROM rollout_turns WHERE key = ? AND slot = ? ORDER BY turn", (key, slot))
        return [TurnRow(*r) for r in cur]

    def turn_keys(self, key: str) -> list[TurnKey]:
        cur = self._db.execute(
            "SELECT slot, turn, producer, bytes, tokens FROM rollout_turns WHERE key = ? ORDER BY slot, turn", (key,)
        )
        return [TurnKey(*r) for r in cur]

    def turn(self, key: str, slot: int, turn: int) -> TurnRow | None:
        row = self._db.execute(
            f"SELECT {_T} FROM rollout_turns WHERE key = ? AND slot = ? AND turn = ?", (key, slot, turn)
        ).fetchone()
        return None if row is None else TurnRow(*row)

    def turn_summary(self, key: str, slot: int) -> TurnSummary | None:
        row = self._db.execute(
            "SELECT turns, tokens, bytes, fields FROM rollout_slot_turns WHERE key = ? AND slot = ?", (key, slot)
        ).fetchone()
        return None if row is None else TurnSummary(*row)

    def add_turn(self, row: TurnRow, fields: int) -> None:
        added = self._db.execute(
            f"INSERT OR IGNORE INTO rollout_turns ({_T}) VALUES (?,?,?,?,?,?,?,?)",
            (row.key, row.slot, row.turn, row.producer, row.digest, row.data, row.bytes, row.tokens),
        ).rowcount
        if added:
            self._db.execute(
                "INSERT INTO rollout_slot_turns (key, slot, turns, tokens, bytes, fields) VALUES (?,?,1,?,?,?) "
                "ON CONFLICT (key, slot) DO UPDATE SET turns = turns + 1, tokens = tokens + excluded.tokens, "
                "bytes = bytes + excluded.bytes, fields = excluded.fields",
                (row.key, row.slot, row.tokens, row.bytes, fields),
            )
            self._db.execute(
                "UPDATE rollout_groups SET turn_tokens = turn_tokens + ? WHERE key = ?", (row.tokens, row.key)
            )

    def drop_turns(self, key: str) -> None:
        self._db.execute("DELETE FROM rollout_turns WHERE key = ?", (key,))
        self._db.execute("DELETE FROM rollout_slot_turns WHERE key = ?", (key,))
        self._db.execute("UPDATE rollout_groups SET turn_tokens = 0 WHERE key = ?", (key,))
