"""The ledger's part of the store contract (docs/ledger.md): its records, declared once, and `LedgerTxn`, the
ledger and retained payloads as a transaction sees them (`txn.ledger`).

`LedgerGroup` is the one declaration of a group's row: each field carries its `Column` (SQL types on both
backends, its Arrow type in the export, whether GET /ledger copies it), and the column lists, the SQL backends'
conversions, the export's `groups` table and the reply's fields are derived from it (api/store/ledger_rows.py,
api/export/table.py, api/ledger/replies.py), so that a new column is one field here (and a migration step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

QUEUED = "queued"
HELD = "held"
"""In its env's side buffer (`side-buffered`)."""
SERVED = "served"
DROPPED = "dropped"
FATES = (QUEUED, HELD, SERVED, DROPPED)
"""A group's fate in the ledger: queued and held are open (they change), served and dropped are final."""

COLUMN = "rollbuf.column"
"""Key of a `LedgerGroup` field's `Column` in its dataclass metadata."""


@dataclass(frozen=True, slots=True)
class Column:
    """How one field of `LedgerGroup` is stored, exported and answered."""

    sqlite: str
    """Its SQLite column definition after the name (type and constraints), as the ledger table declares it."""
    postgres: str
    """Its PostgreSQL column definition after the name."""
    arrow: str | None
    """Its type in the export's `groups` table (api/export/table.py), copied under its name: int32, int64,
    float64, string, bool, int32 list or timestamp (seconds become UTC microseconds). None: the export derives
    columns of its own from it (`id` is `group`; `step` and `reason` split by fate)."""
    reply: str | None
    """GET /ledger's rows copy it as it is (api/ledger/replies.py), described so; None: the reply says it in its
    own way (`env_id` null for anonymous groups, `fate` one of FATES)."""
    added: int = 0
    """Which change of the ledger table added it: 0 with the table, then one per later migration step; a
    table's columns lie in this order (`ledger_rows.ledger_columns`). A column added later is optional in the
    reply, so that clients written before it still read replies."""
    name: str = ""
    """Filled in by `group_columns` from the field's name."""

    @property
    def nullable(self) -> bool:
        return "NOT NULL" not in self.sqlite and "PRIMARY KEY" not in self.sqlite


def _col(sqlite: str, postgres: str, arrow: str | None, reply: str | None, *, added: int = 0) -> dict[str, Any]:
    return {COLUMN: Column(sqlite, postgres, arrow, reply, added)}


