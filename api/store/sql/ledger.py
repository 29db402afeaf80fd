"""The ledger of the SQL stores (`LedgerTxn`), written once for SQLite and PostgreSQL over the named queries of
queries.sql: a backend supplies how a query runs (`_read`, `_write`, with or without a list of ids).

Rows a backend holds in memory until its COMMIT (PostgreSQL's write-back cache: `Local`) are laid over the
stored ones by every read here, through api/store/overlay.py as every table of that cache is; a backend that
writes through (SQLite) holds none, and the same reads return what is stored.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from api.store import overlay
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

    # --- read: what is stored, with the rows held in memory laid over it (api/store/overlay.py) ---
    def groups(self, ids: Iterable[int]) -> list[LedgerGroup]:
        wanted = list(ids)
        found = overlay.point(wanted, self._local.ledger, self._groups)
        return [found[i] for i in wanted if i in found]

    def _groups(self, ids: list[int]) -> list[tuple[int, LedgerGroup]]:
        return [(r.id, r) for r in map(group_of, self._read_ids("ledger_groups", ids))]

    def named(self, group_id: str) -> list[LedgerGroup]:
        stored = map(group_of, self._read("ledger_named", (gid_bytes(group_id),)))
        return overlay.lay(stored, self._local.ledger, _id, where=lambda r: r.group_id == group_id, order=_id)

    def scan(self, after_id: int, limit: int) -> list[LedgerGroup]:
        local = self._local.ledger
        stored = map(group_of, self._read("ledger_scan", (after_id, overlay.wanted(limit, local))))
        return overlay.lay(stored, local, _id, where=lambda r: r.id > after_id, order=_id, limit=limit)

    def dropped(self, first_step: int, last_step: int, limit: int) -> list[LedgerGroup]:
        local = self._local.ledger
        stored = map(group_of, self._read("ledger_dropped", (first_step, last_step, overlay.wanted(limit, local))))
        where = lambda r: r.fate == DROPPED and r.step is not None and first_step <= r.step <= last_step  # noqa: E731
        return overlay.lay(stored, local, _id, where=where, order=lambda r: (r.step, r.id), limit=limit)

    def steps(self, first: int, last: int) -> list[LedgerStep]:
        marks = self._local.committed

        def marked(row: LedgerStep) -> LedgerStep:
            """A stored step row with the commit marks not written yet."""
            if row.committed_at is None:
                at = next((at for f, b, at in marks if f <= row.step < b), None)
                if at is not None:
                    return replace(row, committed_at=at)
            return row

        stored = (marked(step_of(r)) for r in self._read("ledger_steps", (first, last)))
        return overlay.lay(stored, self._local.steps, _step, where=lambda r: first <= r.step <= last, order=_step)

    def kept_payloads(self, ids: Iterable[int]) -> dict[int, bytes]:
        self._before_payloads()
        return overlay.point(ids, self._local.payloads, self._kept_payloads)

    def _kept_payloads(self, ids: list[int]) -> list[tuple[int, bytes]]:
        return [(int(i), bytes(p)) for i, p in self._read_ids("kept_payloads", ids)]

    def kept_oldest(self, limit: int) -> list[KeptPayload]:
        local = {r.id: KeptPayload(r.id, r.step or 0, r.bytes) if r.kept else None for r in self._local.ledger.values()}
        stored = (
            KeptPayload(int(r[0]), int(r[1]), int(r[2]))
            for r in self._read("kept_oldest", (overlay.wanted(limit, local),))
        )
        return overlay.lay(stored, local, lambda k: k.id, order=lambda k: (k.step, k.id), limit=limit)


def _id(row: LedgerGroup) -> int:
    return row.id


def _step(row: LedgerStep) -> int:
    return row.step
