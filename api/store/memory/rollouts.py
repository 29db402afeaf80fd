"""The in-process backend's open groups (`OpenGroupTxn` over dicts), undone with the enclosing `MemoryTxn`."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import TYPE_CHECKING

from api.store.rollouts import LIVE, GroupRow, OpenGroupTxn, SlotRow, TurnKey, TurnRow, TurnSummary

if TYPE_CHECKING:
    from api.store.memory.state import Undo


class OpenGroupState:
    """Every open group, as one process holds them; `live` keeps the live ones' keys apart, so that sweeps cost
    what is open, not every group ever opened; `decided` keeps the decided ones' keys in the order they were
    decided, so that retention walks the oldest first."""

    def __init__(self) -> None:
        self.groups: dict[str, GroupRow] = {}
        self.live: set[str] = set()
        self.decided: dict[str, None] = {}
        self.slots: dict[str, dict[int, SlotRow]] = {}
        self.turns: dict[str, dict[tuple[int, int], TurnRow]] = {}
        self.summaries: dict[str, dict[int, TurnSummary]] = {}


class MemoryOpenGroupTxn(OpenGroupTxn):
    def __init__(self, state: OpenGroupState, undo: Undo) -> None:
        self._s = state
        self._undo = undo

    def get(self, key: str) -> GroupRow | None:
        return self._s.groups.get(key)

    def put(self, row: GroupRow) -> None:
        s = self._s
        old, was_live, was_decided = s.groups.get(row.key), row.key in s.live, row.key in s.decided
        s.groups[row.key] = row
        (s.live.add if row.state in LIVE else s.live.discard)(row.key)
        s.decided.pop(row.key, None)
        if row.state not in LIVE:
            s.decided[row.key] = None

        def undo() -> None:
            if old is None:
                s.groups.pop(row.key, None)
            else:
                s.groups[row.key] = old
            (s.live.add if was_live else s.live.discard)(row.key)
            s.decided.pop(row.key, None)
            if was_decided:
                s.decided[row.key] = None

        self._undo.append(undo)

    def _live(self) -> list[GroupRow]:
        return [self._s.groups[k] for k in self._s.live]

    def due(self, now: float, limit: int) -> list[GroupRow]:
        rows = [g for g in self._live() if g.state == "sealing" or g.deadline <= now]
        return sorted(rows, key=lambda g: g.deadline)[:limit]

    def lapsed(self, now: float, limit: int, envs: Collection[int] | None = None) -> list[GroupRow]:
        rows = [
            g for g in self._live() if g.state == "open" and g.expires_at <= now and (envs is None or g.env_id in envs)
        ]
        return sorted(rows, key=lambda g: g.expires_at)[:limit]

    def lapsed_since(self, after: tuple[float, str], now: float, limit: int) -> list[GroupRow]:
        rows = [g for g in self._live() if g.state == "open" and g.expires_at <= now and (g.expires_at, g.key) > after]
        return sorted(rows, key=lambda g: (g.expires_at, g.key))[:limit]

    def decided(self, before: float, limit: int) -> list[str]:
        out = []
        for i, key in enumerate(self._s.decided):
            if i >= limit:
                break
            if self._s.groups[key].expires_at <= before:
                out.append(key)
        return out

    def delete(self, keys: Collection[str]) -> None:
        s = self._s
        for key in keys:
            row, slots = s.groups.pop(key, None), s.slots.pop(key, None)
            if row is None:
                continue
            self.drop_turns(key)
            was_live, was_decided = key in s.live, key in s.decided
            s.live.discard(key)
            s.decided.pop(key, None)

            def undo(
                key: str = key,
                row: GroupRow = row,
                slots: dict[int, SlotRow] | None = slots,
                was_live: bool = was_live,
                was_decided: bool = was_decided,
            ) -> None:
                s.groups[key] = row
                if slots is not None:
                    s.slots[key] = slots
                if was_live:
                    s.live.add(key)
                if was_decided:
                    s.decided[key] = None

            self._undo.append(undo)

    def scan(self, after: str, limit: int) -> list[GroupRow]:
        keys = sorted(k for k in self._s.groups if k > after)[:limit]  # the export's pages, not a service path
        return [self._s.groups[k] for k in keys]

    def open_totals(self, env_id: int) -> tuple[int, int]:
        rows = [g for g in self._live() if g.env_id == env_id]
        return len(rows), sum(g.bytes for g in rows)

    def slots(self, key: str) -> list[SlotRow]:
        got = self._s.slots.get(key, {})
        return [got[i] for i in sorted(got)]

    def slot(self, key: str, slot: int) -> SlotRow | None:
        return self._s.slots.get(key, {}).get(slot)

    def done(self, key: str) -> dict[int, str]:
        got = self._s.slots.get(key, {})
        return {i: got[i].producer for i in sorted(got)}

    def add_slot(self, row: SlotRow, size: int) -> None:
        s = self._s
        got = s.slots.setdefault(row.key, {})
        if row.slot in got:
            return
        got[row.slot] = row
        group = s.groups.get(row.key)
        if group is not None:
            summary = s.summaries.get(row.key, {}).get(row.slot)
            s.groups[row.key] = replace(
                group,
                done=group.done + 1,
                tokens=group.tokens + row.tokens,
                bytes=group.bytes + size,
                turn_tokens=group.turn_tokens - (0 if summary is None else summary.tokens),
            )

        def undo() -> None:
            del got[row.slot]
            if group is not None:
                s.groups[row.key] = group

        self._undo.append(undo)

    def turns(self, key: str, slot: int) -> list[TurnRow]:
        got = self._s.turns.get(key, {})
        return [got[k] for k in sorted(k for k in got if k[0] == slot)]

    def turn_keys(self, key: str) -> list[TurnKey]:
        got = self._s.turns.get(key, {})
        return [TurnKey(t.slot, t.turn, t.producer, t.bytes, t.tokens) for _, t in sorted(got.items())]

    def turn(self, key: str, slot: int, turn: int) -> TurnRow | None:
        return self._s.turns.get(key, {}).get((slot, turn))

    def turn_summary(self, key: str, slot: int) -> TurnSummary | None:
        return self._s.summaries.get(key, {}).get(slot)

    def add_turn(self, row: TurnRow, fields: int) -> None:
        s = self._s
        got = s.turns.setdefault(row.key, {})
        at = (row.slot, row.turn)
        if at in got:
            return
        got[at] = row
        sums = s.summaries.setdefault(row.key, {})
        was = sums.get(row.slot)
        sums[row.slot] = (
            TurnSummary(1, row.tokens, row.bytes, fields)
            if was is None
            else TurnSummary(was.turns + 1, was.tokens + row.tokens, was.bytes + row.bytes, fields)
        )
        group = s.groups.get(row.key)
        if group is not None:
            s.groups[row.key] = replace(group, turn_tokens=group.turn_tokens + row.tokens)

        def undo() -> None:
            del got[at]
            if was is None:
                del sums[row.slot]
            else:
                sums[row.slot] = was
            if group is not None:
                s.groups[row.key] = group

        self._undo.append(undo)

    def drop_turns(self, key: str) -> None:
        s = self._s
        got, sums, group = s.turns.pop(key, None), s.summaries.pop(key, None), s.groups.get(key)
        if group is not None:
            s.groups[key] = replace(group, turn_tokens=0)

        def undo() -> None:
            if got is not None:
                s.turns[key] = got
            if sums is not None:
                s.summaries[key] = sums
            if group is not None:
                s.groups[key] = group

        self._undo.append(undo)