_INT = ("INTEGER NOT NULL", "bigint NOT NULL")
_REAL = ("REAL NOT NULL", "double precision NOT NULL")


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerGroup:
    """The ledger's row for one acknowledged group (docs/ledger.md): written in the transaction that
    acknowledged it, and changed only in the transaction that decided its fate. Fields are in the order the
    export and the reply list them."""

    id: int = field(
        metadata=_col(
            "INTEGER PRIMARY KEY", "bigint PRIMARY KEY", None, "The ledger id (the item id the group is stored under)."
        )
    )
    """The item id the group is stored under (`next_item_id`): a group released from a side buffer is queued
    under a new id, and its row moves with it (`ledger.requeue`), so one group is always one row."""
    env_id: int = field(metadata=_col(*_INT, None, None))
    """ANON_ENV for groups posted with `env_id: null`."""
    group_id: str | None = field(metadata=_col("BLOB", "bytea", None, "The handler's group id, as sent."))
    """The handler's group id, as sent (stored as its UTF-8 bytes: `ledger_rows.gid_bytes`)."""
    handler: str | None = field(
        metadata=_col("TEXT", "text", "string", "The name of the API key that sent it; null without auth.")
    )
    """The API key that sent it (its name), when the service knows it: None without auth."""
    producer_id: str | None = field(
        default=None,
        metadata=_col(
            "TEXT",
            "text",
            "string",
            "The producer that made it (the group's `producer_id`: its heartbeat id), if it sent one.",
            added=1,
        ),
    )
    """The producer that made it (the group's `producer_id`, a rollbuf extension: its heartbeat id), if sent."""
    acked_at: float = field(metadata=_col(*_REAL, "timestamp", "Unix time it was acknowledged."))
    """Wall-clock seconds when it was acknowledged."""
    policy_step: int = field(
        metadata=_col(*_INT, "int64", "The trainer step whose weights generated it (stamped at ingest when not sent).")
    )
    seqs: int = field(metadata=_col(*_INT, "int32", "Its sequences."))
    tokens: int = field(metadata=_col(*_INT, "int64", "Its tokens, over all sequences."))
    bytes: int = field(metadata=_col(*_INT, "int64", "Its payload as stored: what retaining it costs."))
    """Payload bytes as stored (what keeping it costs)."""
    score_mean: float = field(metadata=_col(*_REAL, "float64", "Mean of its sequences' scores."))
    score_min: float = field(metadata=_col(*_REAL, "float64", "Lowest score."))
    score_max: float = field(metadata=_col(*_REAL, "float64", "Highest score."))
    score_std: float = field(metadata=_col(*_REAL, "float64", "Population standard deviation of the scores."))
    """Population standard deviation of its sequences' scores (0 for one sequence)."""
    fate: str = field(metadata=_col("TEXT NOT NULL", "text NOT NULL", "string", None))
    """One of FATES."""
    step: int | None = field(
        default=None,
        metadata=_col(
            "INTEGER",
            "bigint",
            None,
            "Served: the batch's step. Dropped: the step formed next when it was dropped. Else null.",
        ),
    )
    """Served: the batch's step. Dropped: the step to be formed next when it was dropped. Else None."""
    reason: str | None = field(
        default=None,
        metadata=_col(
            "TEXT",
            "text",
            None,
            "Dropped: why (`zero_variance`, `score_range`, `stale`, `side_buffer_expired`, "
            "`rollouts_...`: an open group that expired, `payload_lost`). Else null.",
        ),
    )
    """Dropped: why (a filter's name, `stale`, `side_buffer_expired`, `rollouts_<why>`, `payload_lost`). Else None."""
    decided_at: float | None = field(
        default=None, metadata=_col("REAL", "double precision", "timestamp", "Unix time it was served or dropped.")
    )
    """Wall-clock seconds of the served or dropped decision."""
    kept: bool = field(
        default=False,
        metadata=_col(
            "INTEGER NOT NULL DEFAULT 0",
            "boolean NOT NULL DEFAULT false",
            "bool",
            "Its payload is retained (`retain_steps`, `retain_bytes`).",
        ),
    )
    """Its payload is retained past its fate (retention): readable with `ledger.kept_payloads` until pruned."""
    resumed: tuple[int, ...] | None = field(
        default=None,
        metadata=_col(
            "TEXT",
            "text",
            "int32 list",
            "A sealed per-rollout group's slots (as numbered when posted) that were resumed from another "
            "producer's turns (docs/rollouts.md, Lineage); null for a group with none, or not sealed from "
            "per-rollout posts.",
            added=2,
        ),
    )
    """The slots of a sealed per-rollout group whose lease carried acknowledged turns to another producer (a resume),
    from the server's own lineage, never from the body: None for a group without one (a group posted whole, a group
    from before this column). Stored as JSON text (`ledger_rows`)."""
    tokens_saved: int | None = field(
        default=None,
        metadata=_col(
            "INTEGER",
            "bigint",
            "int64",
            "The tokens those resumes carried over (not generated again), over all of them; null when `resumed` is.",
            added=2,
        ),
    )
    """The tokens of acknowledged turns the resumes of `resumed` carried to the next producer, summed."""


def group_columns() -> tuple[Column, ...]:
    """`LedgerGroup`'s columns, in its fields' order, each with its name."""
    out = []
    for f in fields(LedgerGroup):
        c: Column = f.metadata[COLUMN]
        out.append(Column(c.sqlite, c.postgres, c.arrow, c.reply, c.added, f.name))
    return tuple(out)


GROUP_RECORD = group_columns()
"""The ledger's group columns: what every store, the export and the reply derive theirs from."""


@dataclass(frozen=True, slots=True)
class LedgerStep:
    """The ledger's row for one formed batch: written in the transaction that formed it."""

    step: int
    formed_at: float
    formation_s: float
    """Seconds batch formation took (inside the transaction)."""
    group_ids: tuple[int, ...]
    """Ledger ids (`LedgerGroup.id`) of its groups, in the order the batch holds them: any rank's share is
    `api.batches.sharding.rank_share` of the batch in this order (shares are cut on reads, not recorded:
    docs/ledger.md)."""
    seqs: int
    tokens: int
    groups_by_env: dict[str, int]
    """Groups per env name (`wandb_name`)."""
    seqs_by_env: dict[str, int]
    staleness: dict[int, int]
    """Groups by staleness (the step minus the group's policy step)."""
    committed_at: float | None = None
    """When the batch was acknowledged (commit, or asking for a later step); None while it is not."""


