"""The writes a group's COMMIT sends (api/store/postgres/cache.py), as one statement: a data-modifying WITH
query, one table per part. One statement costs the client about a third of what the same writes cost as
statements of their own in a pipeline (each is sent, synced and read back by psycopg in Python: 0.13 against
0.37 ms of CPU per ingest transaction), and the server plans and runs it as one. A table written by one row
(the ingest path's) takes scalar parameters, not one-element arrays: psycopg dumps arrays in Python, and a
19-array unnest costs the server more than the row's insert."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from api.store.ledger_contract import GROUP_RECORD
from api.store.ledger_rows import PG_ARRAYS, column_type


@dataclass(frozen=True, slots=True)
class Insert:
    """An INSERT of rows into one table, as two statements: for one row (scalar parameters) and for more
    (one array per column, unnested)."""

    one: str
    many: str

    @classmethod
    def of(cls, table: str, columns: Sequence[tuple[str, str]], tail: str = "") -> Insert:
        """`columns`: (name, element type) pairs; `tail`: what follows the rows (ON CONFLICT ...)."""
        names = ", ".join(name for name, _ in columns)
        one = ", ".join(f"%b::{kind}" for _, kind in columns)
        many = ", ".join(f"%b::{kind}[]" for _, kind in columns)
        return cls(
            f"INSERT INTO {table} ({names}) VALUES ({one}){tail}",
            f"INSERT INTO {table} ({names}) SELECT * FROM unnest({many}){tail}",
        )


def _i8(*names: str) -> list[tuple[str, str]]:
    return [(name, "int8") for name in names]


def _upsert(key: str, columns: Sequence[str], add_to: str = "") -> str:
    """ON CONFLICT: the row's columns replaced, or (`add_to`: the table) added to."""
    sets = ", ".join(f"{c} = {f'{add_to}.{c} + ' if add_to else ''}excluded.{c}" for c in columns)
    return f" ON CONFLICT ({key}) DO UPDATE SET {sets}"


QUEUE = Insert.of("queue", _i8("item_id", "env_id", "seqs", "tokens", "policy_step", "n_groups"))
PAYLOADS = Insert.of("payloads", [("item_id", "int8"), ("payload", "bytea")])
REPLIES = Insert.of(
    "replies", [("key", "text"), ("reply", "text"), ("created", "float8")], _upsert("key", ("reply", "created"))
)
_COUNTED = ("items", "groups", "seqs", "tokens", "bytes")
COUNTS = Insert.of("counts", _i8("env_id", *_COUNTED), _upsert("env_id", _COUNTED))
VALUES = Insert.of("kv", [("key", "text"), ("value", "text")], _upsert("key", ("value",)))
COUNTERS = Insert.of(
    "counters", [("kind", "text"), ("name", "text"), ("n", "int8")], _upsert("kind, name", ("n",), "counters")
)
LEDGER = Insert.of("ledger", [(c.name, PG_ARRAYS[column_type(c, "postgres")]) for c in GROUP_RECORD])
TASK_SETS = Insert.of("task_sets", [("name", "text"), ("record", "text")], _upsert("name", ("record",)))
_TASK_UPDATED = (
    "state",
    "leases",
    "producer",
    "expires_at",
    "retries",
    "ledger_id",
    "step",
    "reason",
    "updated_at",
    "seq",
    "holder",
    "nonce",
)
TASKS = Insert.of(
    "tasks",
    [
        ("dataset", "text"),
        ("epoch", "int8"),
        ("idx", "int8"),
        ("state", "text"),
        ("leases", "int8"),
        ("producer", "text"),
        ("expires_at", "float8"),
        ("retries", "int8"),
        ("ledger_id", "int8"),
        ("step", "int8"),
        ("reason", "text"),
        ("updated_at", "float8"),
        ("seq", "int8"),
        ("holder", "text"),
        ("nonce", "text"),
    ],
    _upsert("dataset, epoch, idx", _TASK_UPDATED),
)
NEXT_ID = "UPDATE meta SET value = %b::int8 WHERE key = 'next_item_id'"
NOTIFY = "SELECT pg_notify(%b, %b)"


@dataclass(slots=True)
class Writes:
    """Parts of the COMMIT's statement, each writing a table no other part writes: the parts of a WITH query
    run on one snapshot and do not see each other's rows, so no two may touch one table."""

    parts: list[str] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)

    def insert(self, insert: Insert, rows: Sequence[Sequence[Any]]) -> None:
        if len(rows) == 1:
            self.parts.append(insert.one)
            self.params.extend(rows[0])
        elif rows:
            self.parts.append(insert.many)
            self.params.extend(list(col) for col in zip(*rows, strict=True))

    def add(self, statement: str, params: Sequence[Any]) -> None:
        self.parts.append(statement)
        self.params.extend(params)

    def statement(self) -> str | None:
        """All the parts as one statement (the last one its primary query), None without any."""
        if not self.parts:
            return None
        *ctes, last = self.parts
        if not ctes:
            return last
        return "WITH " + ", ".join(f"w{i} AS ({part})" for i, part in enumerate(ctes)) + " " + last
