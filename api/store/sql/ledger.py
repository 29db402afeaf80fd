"""The ledger of the SQL stores (`LedgerTxn`), written once for SQLite and PostgreSQL over the named queries of
queries.sql: a backend supplies how a query runs (`_read`, `_write`, with or without a list of ids).

Rows a backend holds in memory until its COMMIT (PostgreSQL's write-back cache: `Local`) are laid over the
stored ones by every read here, once for all reads; a backend that writes through (SQLite) holds none, and the
same reads return what is stored.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from api.store.ledger_contract import DROPPED, QUEUED, KeptPayload, LedgerGroup, LedgerStep, LedgerTxn
from api.store.ledger_rows import gid_bytes, group_of, group_values, step_of, step_values


class Local(Protocol):
    """What a transaction wrote that is not stored yet (api/store/postgres/cache.py `Pending`)."""

    ledger: dict[int, LedgerGroup]
    steps: dict[int, LedgerStep]
    committed: list[tuple[int, int, float]]
    payloads: dict[int, bytes]


@dataclass(slots=True)
class Nothing:
    """The `Local` of a backend that writes through: always empty."""

    ledger: dict[int, LedgerGroup] = field(default_factory=dict)
    steps: dict[int, LedgerStep] = field(default_factory=dict)
    committed: list[tuple[int, int, float]] = field(default_factory=list)
    payloads: dict[int, bytes] = field(default_factory=dict)


class SqlLedger(LedgerTxn):
    """Writes go through to the database (`add`, `put_step`, `committed` and `keep_payloads` are what a
    write-back backend overrides); reads lay `local` over what is stored."""

    def __init__(self, local: Local) -> None:
        self._local = local

    # --- how the backend runs a named query ---
    @abstractmethod
    def _read(self, name: str, params: Sequence[Any]) -> list[Sequence[Any]]: ...

    @abstractmethod
    def _read_ids(self, name: str, ids: list[int], params: Sequence[Any] = ()) -> list[Sequence[Any]]:
        """Run a query whose last parameter is a list of ids (`= ANY(?)`), after `params`."""

    @abstractmethod
    def _write(self, name: str, params: Sequence[Any]) -> int:
        """Run a write; the rows it changed."""

    @abstractmethod
    def _write_ids(self, name: str, ids: list[int], params: Sequence[Any] = ()) -> None: ...

    @abstractmethod
    def _write_many(self, name: str, rows: list[Sequence[Any]]) -> None: ...

    def _writable(self) -> None:
        """Raise if this transaction may not write (PostgreSQL's `Store.read`)."""

    def _before_payloads(self) -> None:
        """Write what reading or adding retained payloads must follow (SQLite's batched appends)."""

    # --- written through ---
    def add(self, rows: Sequence[LedgerGroup]) -> None:
        if rows:
            self._write_many("ledger_add", [group_values(r) for r in rows])

    def put_step(self, row: LedgerStep) -> None:
        self._write("ledger_put_step", step_values(row))

    def committed(self, first: int, before: int, at: float) -> None:
        self._write("ledger_committed", (at, first, before))

    def keep_payloads(self, items: Sequence[tuple[int, bytes]]) -> None:
        if items:
            self._before_payloads()
            self._write_many("keep_payloads", list(items))

    # --- written to the rows held in memory, else to the database ---
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
        self._writable()
        local = self._local.ledger
        stored = []
        for i in ids:
            row = local.get(i)
            if row is None:
                stored.append(i)
            else:
                local[i] = replace(row, fate=fate, step=step, reason=reason, decided_at=at, kept=kept)
        if stored:
            self._write_ids("ledger_decide", stored, (fate, step, reason, at, kept))

    def requeue(self, old_id: int, new_id: int) -> None:
        self._writable()
        row = self._local.ledger.pop(old_id, None)
        if row is not None:
            self._local.ledger[new_id] = replace(row, id=new_id, fate=QUEUED)
        else:
            self._write("ledger_requeue", (new_id, QUEUED, old_id))

    def prune(self, below_id: int, below_step: int) -> int:
        gone = self._write("ledger_prune", (below_id,))
        self._write("ledger_prune_steps", (below_step,))
        steps = self._local.steps
        for step in [s for s in steps if s < below_step]:
            del steps[step]
        return gone

    def prune_payloads(self, ids: Sequence[int]) -> None:
        wanted = list(ids)
        if not wanted:
            return
        self._writable()
        local = self._local
        for i in wanted:
            local.payloads.pop(i, None)
            row = local.ledger.get(i)
            if row is not None:
                local.ledger[i] = replace(row, kept=False)
        self._write_ids("prune_payloads", wanted)
        self._write_ids("prune_kept", wanted)

    # --- read: what is stored, with the rows held in memory laid over it ---
    def groups(self, ids: Iterable[int]) -> list[LedgerGroup]:
        wanted = list(ids)
        local = self._local.ledger
        found = {i: local[i] for i in wanted if i in local}
        stored = [i for i in wanted if i not in found]
        if stored:
            found.update((r.id, r) for r in map(group_of, self._read_ids("ledger_groups", stored)))
        return [found[i] for i in wanted if i in found]

    def named(self, group_id: str) -> list[LedgerGroup]:
        rows = {r.id: r for r in map(group_of, self._read("ledger_named", (gid_bytes(group_id),)))}
        rows.update((r.id, r) for r in self._local.ledger.values() if r.group_id == group_id)
        return [rows[i] for i in sorted(rows)]

    def scan(self, after_id: int, limit: int) -> list[LedgerGroup]:
        rows = {r.id: r for r in map(group_of, self._read("ledger_scan", (after_id, limit)))}
        rows.update((r.id, r) for r in self._local.ledger.values() if r.id > after_id)
        return [rows[i] for i in sorted(rows)[:limit]]

    def dropped(self, first_step: int, last_step: int, limit: int) -> list[LedgerGroup]:
        stored = self._read("ledger_dropped", (first_step, last_step, limit))
        rows = {r.id: r for r in map(group_of, stored)}
        rows.update(self._local.ledger)  # rows written by this transaction, as they are now
        found = [(r.step, r.id, r) for r in rows.values() if r.fate == DROPPED and r.step is not None]
        return [r for step, _, r in sorted(found, key=lambda f: f[:2]) if first_step <= step <= last_step][:limit]

    def steps(self, first: int, last: int) -> list[LedgerStep]:
        rows = {r.step: r for r in map(step_of, self._read("ledger_steps", (first, last)))}
        marks = self._local.committed
        for step, row in rows.items():  # marks not written yet
            if row.committed_at is None:
                at = next((at for f, b, at in marks if f <= step < b), None)
                if at is not None:
                    rows[step] = replace(row, committed_at=at)
        rows.update((s, r) for s, r in self._local.steps.items() if first <= s <= last)
        return [rows[s] for s in sorted(rows)]

    def kept_payloads(self, ids: Iterable[int]) -> dict[int, bytes]:
        self._before_payloads()
        wanted = list(ids)
        local = self._local.payloads
        out = {i: local[i] for i in wanted if i in local}
        stored = [i for i in wanted if i not in out]
        if stored:
            out.update((int(i), bytes(p)) for i, p in self._read_ids("kept_payloads", stored))
        return out

    def kept_oldest(self, limit: int) -> list[KeptPayload]:
        out = {int(r[0]): KeptPayload(int(r[0]), int(r[1]), int(r[2])) for r in self._read("kept_oldest", (limit,))}
        out.update((r.id, KeptPayload(r.id, r.step or 0, r.bytes)) for r in self._local.ledger.values() if r.kept)
        return sorted(out.values(), key=lambda k: (k.step, k.id))[:limit]
