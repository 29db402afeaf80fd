"""The memory store's transaction (`MemoryTxn`): the queues, values, replies, batches and envs, with the side
buffers (`MemoryHeld`) and the ledger (api/store/memory/ledger.py) beside it, all under one undo log."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence

from api.store.base import HeldGroup, HeldMeta, HeldTxn, ItemMeta, QueueCounts, QueuedItem, Txn
from api.store.memory.ledger import MemoryLedger
from api.store.memory.rollouts import MemoryOpenGroupTxn
from api.store.memory.state import State, Undo
from api.store.memory.tasks import MemoryTaskTxn


def _discard(_: object) -> None:
    return None


def _counts_of(item: QueuedItem) -> QueueCounts:
    return QueueCounts(1, item.n_groups, item.meta.seqs, item.meta.tokens, len(item.payload))


def _held_counts_of(group: HeldGroup) -> QueueCounts:
    return QueueCounts(1, 1, group.meta.seqs, group.meta.tokens, len(group.payload))


class MemoryHeld(HeldTxn):
    """The side buffers (`txn.held`): held groups by env, in item id order."""

    def __init__(self, state: State, undo: Undo) -> None:
        self._s = state
        self._undo = undo

    def add(self, env_id: int, group: HeldGroup) -> None:
        self._undo.restore(self._s.held, env_id)
        self._undo.restore(self._s.held_counts, env_id)
        held = dict(self._s.held.get(env_id, {}))  # a copy per transaction: the undo restores the old dict
        held[group.meta.item_id] = group
        self._s.held[env_id] = held
        self._s.held_counts[env_id] = self._s.held_counts.get(env_id, QueueCounts()) + _held_counts_of(group)

    def groups(self, env_id: int) -> list[HeldMeta]:
        return [HeldMeta(g.meta, g.held_at, len(g.payload)) for g in self._s.held.get(env_id, {}).values()]

    def release(self, env_id: int, item_ids: Iterable[int]) -> list[HeldGroup]:
        wanted = list(item_ids)
        held = self._s.held.get(env_id, {})
        if len(set(wanted)) != len(wanted) or any(i not in held for i in wanted):
            raise KeyError(f"groups {wanted} are not all held (once) for env {env_id}")
        if not wanted:
            return []
        self._undo.restore(self._s.held, env_id)
        self._undo.restore(self._s.held_counts, env_id)
        out = [held[i] for i in wanted]
        self._s.held[env_id] = {i: g for i, g in held.items() if i not in set(wanted)}
        gone = sum((_held_counts_of(g) for g in out), QueueCounts())
        self._s.held_counts[env_id] = self._s.held_counts[env_id] - gone
        return out

    def counts(self) -> dict[int, QueueCounts]:
        return {env: c for env, c in self._s.held_counts.items() if c.items}


class MemoryTxn(Txn):
    """Applies writes directly and keeps an undo log, replayed backwards if the transaction fails."""

    def __init__(self, state: State) -> None:
        self._s = state
        self._undo = Undo()
        self.held = MemoryHeld(state, self._undo)
        self.ledger = MemoryLedger(state, self._undo)
        self.tasks = MemoryTaskTxn(state.tasks, self._undo)
        self.rollouts = MemoryOpenGroupTxn(state.rollouts, self._undo)

    def rollback(self) -> None:
        self._undo.rollback()

    def get_value(self, key: str) -> str | None:
        return self._s.values.get(key)

    def set_value(self, key: str, value: str) -> None:
        self._undo.restore(self._s.values, key)
        self._s.values[key] = value

    def delete_value(self, key: str) -> None:
        if key in self._s.values:
            self._undo.restore(self._s.values, key)
            del self._s.values[key]

    def next_item_id(self) -> int:
        item_id = self._s.next_id
        self._s.next_id += 1  # ids are never reused, even after a rollback: harmless gaps
        return item_id

    def append(self, env_id: int, item: QueuedItem) -> None:
        queue = self._s.queues.setdefault(env_id, deque())
        self._undo.restore(self._s.counts, env_id)
        queue.append(item)
        self._s.counts[env_id] = self._s.counts.get(env_id, QueueCounts()) + _counts_of(item)
        self._undo.append(lambda: _discard(queue.pop()))

    def head(self, env_id: int) -> Iterator[ItemMeta]:
        return (item.meta for item in self._s.queues.get(env_id, ()))

    def pop(
        self, env_id: int, item_ids: Iterable[int], *, keep_for: int | None = None, retain: bool = False
    ) -> list[QueuedItem]:
        wanted = list(item_ids)
        if not wanted:
            return []
        queue = self._s.queues[env_id]
        position = {item_id: i for i, item_id in enumerate(wanted)}
        # Removed items sit near the head: scan only as far as the last one asked for.
        scanned: list[QueuedItem] = []
        found: list[QueuedItem | None] = [None] * len(wanted)
        remaining = len(wanted)
        while remaining:
            if not queue:
                queue.extendleft(reversed(scanned))  # leave the queue as it was
                raise KeyError(f"items {wanted} are not all queued for env {env_id}")
            item = queue.popleft()
            scanned.append(item)
            if item.meta.item_id in position:
                found[position[item.meta.item_id]] = item
                remaining -= 1
        kept = [item for item in scanned if item.meta.item_id not in position]
        queue.extendleft(reversed(kept))

        def undo() -> None:
            for _ in kept:
                queue.popleft()
            queue.extendleft(reversed(scanned))

        self._undo.append(undo)
        removed = [item for item in found if item is not None]
        if keep_for is not None or retain:
            where = self._s.kept if keep_for is not None else self._s.retained
            for item in removed:
                self._undo.restore(where, item.meta.item_id)
                where[item.meta.item_id] = item.payload
        self._undo.restore(self._s.counts, env_id)
        total = QueueCounts()
        for item in removed:
            total = total + _counts_of(item)
        self._s.counts[env_id] = self._s.counts[env_id] - total
        return removed

    def counts(self) -> dict[int, QueueCounts]:
        return dict(self._s.counts)

    def put_env(self, env_id: int, name: str, version: int, record: str) -> None:
        self._undo.restore(self._s.envs, env_id)
        self._s.envs[env_id] = (name, version, record)

    def envs_since(self, version: int) -> list[tuple[int, str]]:
        return sorted((env_id, rec) for env_id, (_, v, rec) in self._s.envs.items() if v > version)

    def count_named(self, name: str) -> int:
        return sum(1 for n, _, _ in self._s.envs.values() if n == name)

    def add_counts(self, kind: str, deltas: Mapping[str, int]) -> None:
        counters = self._s.counters.setdefault(kind, {})
        for name, n in deltas.items():
            self._undo.restore(counters, name)
            counters[name] = counters.get(name, 0) + n

    def get_counts(self, kind: str) -> dict[str, int]:
        return dict(self._s.counters.get(kind, {}))

    def get_reply(self, key: str) -> str | None:
        return self._s.replies.get(key)

    def put_reply(self, key: str, reply: str) -> None:
        self._undo.restore(self._s.replies, key)
        self._s.replies[key] = reply

    def put_batch(self, step: int, header: bytes, item_ids: Sequence[int]) -> None:
        missing = [i for i in item_ids if i not in self._s.kept]
        if missing:
            raise KeyError(f"items {missing} were not popped with keep_for={step}")
        self._undo.restore(self._s.batches, step)
        self._s.batches[step] = (header, list(item_ids))

    def get_batch(self, step: int) -> bytes | None:
        kept = self._s.batches.get(step)
        if kept is None:
            return None
        header, item_ids = kept
        return b"".join([header, *(self._s.kept[i] for i in item_ids)])

    def drop_batches_before(self, step: int, *, retain: bool = False) -> None:
        for old in [s for s in self._s.batches if s < step]:
            for item_id in self._s.batches[old][1]:
                self._undo.restore(self._s.kept, item_id)
                payload = self._s.kept.pop(item_id)
                if retain:
                    self._undo.restore(self._s.retained, item_id)
                    self._s.retained[item_id] = payload
            self._undo.restore(self._s.batches, old)
            del self._s.batches[old]

    def payloads_with(self, marker: bytes) -> Iterator[bytes]:
        s = self._s
        every = [
            *(item.payload for q in s.queues.values() for item in q),
            *(g.payload for held in s.held.values() for g in held.values()),
            *s.kept.values(),
            *s.retained.values(),
        ]  # references only: the payloads stay where they are
        return (p for p in every if marker in p)

    def clear(self) -> None:
        old = self._s.__dict__.copy()
        next_id = self._s.next_id
        self._s.__init__()  # type: ignore[misc]
        self._s.next_id = next_id
        self._undo.append(lambda: self._s.__dict__.update(old))
