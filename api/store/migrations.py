"""Schema versions of the SQL stores: ordered steps run at start, so that what an earlier release wrote keeps
opening after every change of layout.

Each SQL backend lists its steps (`STEPS` in its `schema` module): step n brings a layout of version n - 1 to
version n, and version 0 is an empty file or schema, so step 1 is the first layout itself. A new store runs
every step, one written by an earlier release the steps it lacks: one path, so a migrated store cannot drift
from a new one. Everything runs inside the transaction that opens the store (under the lock that orders its
writers), so a failed or interrupted migration leaves the old version whole, and the version reached is
stored with the data (`meta.schema_version`). A layout newer than the code is refused: this release would
misread it. Steps, once released, never change: a change of layout is a new step (docs/stores.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("rollbuf")


@dataclass(frozen=True, slots=True)
class Step:
    """The statements that bring a layout to the next version, and why that version exists."""

    why: str
    statements: tuple[str, ...]
    convert: Callable[[Any], None] | None = None
    """Run after the statements, with the backend's `Database`: moves data SQL cannot reshape (msgpack blobs
    into rows). It is written against that backend's own class, so it may use its connection."""


class Database(Protocol):
    """A backend's side of a migration, inside its open transaction."""

    @property
    def where(self) -> str:
        """The file or schema, as messages name it."""

    def tables(self) -> set[str]:
        """Every table there, rollbuf's or not."""

    def version(self) -> int:
        """The stored layout version (there is a `meta` table)."""

    def execute(self, statement: str) -> None: ...

    def set_version(self, version: int) -> None: ...


class SchemaRefused(RuntimeError):
    """A store this release must not open: a newer layout, or tables that are not rollbuf's."""


def migrate(db: Database, steps: Sequence[Step], *, hint: str = "") -> int:
    """Bring `db` to version `len(steps)`; return the version it had (0: it was empty). `hint` ends the
    message that refuses foreign tables (how to choose another place)."""
    tables = db.tables()
    if "meta" in tables:
        found = db.version()
    elif tables:
        raise SchemaRefused(
            f"{db.where} holds tables that are not rollbuf's ({', '.join(sorted(tables))}): not touching it{hint}"
        )
    else:
        found = 0
    latest = len(steps)
    if found > latest:
        raise SchemaRefused(
            f"{db.where} has layout version {found}, written by a newer rollbuf; this rollbuf reads up to {latest}"
        )
    for step in steps[found:]:
        for statement in step.statements:
            db.execute(statement)
        if step.convert is not None:
            step.convert(db)
    if found != latest:
        db.set_version(latest)
        if found:
            log.info("%s: layout migrated from version %d to %d", db.where, found, latest)
    return found
