"""The SQLite store's ledger (`txn.ledger`): the shared SQL ledger (api/store/sql/ledger.py), written through
on the transaction's connection. Lists of ids go in chunks of POP_CHUNK placeholders."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

from api.store import sql
from api.store.sql.ledger import Nothing, SqlLedger

POP_CHUNK = 500
"""Ids per statement: stays under SQLite's host-parameter limit on any build."""


def chunks(ids: list[int]) -> list[list[int]]:
    return [ids[i : i + POP_CHUNK] for i in range(0, len(ids), POP_CHUNK)]


class SqliteLedger(SqlLedger):
    def __init__(
        self, db: sqlite3.Connection, flush: Callable[[], None], defer: Callable[[str, list[Sequence[Any]]], None]
    ) -> None:
        super().__init__(Nothing())
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