@dataclass(frozen=True, slots=True)
class KeptPayload:
    """A retained payload's place in the retention order (`ledger.kept_oldest`)."""

    id: int
    step: int
    bytes: int


class LedgerTxn(ABC):
    """The ledger (docs/ledger.md) inside one transaction (`txn.ledger`): one row per acknowledged group, one
    per formed batch, and the payloads retention keeps past their groups' fate.

    Every write lands in the same transaction as the decision it records: a row is never ahead of or behind the
    queue. Rows of ids that are absent (pruned) are skipped by every update, never an error."""

    @abstractmethod
    def add(self, rows: Sequence[LedgerGroup]) -> None:
        """Add rows for newly acknowledged groups (ids not in the ledger). Costs the rows."""

    @abstractmethod
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
        """Set these rows' fate, `step`, `reason`, `decided_at=at` and `kept`. Costs the rows (id lookups)."""

    @abstractmethod
    def requeue(self, old_id: int, new_id: int) -> None:
        """A held group released into its queue under `new_id`: its row moves to that id, fate QUEUED."""

    @abstractmethod
    def groups(self, ids: Iterable[int]) -> list[LedgerGroup]:
        """The rows of these ids that exist, in the order asked for."""

    @abstractmethod
    def named(self, group_id: str) -> list[LedgerGroup]:
        """Rows whose `group_id` is this one (one per env that used it, or more), by id. Costs those rows."""

    @abstractmethod
    def scan(self, after_id: int, limit: int) -> list[LedgerGroup]:
        """Up to `limit` rows with id above `after_id`, by id: page through the ledger (the export) at a cost of
        the page, not the ledger."""

    @abstractmethod
    def dropped(self, first_step: int, last_step: int, limit: int) -> list[LedgerGroup]:
        """Up to `limit` rows of dropped groups whose `step` is in [first_step, last_step], by step then id: what
        the drop-bias monitor compares with the groups trained. Costs the rows returned (an index on dropped
        rows only: the write cost lands on drops, not on every group)."""

    @abstractmethod
    def put_step(self, row: LedgerStep) -> None:
        """Write a formed batch's row (replacing one of the same step: a reset run forms step N again)."""

    @abstractmethod
    def committed(self, first: int, before: int, at: float) -> None:
        """Mark the step rows in [first, before) not marked yet as committed at `at`. Costs that range. The
        range never passes the last step put (a step is formed before it is acknowledged): PostgreSQL's
        write-back cache marks a step put later in the same write-back group, so the rule is the caller's."""

    @abstractmethod
    def steps(self, first: int, last: int) -> list[LedgerStep]:
        """Step rows in [first, last], by step."""

    @abstractmethod
    def prune(self, below_id: int, below_step: int) -> int:
        """Forget group rows with id below `below_id` whose fate is final (served, dropped) and whose payload is
        not retained (`kept`), and step rows below `below_step`; the group rows forgotten. Costs the rows below
        `below_id`, not the ledger."""

    # --- retained payloads (retention, docs/ledger.md): payloads of served and dropped groups, by ledger id ---
    @abstractmethod
    def keep_payloads(self, items: Sequence[tuple[int, bytes]]) -> None:
        """Retain payloads of groups that are not stored otherwise (dropped at ingest, expired when held)."""

    @abstractmethod
    def kept_payloads(self, ids: Iterable[int]) -> dict[int, bytes]:
        """The retained payloads of these ids (absent ones left out); also payloads of kept batches."""

    @abstractmethod
    def kept_oldest(self, limit: int) -> list[KeptPayload]:
        """Up to `limit` retained payloads, oldest step first (then id), from the rows marked `kept`: what
        retention prunes first. Costs the rows returned."""

    @abstractmethod
    def prune_payloads(self, ids: Sequence[int]) -> None:
        """Forget these retained payloads and unmark their rows' `kept`. The caller never names one that is
        queued or in a kept batch."""
