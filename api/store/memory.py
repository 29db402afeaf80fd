"""In-process backend: fast, and gone with the process. For tests and for runs that accept losing the queue."""

from __future__ import annotations

import asyncio
import bisect
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TypeVar, cast

from api.store.base import (
    DROPPED,
    QUEUED,
    SERVED,
    HeldGroup,
    HeldMeta,
    ItemMeta,
    KeptPayload,
    LedgerGroup,
    LedgerStep,
    QueueCounts,
    QueuedItem,
    Store,
    Txn,
)
from api.store.offload import LARGE

T = TypeVar("T")


def _discard(_: object) -> None:
    return None


def _counts_of(item: QueuedItem) -> QueueCounts:
    return QueueCounts(1, item.n_groups, item.meta.seqs, item.meta.tokens, len(item.payload))


def _ids(named: int | frozenset[int] | None) -> Iterable[int]:
    """The ledger ids `_State.named` holds for a group id."""
    return () if named is None else (named,) if isinstance(named, int) else named


def _held_counts_of(group: HeldGroup) -> QueueCounts:
    return QueueCounts(1, 1, group.meta.seqs, group.meta.tokens, len(group.payload))


class _State:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.queues: dict[int, deque[QueuedItem]] = {}
        self.counts: dict[int, QueueCounts] = {}
        self.held: dict[int, dict[int, HeldGroup]] = {}
        """Side buffers: held groups by env, then by item id (oldest first)."""
        self.held_counts: dict[int, QueueCounts] = {}
        self.replies: dict[str, str] = {}
        self.envs: dict[int, tuple[str, int, str]] = {}
        """(name, version, record) by env id."""
        self.counters: dict[str, dict[str, int]] = {}
        self.batches: dict[int, tuple[bytes, list[int]]] = {}
        self.kept: dict[int, bytes] = {}
        """Payloads of popped items that a kept batch refers to, by item id."""
        self.retained: dict[int, bytes] = {}
        """Retained payloads of served and dropped groups, by ledger id."""
        self.ledger: dict[int, LedgerGroup] = {}
        self.named: dict[str, int | frozenset[int]] = {}
        """Ledger ids by group id (`ledger_named` costs the rows it finds): one id as itself, more as a set."""
        self.order: list[int] = []
        """Ledger ids, ascending, including some no longer in the ledger (skipped, compacted by pruning): pages
        and prunes cost what they walk, not the ledger."""
        self.kept_ids: dict[int, None] = {}
        """Ledger ids whose payload is retained."""
        self.steps: dict[int, LedgerStep] = {}
        """Step rows, in the order they were formed."""
        self.dropped: dict[int, frozenset[int]] = {}
        """Ledger ids of dropped groups by their `step` (`ledger_dropped` costs the rows it finds)."""
        self.next_id = 1


