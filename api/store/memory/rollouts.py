"""The in-process backend's open groups (`OpenGroupTxn` over dicts), undone with the enclosing `MemoryTxn`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from api.store.rollouts import LIVE, GroupRow, OpenGroupTxn, SlotRow

if TYPE_CHECKING:
    from api.store.memory.state import Undo


class OpenGroupState:
    """Every open group, as one process holds them; `live` keeps the live ones' keys apart, so that sweeps cost
    what is open, not every group ever opened."""

    def __init__(self) -> None:
        self.groups: dict[str, GroupRow] = {}
        self.live: set[str] = set()
        self.slots: dict[str, dict[int, SlotRow]] = {}


class MemoryOpenGroupTxn(OpenGroupTxn):
    def __init__(self, state: OpenGroupState, undo: Undo) -> None:
        self._s = state
        self._undo = undo

    def get(self, key: str) -> GroupRow | None:
        return self._s.groups.get(key)

    def put(self, row: GroupRow) -> None:
        s = self._s
        old, was_live = s.groups.get(row.key), row.key in s.live
        s.groups[row.key] = row
        (s.live.add if row.state in LIVE else s.live.discard)(row.key)

        def undo() -> None:
            if old is None:
                s.groups.pop(row.key, None)
            else:
                s.groups[row.key] = old
            (s.live.add if was_live else s.live.discard)(row.key)

        self._undo.append(undo)

    def _live(self) -> list[GroupRow]:
        return [self._s.groups[k] for k in self._s.live]

    def due(self, now: float, limit: int) -> list[GroupRow]:
        rows = [g for g in self._live() if g.state == "sealing" or g.deadline <= now]
        return sorted(rows, key=lambda g: g.deadline)[:limit]

    def lapsed(self, now: float, limit: int) -> list[GroupRow]:
        rows = [g for g in self._live() if g.state == "open" and g.expires_at <= now]
        return sorted(rows, key=lambda g: g.expires_at)[:limit]

    def scan(self, after: str, limit: int) -> list[GroupRow]:
        keys = sorted(k for k in self._s.groups if k > after)[:limit]  # the export's pages, not a service path
        return [self._s.groups[k] for k in keys]

    def open_totals(self, env_id: int) -> tuple[int, int]:
        rows = [g for g in self._live() if g.env_id == env_id]
        return len(rows), sum(g.bytes for g in rows)

    def slots(self, key: str) -> list[SlotRow]:
        got = self._s.slots.get(key, {})
        return [got[i] for i in sorted(got)]

    def put_slot(self, row: SlotRow) -> None:
        got = self._s.slots.setdefault(row.key, {})
        if row.slot in got:
            return
        got[row.slot] = row

        def undo() -> None:
            del got[row.slot]

        self._undo.append(undo)
