"""The memory store's ledger (`txn.ledger`): the reference twin of the SQL stores' (api/store/sql/ledger.py),
with indexes of its own so that each read costs what the contract says (rows by group id, dropped rows by step)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import replace

from api.store.ledger_contract import DROPPED, QUEUED, SERVED, KeptPayload, LedgerGroup, LedgerStep, LedgerTxn
from api.store.memory.state import State, Undo


def _ids(named: int | frozenset[int] | None) -> Iterable[int]:
    """The ledger ids `State.named` holds for a group id."""
    return () if named is None else (named,) if isinstance(named, int) else named


class MemoryLedger(LedgerTxn):
    def __init__(self, state: State, undo: Undo) -> None:
        self._s = state
        self._undo = undo

    def _name(self, group_id: str | None, add: int | None = None, remove: int | None = None) -> None:
        if group_id is None:
            return
        named = self._s.named
        self._undo.restore(named, group_id)
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
            self._undo.restore(self._s.kept_ids, item_id)
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
            self._undo.restore(index, row.step)
            ids = index.get(row.step, frozenset())
            ids = ids | {row.id} if adding else ids - {row.id}
            if ids:
                index[row.step] = ids
            else:
                index.pop(row.step, None)

    def add(self, rows: Sequence[LedgerGroup]) -> None:
        for row in rows:
            self._undo.restore(self._s.ledger, row.id)
            self._drop_index(self._s.ledger.get(row.id), row)
            self._s.ledger[row.id] = row
            self._name(row.group_id, add=row.id)
            self._order(row.id)
            self._keep(row.id, row.kept)

    def decide(
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
                self._undo.restore(ledger, i)
                ledger[i] = replace(row, fate=fate, step=step, reason=reason, decided_at=at, kept=kept)
                self._keep(i, kept)
                self._drop_index(row, ledger[i])

    def requeue(self, old_id: int, new_id: int) -> None:
        row = self._s.ledger.get(old_id)
        if row is None:
            return
        self._undo.restore(self._s.ledger, old_id)
        self._undo.restore(self._s.ledger, new_id)
        del self._s.ledger[old_id]
        self._s.ledger[new_id] = replace(row, id=new_id, fate=QUEUED)
        self._drop_index(row, None)
        self._name(row.group_id, add=new_id, remove=old_id)
        self._order(new_id)
        self._keep(old_id, False)
        self._keep(new_id, row.kept)

    def groups(self, ids: Iterable[int]) -> list[LedgerGroup]:
        return [row for i in ids if (row := self._s.ledger.get(i)) is not None]

    def named(self, group_id: str) -> list[LedgerGroup]:
        return [self._s.ledger[i] for i in sorted(_ids(self._s.named.get(group_id)))]

    def scan(self, after_id: int, limit: int) -> list[LedgerGroup]:
        ledger, order = self._s.ledger, self._s.order
        out: list[LedgerGroup] = []
        k = bisect.bisect_right(order, after_id)
        while k < len(order) and len(out) < limit:
            row = ledger.get(order[k])
            if row is not None and (not out or out[-1].id != row.id):
                out.append(row)
            k += 1
        return out

    def dropped(self, first_step: int, last_step: int, limit: int) -> list[LedgerGroup]:
        index = self._s.dropped
        steps = range(first_step, last_step + 1) if last_step - first_step < len(index) else sorted(index)
        out: list[LedgerGroup] = []
        for step in steps:
            if first_step <= step <= last_step:
                out += [self._s.ledger[i] for i in sorted(index.get(step, ()))]
            if len(out) >= limit:
                break
        return out[:limit]

    def put_step(self, row: LedgerStep) -> None:
        self._undo.restore(self._s.steps, row.step)
        self._s.steps[row.step] = row

    def committed(self, first: int, before: int, at: float) -> None:
        for step in range(first, before):
            row = self._s.steps.get(step)
            if row is not None and row.committed_at is None:
                self._undo.restore(self._s.steps, step)
                self._s.steps[step] = replace(row, committed_at=at)

    def steps(self, first: int, last: int) -> list[LedgerStep]:
        steps = self._s.steps
        if last - first < len(steps):
            return [steps[s] for s in range(first, last + 1) if s in steps]
        return [steps[s] for s in sorted(steps) if first <= s <= last]

    def prune(self, below_id: int, below_step: int) -> int:
        ledger, order = self._s.ledger, self._s.order
        end = bisect.bisect_left(order, below_id)
        gone = [
            i for i in order[:end] if (r := ledger.get(i)) is not None and r.fate in (SERVED, DROPPED) and not r.kept
        ]
        for i in gone:
            self._undo.restore(ledger, i)
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
            self._undo.restore(steps, step)
            del steps[step]
        return len(gone)

    # --- retained payloads ---
    def keep_payloads(self, items: Sequence[tuple[int, bytes]]) -> None:
        for item_id, payload in items:
            self._undo.restore(self._s.retained, item_id)
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
                self._undo.restore(self._s.retained, i)
                del self._s.retained[i]
            row = self._s.ledger.get(i)
            if row is not None and row.kept:
                self._undo.restore(self._s.ledger, i)
                self._s.ledger[i] = replace(row, kept=False)
            self._keep(i, False)
