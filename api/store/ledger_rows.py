"""How the SQL stores write the ledger's rows (`LedgerGroup`, `LedgerStep`) as columns and read them back: one
layout for SQLite and PostgreSQL, so both answer the contract alike. The group columns, their conversions and
the ledger table's definition are derived from `LedgerGroup`'s declaration (`GROUP_RECORD`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import orjson

from api.store.ledger_contract import GROUP_RECORD, Column, LedgerGroup, LedgerStep

_I64 = np.dtype("<i8")

Dialect = Literal["sqlite", "postgres"]

GROUP_COLUMNS = ", ".join(c.name for c in GROUP_RECORD)
STEP_COLUMNS = (
    "step, formed_at, formation_s, group_ids, seqs, tokens, groups_by_env, seqs_by_env, staleness, committed_at"
)


def gid_bytes(group_id: str | None) -> bytes | None:
    """A group id as stored: its UTF-8 bytes (a handler's id may hold NUL or a lone surrogate, which text
    columns refuse)."""
    return None if group_id is None else group_id.encode("utf-8", "surrogatepass")


def _gid_text(gid: Any) -> str | None:
    return None if gid is None else bytes(gid).decode("utf-8", "surrogatepass")


def slots_text(slots: tuple[int, ...] | None) -> str | None:
    """`LedgerGroup.resumed` as stored: a JSON list (a column of one scalar type on both backends)."""
    return None if slots is None else orjson.dumps(list(slots)).decode()


def _slots_of(text: Any) -> tuple[int, ...] | None:
    return None if text is None else tuple(int(s) for s in orjson.loads(text))


def _read(c: Column, k: int) -> str:
    """The expression that turns column k of a row into the field's value."""
    if c.name == "group_id":
        return f"_gid_text(row[{k}])"
    if c.name == "resumed":
        return f"_slots_of(row[{k}])"
    if c.name == "kept":
        return f"bool(row[{k}])"
    convert = {"INTEGER": "int", "REAL": "float"}.get(c.sqlite.split()[0])
    if convert is None:
        return f"row[{k}]"
    return f"None if row[{k}] is None else {convert}(row[{k}])" if c.nullable else f"{convert}(row[{k}])"


def _write(c: Column) -> str:
    """The expression that turns the field of row `r` into its column's value."""
    special = {"group_id": "gid_bytes(r.group_id)", "kept": "bool(r.kept)", "resumed": "slots_text(r.resumed)"}
    return special.get(c.name, f"r.{c.name}")


def _compiled() -> tuple[Callable[[LedgerGroup], tuple[Any, ...]], Callable[[Sequence[Any]], LedgerGroup]]:
    """`group_values` and `group_of`, written out from the declaration as plain expressions: they run once per
    row stored or read (the ingest path, the export's pages), where a loop over the columns would cost twice."""
    values = ", ".join(_write(c) for c in GROUP_RECORD)
    fields = ", ".join(f"{c.name}={_read(c, k)}" for k, c in enumerate(GROUP_RECORD))
    source = f"def group_values(r):\n    return ({values},)\ndef group_of(row):\n    return LedgerGroup({fields})\n"
    scope: dict[str, Any] = {
        "LedgerGroup": LedgerGroup,
        "gid_bytes": gid_bytes,
        "_gid_text": _gid_text,
        "slots_text": slots_text,
        "_slots_of": _slots_of,
    }
    exec(compile(source, "<ledger_rows>", "exec"), scope)  # noqa: S102 - our own text, from the declaration
    return scope["group_values"], scope["group_of"]


group_values, group_of = _compiled()
"""`group_values(r)`: the columns of GROUP_COLUMNS, in order; `group_of(row)`: a row read as GROUP_COLUMNS."""


def column_type(c: Column, dialect: Dialect) -> str:
    """The column's type alone (no constraints): `INTEGER`, `double precision`, ..."""
    decl = c.sqlite if dialect == "sqlite" else c.postgres
    for constraint in (" NOT NULL", " PRIMARY KEY", " DEFAULT"):
        decl = decl.split(constraint)[0]
    return decl


PG_ARRAYS = {"bigint": "int8", "double precision": "float8", "bytea": "bytea", "text": "text", "boolean": "bool"}
"""The array element type PostgreSQL's bulk insert (unnest) casts each column type's values to."""


def _table(dialect: Dialect) -> str:
    return "ledger" if dialect == "sqlite" else "{s}.ledger"


def _definition(c: Column, dialect: Dialect) -> str:
    return f"{c.name} {c.sqlite if dialect == 'sqlite' else c.postgres}"


def ledger_columns(dialect: Dialect) -> list[str]:
    """The group columns' definitions in the order the table holds them (by the change that added each)."""
    ordered = sorted(GROUP_RECORD, key=lambda c: c.added)  # stable: fields' order within one change
    return [_definition(c, dialect) for c in ordered]


def ledger_ddl(dialect: Dialect) -> str:
    """CREATE TABLE of the ledger as its first layout declared it (the columns of change 0)."""
    cols = ", ".join(_definition(c, dialect) for c in GROUP_RECORD if c.added == 0)
    return f"CREATE TABLE {_table(dialect)} ({cols})"


def ledger_added(dialect: Dialect, added: int) -> tuple[str, ...]:
    """The ALTER TABLE statements of change `added` (> 0): a migration step adding those columns."""
    return tuple(
        f"ALTER TABLE {_table(dialect)} ADD COLUMN {_definition(c, dialect)}" for c in GROUP_RECORD if c.added == added
    )


def step_values(r: LedgerStep) -> tuple[Any, ...]:
    """The columns of STEP_COLUMNS, in order (ids as int64 bytes, the dicts as JSON text)."""
    return (
        r.step,
        r.formed_at,
        r.formation_s,
        np.asarray(r.group_ids, dtype=_I64).tobytes(),
        r.seqs,
        r.tokens,
        orjson.dumps(r.groups_by_env).decode(),
        orjson.dumps(r.seqs_by_env).decode(),
        orjson.dumps({str(k): v for k, v in sorted(r.staleness.items())}).decode(),
        r.committed_at,
    )


def step_of(row: Sequence[Any]) -> LedgerStep:
    return LedgerStep(
        step=int(row[0]),
        formed_at=float(row[1]),
        formation_s=float(row[2]),
        group_ids=tuple(np.frombuffer(bytes(row[3]), _I64).tolist()),
        seqs=int(row[4]),
        tokens=int(row[5]),
        groups_by_env=orjson.loads(row[6]),
        seqs_by_env=orjson.loads(row[7]),
        staleness={int(k): int(v) for k, v in orjson.loads(row[8]).items()},
        committed_at=None if row[9] is None else float(row[9]),
    )