class MemoryTxn(Txn):
    """Applies writes directly and keeps an undo log, replayed backwards if the transaction fails."""

    def __init__(self, state: _State) -> None:
        self._s = state
        self._undo: list[Callable[[], None]] = []

    def rollback(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _restore(self, mapping: dict, key: object) -> None:  # type: ignore[type-arg]
        if key in mapping:
            old = mapping[key]
            self._undo.append(lambda: mapping.__setitem__(key, old))
        else:
            self._undo.append(lambda: mapping.pop(key, None))

    def get_value(self, key: str) -> str | None:
        return self._s.values.get(key)

    def set_value(self, key: str, value: str) -> None:
        self._restore(self._s.values, key)
        self._s.values[key] = value

    def next_item_id(self) -> int:
        item_id = self._s.next_id
        self._s.next_id += 1  # ids are never reused, even after a rollback: harmless gaps
        return item_id

    def append(self, env_id: int, item: QueuedItem) -> None:
        queue = self._s.queues.setdefault(env_id, deque())
        self._restore(self._s.counts, env_id)
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
                self._restore(where, item.meta.item_id)
                where[item.meta.item_id] = item.payload
        self._restore(self._s.counts, env_id)
        total = QueueCounts()
        for item in removed:
            total = total + _counts_of(item)
        self._s.counts[env_id] = self._s.counts[env_id] - total
        return removed

    def counts(self) -> dict[int, QueueCounts]:
        return dict(self._s.counts)

    def hold(self, env_id: int, group: HeldGroup) -> None:
        self._restore(self._s.held, env_id)
        self._restore(self._s.held_counts, env_id)
        held = dict(self._s.held.get(env_id, {}))  # a copy per transaction: the undo restores the old dict
        held[group.meta.item_id] = group
        self._s.held[env_id] = held
        self._s.held_counts[env_id] = self._s.held_counts.get(env_id, QueueCounts()) + _held_counts_of(group)

    def held(self, env_id: int) -> list[HeldMeta]:
        return [HeldMeta(g.meta, g.held_at, len(g.payload)) for g in self._s.held.get(env_id, {}).values()]

    def release(self, env_id: int, item_ids: Iterable[int]) -> list[HeldGroup]:
        wanted = list(item_ids)
        held = self._s.held.get(env_id, {})
        if len(set(wanted)) != len(wanted) or any(i not in held for i in wanted):
            raise KeyError(f"groups {wanted} are not all held (once) for env {env_id}")
        if not wanted:
            return []
        self._restore(self._s.held, env_id)
        self._restore(self._s.held_counts, env_id)
        out = [held[i] for i in wanted]
        self._s.held[env_id] = {i: g for i, g in held.items() if i not in set(wanted)}
        gone = sum((_held_counts_of(g) for g in out), QueueCounts())
        self._s.held_counts[env_id] = self._s.held_counts[env_id] - gone
        return out

    def held_counts(self) -> dict[int, QueueCounts]:
        return {env: c for env, c in self._s.held_counts.items() if c.items}

    def put_env(self, env_id: int, name: str, version: int, record: str) -> None:
        self._restore(self._s.envs, env_id)
        self._s.envs[env_id] = (name, version, record)

    def envs_since(self, version: int) -> list[tuple[int, str]]:
        return sorted((env_id, rec) for env_id, (_, v, rec) in self._s.envs.items() if v > version)

    def count_named(self, name: str) -> int:
        return sum(1 for n, _, _ in self._s.envs.values() if n == name)

    def add_counts(self, kind: str, deltas: Mapping[str, int]) -> None:
        counters = self._s.counters.setdefault(kind, {})
        for name, n in deltas.items():
            self._restore(counters, name)
            counters[name] = counters.get(name, 0) + n

    def get_counts(self, kind: str) -> dict[str, int]:
        return dict(self._s.counters.get(kind, {}))

    def get_reply(self, key: str) -> str | None:
        return self._s.replies.get(key)

    def put_reply(self, key: str, reply: str) -> None:
        self._restore(self._s.replies, key)
        self._s.replies[key] = reply

    def put_batch(self, step: int, header: bytes, item_ids: Sequence[int]) -> None:
        missing = [i for i in item_ids if i not in self._s.kept]
        if missing:
            raise KeyError(f"items {missing} were not popped with keep_for={step}")
        self._restore(self._s.batches, step)
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
                self._restore(self._s.kept, item_id)
                payload = self._s.kept.pop(item_id)
                if retain:
                    self._restore(self._s.retained, item_id)
                    self._s.retained[item_id] = payload
            self._restore(self._s.batches, old)
            del self._s.batches[old]

    # --- the ledger ---
    def _name(self, group_id: str | None, add: int | None = None, remove: int | None = None) -> None:
        if group_id is None:
            return
        named = self._s.named
        self._restore(named, group_id)
        ids = set(_ids(named.get(group_id)))
        if remove is not None:
            ids.discard(remove)
        if add is not None:
            ids.add(add)
        if len(ids) > 1:
            named[group_id] = frozenset(ids)
        elif ids:
            named[group_id] = ids.pop()  # the usual one: an int, not a set of one (246 bytes a group, #35)
        else:
            named.pop(group_id, None)

    def _order(self, item_id: int) -> None:
        order = self._s.order  # not undone: an id whose row is gone is skipped
        if not order or order[-1] < item_id:
            order.append(item_id)
        else:
            bisect.insort(order, item_id)

    def _keep(self, item_id: int, kept: bool) -> None:
        if kept != (item_id in self._s.kept_ids):
            self._restore(self._s.kept_ids, item_id)
            if kept:
                self._s.kept_ids[item_id] = None
            else:
                del self._s.kept_ids[item_id]

    def _drop_index(self, old: LedgerGroup | None, new: LedgerGroup | None) -> None:
        """Keep `dropped` (ids of dropped rows by step) in step with a row that changes from `old` to `new`."""
        for row, adding in ((old, False), (new, True)):
            if row is None or row.fate != DROPPED or row.step is None:
                continue
            index = self._s.dropped
            self._restore(index, row.step)
            ids = index.get(row.step, frozenset())
            ids = ids | {row.id} if adding else ids - {row.id}
            if ids:
                index[row.step] = ids
            else:
                index.pop(row.step, None)

    def ledger_add(self, rows: Sequence[LedgerGroup]) -> None:
        for row in rows:
            self._restore(self._s.ledger, row.id)
            self._drop_index(self._s.ledger.get(row.id), row)
            self._s.ledger[row.id] = row
            self._name(row.group_id, add=row.id)
            self._order(row.id)
            self._keep(row.id, row.kept)

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
        ledger = self._s.ledger
        for i in ids:
            row = ledger.get(i)
            if row is not None:
                self._restore(ledger, i)
                ledger[i] = replace(row, fate=fate, step=step, reason=reason, decided_at=at, kept=kept)
                self._keep(i, kept)
                self._drop_index(row, ledger[i])

    def ledger_requeue(self, old_id: int, new_id: int) -> None:
        row = self._s.ledger.get(old_id)
        if row is None:
            return
        self._restore(self._s.ledger, old_id)
        self._restore(self._s.ledger, new_id)
        del self._s.ledger[old_id]
        self._s.ledger[new_id] = replace(row, id=new_id, fate=QUEUED)
        self._drop_index(row, None)
        self._name(row.group_id, add=new_id, remove=old_id)
        self._order(new_id)
        self._keep(old_id, False)
        self._keep(new_id, row.kept)

    def ledger_groups(self, ids: Iterable[int]) -> list[LedgerGroup]:
        return [row for i in ids if (row := self._s.ledger.get(i)) is not None]

    def ledger_named(self, group_id: str) -> list[LedgerGroup]:
        return [self._s.ledger[i] for i in sorted(_ids(self._s.named.get(group_id)))]

    def ledger_scan(self, after_id: int, limit: int) -> list[LedgerGroup]:
        ledger, order = self._s.ledger, self._s.order
        out: list[LedgerGroup] = []
        k = bisect.bisect_right(order, after_id)
        while k < len(order) and len(out) < limit:
            row = ledger.get(order[k])
            if row is not None and (not out or out[-1].id != row.id):
                out.append(row)
            k += 1
        return out

    def ledger_dropped(self, first_step: int, last_step: int, limit: int) -> list[LedgerGroup]:
        index = self._s.dropped
        steps = range(first_step, last_step + 1) if last_step - first_step < len(index) else sorted(index)
        out: list[LedgerGroup] = []
        for step in steps:
            if first_step <= step <= last_step:
                out += [self._s.ledger[i] for i in sorted(index.get(step, ()))]
            if len(out) >= limit:
                break
        return out[:limit]

    def ledger_put_step(self, row: LedgerStep) -> None:
        self._restore(self._s.steps, row.step)
        self._s.steps[row.step] = row

    def ledger_committed(self, first: int, before: int, at: float) -> None:
        for step in range(first, before):
            row = self._s.steps.get(step)
            if row is not None and row.committed_at is None:
                self._restore(self._s.steps, step)
                self._s.steps[step] = replace(row, committed_at=at)

    def ledger_steps(self, first: int, last: int) -> list[LedgerStep]:
        steps = self._s.steps
        if last - first < len(steps):
            return [steps[s] for s in range(first, last + 1) if s in steps]
        return [steps[s] for s in sorted(steps) if first <= s <= last]

    def ledger_prune(self, below_id: int, below_step: int) -> int:
        ledger, order = self._s.ledger, self._s.order
        end = bisect.bisect_left(order, below_id)
        gone = [
            i for i in order[:end] if (r := ledger.get(i)) is not None and r.fate in (SERVED, DROPPED) and not r.kept
        ]
        for i in gone:
            self._restore(ledger, i)
            row = ledger.pop(i)
            self._name(row.group_id, remove=i)
            self._drop_index(row, None)
        order[:end] = [i for i in order[:end] if i in ledger]  # the walk costs what is left below below_id

        def undo() -> None:
            for i in gone:
                bisect.insort(order, i)

        self._undo.append(undo)
        steps = self._s.steps
        old = []
        for step in steps:  # formed in order: the old ones come first
            if step >= below_step:
                break
            old.append(step)
        for step in old:
            self._restore(steps, step)
            del steps[step]
        return len(gone)

    # --- retained payloads ---
    def keep_payloads(self, items: Sequence[tuple[int, bytes]]) -> None:
        for item_id, payload in items:
            self._restore(self._s.retained, item_id)
            self._s.retained[item_id] = payload

    def kept_payloads(self, ids: Iterable[int]) -> dict[int, bytes]:
        out: dict[int, bytes] = {}
        for i in ids:
            payload = self._s.retained.get(i, self._s.kept.get(i))
            if payload is not None:
                out[i] = payload
        return out

    def kept_oldest(self, limit: int) -> list[KeptPayload]:
        ledger = self._s.ledger
        kept = sorted((ledger[i].step or 0, i, ledger[i].bytes) for i in self._s.kept_ids if i in ledger)
        return [KeptPayload(i, step, size) for step, i, size in kept[:limit]]

    def prune_payloads(self, ids: Sequence[int]) -> None:
        for i in ids:
            if i in self._s.retained:
                self._restore(self._s.retained, i)
                del self._s.retained[i]
            row = self._s.ledger.get(i)
            if row is not None and row.kept:
                self._restore(self._s.ledger, i)
                self._s.ledger[i] = replace(row, kept=False)
            self._keep(i, False)

    def clear(self) -> None:
        old = self._s.__dict__.copy()
        next_id = self._s.next_id
        self._s.__init__()  # type: ignore[misc]
        self._s.next_id = next_id
        self._undo.append(lambda: self._s.__dict__.update(old))


class MemoryStore(Store):
    """Transactions run to completion on the event loop without awaiting, so none interleave; a large one
    (`api.store.offload`) runs in a worker thread while the others wait for it, the loop free meanwhile."""

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._state = _State()
        self._large: asyncio.Future[object] | None = None
        """The large transaction running in a worker thread, if any."""

    async def transact(self, fn: Callable[[Txn], T], *, replies: Sequence[str] = ()) -> T:
        while self._large is not None:
            await asyncio.wait({self._large})  # neither cancels it nor raises its error
        if not LARGE.get():
            return self._run(fn)
        work: asyncio.Future[T] = asyncio.ensure_future(asyncio.to_thread(self._run, fn))
        self._large = cast("asyncio.Future[object]", work)
        work.add_done_callback(self._ended)  # first of its callbacks: those waiting see it gone when they wake
        return await asyncio.shield(work)  # a caller that gives up does not end it: it is done, or undone, whole

    def _ended(self, _: object) -> None:
        self._large = None

    def _run(self, fn: Callable[[Txn], T]) -> T:
        txn = MemoryTxn(self._state)
        try:
            return fn(txn)
        except BaseException:
            txn.rollback()
            raise
