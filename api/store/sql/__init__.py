"""The SQL stores' named queries (queries.sql), loaded once and written out for each dialect: one text for both,
where only placeholders and the spelling of booleans differ between SQLite and PostgreSQL."""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from api.store.ledger_contract import GROUP_RECORD
from api.store.ledger_rows import GROUP_COLUMNS, STEP_COLUMNS

_LIST = "= ANY(?)"
"""A list of ids, as PostgreSQL binds it (one array); SQLite gets one placeholder per id."""


def _load() -> dict[str, str]:
    text = files(__package__).joinpath("queries.sql").read_text(encoding="utf-8")
    queries: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("-- name: "):
            lines = queries.setdefault(line.removeprefix("-- name: ").strip(), [])
        elif line.strip() and not line.startswith("--") and lines is not None:
            lines.append(line)
    return {name: "\n".join(body) for name, body in queries.items()}


_MARKS = ", ".join("?" * len(GROUP_RECORD))
QUERIES = _load()
"""The named queries, as written in queries.sql."""


def _fill(name: str, true: str, false: str) -> str:
    return QUERIES[name].format(
        group_columns=GROUP_COLUMNS, group_marks=_MARKS, step_columns=STEP_COLUMNS, true=true, false=false
    )


@cache
def sqlite(name: str, n: int = 0) -> str:
    """Query `name` for SQLite; `n`: how many ids its list (`= ANY(?)`) holds."""
    query = _fill(name, "1", "0")
    return query.replace(_LIST, f"IN ({','.join('?' * n)})") if _LIST in query else query


@cache
def postgres(name: str) -> str:
    """Query `name` for PostgreSQL (psycopg, binary parameters)."""
    return _fill(name, "true", "false").replace("%", "%%").replace("?", "%b")
