"""The SQLite store's ledger (`txn.ledger`): the shared SQL ledger (api/store/sql/ledger.py), written through
on the transaction's connection. Lists of ids go in chunks of POP_CHUNK placeholders. Retained payloads go
through the payload tier (api/store/sqlite/payloads.py), the shared SQL's `payload` column being only part of
a row here."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from api.store import sql
from api.store.sql.ledger import Nothing, SqlLedger
from api.store.sqlite.payloads import COLUMNS, INSERT, PayloadTier

POP_CHUNK = 500
"""Ids per statement: stays under SQLite's host-parameter limit on any build."""


def chunks(ids: list[int]) -> list[list[int]]:
    return [ids[i : i + POP_CHUNK] for i in range(0, len(ids), POP_CHUNK)]


class SqliteLedger(SqlLedger):
    def __init__(
        self,
        db: sqlite3.Connection,
        flush: Callable[[], None],
        defer: Callable[[str, list[Sequence[Any]]], None],
        payloads: PayloadTier,
    ) -> None:
        super().__init__(Nothing())
        self._payloads = payloads
        self._db = db
        self._flush = flush
        """Writes the transaction's waiting inserts (api/store/sqlite/deferred.py): every statement here but the
        insert of new rows reads or changes what they write."""
        self._defer = defer

    def _read(self, name: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        self._flush()
        return self._db.execute(sql.sqlite(name), params).fetchall()

    def _read_ids(self, name: str, ids: list[int], params: Sequence[Any] = ()) -> list[Sequence[Any]]:
        self._flush()
        out: list[Sequence[Any]] = []
        for chunk in chunks(ids):
            out += self._db.execute(sql.sqlite(name, len(chunk)), (*params, *chunk)).fetchall()
        return out

    def _write(self, name: str, params: Sequence[Any]) -> int:
        self._flush()
        return self._db.execute(sql.sqlite(name), params).rowcount

    def _write_ids(self, name: str, ids: list[int], params: Sequence[Any] = ()) -> None:
        self._flush()
        for chunk in chunks(ids):
            self._db.execute(sql.sqlite(name, len(chunk)), (*params, *chunk))

    def _write_many(self, name: str, rows: list[Sequence[Any]]) -> None:
        if name == "ledger_add":  # new rows only: they wait, merged with the other functions'
            self._defer(sql.sqlite(name), rows)
            return
        self._flush()
        self._db.executemany(sql.sqlite(name), rows)

    def _before_payloads(self) -> None:
        self._flush()

    def keep_payloads(self, items: Sequence[tuple[int, bytes]]) -> None:
        if items:
            self._flush()
            self._db.executemany(INSERT, [self._payloads.row(self._db, item_id, payload) for item_id, payload in items])

    def kept_payloads(self, ids: Iterable[int]) -> dict[int, bytes]:
        self._flush()
        wanted = list(ids)
        rows = []
        for chunk in chunks(wanted):
            marks = ",".join("?" * len(chunk))
            rows += self._db.execute(f"SELECT {COLUMNS} FROM payloads WHERE item_id IN ({marks})", chunk).fetchall()
        return self._payloads.resolve(rows)
