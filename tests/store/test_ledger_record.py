"""The ledger's one declaration (`LedgerGroup`'s columns, api/store/ledger_contract.py) against everything derived
from it or written before it: the migration steps that built the ledger tables (unchanged, byte for byte), the
tables a store holds, the export's `groups` table and GET /ledger's rows."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from api.export.table import group_row, groups_schema
from api.ledger.replies import GROUP_FIELDS, LedgerGroupReply
from api.ledger.rules import Found, group_view
from api.store import postgres, sqlite
from api.store.ledger_contract import GROUP_RECORD, SERVED, LedgerGroup
from api.store.ledger_rows import GROUP_COLUMNS, column_type, ledger_added, ledger_columns, ledger_ddl
from api.store.migrations import Step
from tests import pg

ROW = LedgerGroup(
    id=7,
    env_id=1,
    group_id="g",
    handler="h",
    producer_id="p",
    acked_at=1.5,
    policy_step=2,
    seqs=4,
    tokens=40,
    bytes=400,
    score_mean=0.5,
    score_min=0.0,
    score_max=1.0,
    score_std=0.5,
    fate=SERVED,
    step=3,
    decided_at=2.5,
    kept=True,
    resumed=(1, 3),
    tokens_saved=12,
)


def _creating(steps: tuple[Step, ...], table: str) -> int:
    """The index of the step that created the ledger table."""
    return next(k for k, s in enumerate(steps) if any(t.startswith(f"CREATE TABLE {table} (") for t in s.statements))


@pytest.mark.parametrize(
    ("steps", "dialect", "table"),
    [
        (sqlite.schema.STEPS, "sqlite", "ledger"),
        (postgres.schema.STEPS, "postgres", "{s}.ledger"),
    ],
)
def test_the_released_ledger_steps_are_what_the_declaration_derives(
    steps: tuple[Step, ...], dialect: str, table: str
) -> None:
    """Released steps never change (api/store/migrations.py): the declaration says what they said, each later
    change of the table being a step of its own (`ledger_added`)."""
    first = _creating(steps, table)
    assert steps[first].statements[0] == ledger_ddl(dialect)  # type: ignore[arg-type]
    added = [s.statements for s in steps[first + 1 :] if any("ledger ADD COLUMN" in t for t in s.statements)]
    assert added == [ledger_added(dialect, n) for n in range(1, len(added) + 1)]  # type: ignore[arg-type]
    assert max(c.added for c in GROUP_RECORD) == len(added), "a column of a later change has no migration step"


def test_a_sqlite_stores_ledger_table_is_the_declared_one(tmp_path: Path) -> None:
    path = tmp_path / "fresh.db"
    asyncio.run(sqlite.SqliteStore(f"sqlite:///{path}").close())
    with sqlite3.connect(path) as db:
        (ddl,) = db.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'ledger'").fetchone()
        db.execute(f"SELECT {GROUP_COLUMNS} FROM ledger")
    assert ddl == f"CREATE TABLE ledger ({', '.join(ledger_columns('sqlite'))})"


@pytest.fixture
def dbname() -> Iterator[str]:
    with pg.database() as name:
        yield name


def test_a_postgres_stores_ledger_table_is_the_declared_one(dbname: str) -> None:
    asyncio.run(postgres.PostgresStore(pg.url_of(dbname, schema="fresh")).close())
    with psycopg.connect(pg.url_of(dbname), autocommit=True) as conn:
        got = conn.execute(
            "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
            "WHERE table_schema = 'fresh' AND table_name = 'ledger' ORDER BY ordinal_position"
        ).fetchall()
    ordered = sorted(GROUP_RECORD, key=lambda c: c.added)
    assert got == [(c.name, column_type(c, "postgres"), "YES" if c.nullable else "NO") for c in ordered]


def test_the_export_and_the_reply_carry_every_declared_column() -> None:
    schema = groups_schema()
    row = group_row(ROW, "math")
    assert set(row) == set(schema.names)
    pa.RecordBatch.from_pylist([row], schema=schema)  # every value fits its column
    for c in GROUP_RECORD:
        if c.arrow is not None:
            assert schema.field(c.name).nullable == c.nullable
            value = getattr(ROW, c.name)
            assert row[c.name] == (round(value * 1_000_000) if c.arrow == "timestamp" else value)
    view = group_view(ROW, Found([ROW], {1: "math"}, {3: True}, {}))
    assert list(view) == list(GROUP_FIELDS) == list(LedgerGroupReply.model_fields)
    LedgerGroupReply.model_validate(view)
    assert {c.name for c in GROUP_RECORD if c.reply is not None} <= set(GROUP_FIELDS)
    assert all(view[c.name] == getattr(ROW, c.name) for c in GROUP_RECORD if c.reply is not None)
    assert (view["env"], view["committed"], view["fate"]) == ("math", True, SERVED)
