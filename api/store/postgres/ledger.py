"""The PostgreSQL store's ledger (`txn.ledger`): the shared SQL ledger (api/store/sql/ledger.py) over the
group's write-back cache. Rows added, step rows and their commit marks wait in the cache for the COMMIT (the
ingest path and batch formation cost no round trip of their own for them); the shared reads lay the cache over
what is stored, and decisions on stored rows write through, under the function's savepoint."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import psycopg

from api.store import sql
from api.store.ledger_contract import LedgerGroup, LedgerStep
from api.store.postgres.cache import Pending
from api.store.sql.ledger import SqlLedger


class PostgresLedger(SqlLedger):
    def __init__(
        self,
        conn: psycopg.Connection[Any],
        pending: Pending,
        write: Callable[[str, Sequence[Any]], psycopg.Cursor[Any]],
        writable: Callable[[], None],
    ) -> None:
        super().__init__(pending)
        self._db = conn
        self._write_through = write
        """Runs a write under the function's savepoint (`PostgresTxn._write`)."""
        self._check = writable

    def _read(self, name: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        return self._db.execute(sql.postgres(name), params, binary=True).fetchall()

    def _read_ids(self, name: str, ids: list[int], params: Sequence[Any] = ()) -> list[Sequence[Any]]:
        return self._read(name, (*params, ids))

    def _write(self, name: str, params: Sequence[Any]) -> int:
        return self._write_through(sql.postgres(name), params).rowcount

    def _write_ids(self, name: str, ids: list[int], params: Sequence[Any] = ()) -> None:
        self._write(name, (*params, ids))

    def _write_many(self, name: str, rows: list[Sequence[Any]]) -> None:
        raise NotImplementedError("PostgreSQL writes rows in bulk with the COMMIT")  # every caller is overridden

    def _writable(self) -> None:
        self._check()

    # --- written with the COMMIT (api/store/postgres/cache.py `Group.commit`) ---
    def add(self, rows: Sequence[LedgerGroup]) -> None:
        self._writable()
        for r in rows:
            self._local.ledger[r.id] = r

    def put_step(self, row: LedgerStep) -> None:
        self._writable()
        self._local.steps[row.step] = row

    def committed(self, first: int, before: int, at: float) -> None:
        self._writable()
        p = self._local
        for step, row in p.steps.items():
            if first <= step < before and row.committed_at is None:
                p.steps[step] = replace(row, committed_at=at)
        p.committed.append((first, before, at))

    def keep_payloads(self, items: Sequence[tuple[int, bytes]]) -> None:
        self._writable()
        for item_id, payload in items:
            self._local.payloads[item_id] = payload
