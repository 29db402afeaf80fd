"""Groups and ledger rows as Arrow record batches of bounded size: the export's pure conversion (no I/O).

One row per *sequence* in the `sequences` table, so that `datasets`, pandas, Polars and DuckDB read a run as
the trainer saw it: the group it came from, its env and policy step, its fate (trained in step N, or dropped
and why, or still queued), its tokens, masks, score and per-token floats. Token ids and masks are int32
lists holding the stored bytes unchanged; per-token floats are float64 lists, which hold every value exactly
whether the group stored it as float32 or float64 (docs/binary-format.md).

Record batches are cut at `max_rows` rows or `max_bytes` of array data, whichever comes first (a group is
never split: a batch exceeds `max_bytes` by at most one group), so that writing a run larger than memory
holds one row group at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from api.store.base import ANON_ENV, DROPPED, SERVED, LedgerGroup, LedgerStep
from api.store.ledger_contract import GROUP_RECORD
from api.wire.records import F64, FLOAT_FIELDS, I32, VERSIONS_FIELD, GroupRecord, json_default

ROW_GROUP_ROWS = 8192
"""Most sequences in one record batch (one Parquet row group)."""
ROW_GROUP_BYTES = 32 << 20
"""Most array bytes (tokens, masks, floats) in one record batch before it is cut: what the export holds in
memory at once, apart from one page of groups read from the store."""

TIMESTAMP = pa.timestamp("us", tz="UTC")


@dataclass(frozen=True, slots=True)
class Fate:
    """What the ledger says of one group, as each of its sequence rows carries it (`fate_of`)."""

    group: int
    """The ledger's id of the group (`LedgerGroup.id`, unique in the run): joins `sequences` to `groups`."""
    group_id: str | None
    """The handler's group id, if it sent one."""
    env: str
    env_id: int | None
    """None for groups posted with `env_id: null`, as on the wire."""
    policy_step: int
    fate: str
    """One of the ledger's FATES: served, dropped, queued, held."""
    trained_step: int | None = None
    """The step whose batch held it (fate `served`)."""
    drop_reason: str | None = None
    """Why it was dropped (fate `dropped`): a filter, the staleness bound or the side buffer's expiry."""
    dropped_step: int | None = None
    """The step to be formed next when it was dropped (fate `dropped`)."""
    acked_at: float | None = None
    """Wall-clock seconds when it was acknowledged."""


def fate_of(row: LedgerGroup, env: str) -> Fate:
    """The sequence rows' view of a ledger row (`env` its env's name)."""
    return Fate(
        group=row.id,
        group_id=row.group_id,
        env=env,
        env_id=None if row.env_id == ANON_ENV else row.env_id,
        policy_step=row.policy_step,
        fate=row.fate,
        trained_step=row.step if row.fate == SERVED else None,
        drop_reason=row.reason if row.fate == DROPPED else None,
        dropped_step=row.step if row.fate == DROPPED else None,
        acked_at=row.acked_at,
    )


def sequences_schema() -> pa.Schema:
    floats = [pa.field(name, pa.list_(pa.float64())) for name in FLOAT_FIELDS]
    return pa.schema(
        [
            pa.field("group", pa.int64(), nullable=False),
            pa.field("group_id", pa.string()),
            pa.field("env", pa.string(), nullable=False),
            pa.field("env_id", pa.int32()),
            pa.field("policy_step", pa.int64(), nullable=False),
            pa.field("fate", pa.string(), nullable=False),
            pa.field("trained_step", pa.int64()),
            pa.field("drop_reason", pa.string()),
            pa.field("dropped_step", pa.int64()),
            pa.field("acked_at", TIMESTAMP),
            pa.field("seq", pa.int32(), nullable=False),
            pa.field("length", pa.int32(), nullable=False),
            pa.field("tokens", pa.list_(pa.int32()), nullable=False),
            pa.field("masks", pa.list_(pa.int32()), nullable=False),
            pa.field("score", pa.float64(), nullable=False),
            *floats,
            pa.field(VERSIONS_FIELD, pa.list_(pa.int32())),
            pa.field("meta", pa.string()),
        ]
    )


def _micros(t: float | None) -> int | None:
    return None if t is None else round(t * 1_000_000)


@dataclass(slots=True)
class _Pending:
    fates: list[Fate] = field(default_factory=list)
    records: list[GroupRecord] = field(default_factory=list)
    metas: list[str | None] = field(default_factory=list)
    rows: int = 0
    size: int = 0


def meta_text(rec: GroupRecord) -> str | None:
    """The group's metadata (`images`, `messages`, ...) as the `meta` column holds it."""
    return orjson.dumps(rec.meta, default=json_default).decode() if rec.meta else None


def record_bytes(rec: GroupRecord, meta: str | None = None) -> int:
    """Bytes a group adds to a record batch: its arrays (float fields as float64), and its metadata's text,
    repeated on each of its sequence rows (1 MB of `images` in a group of 4 is 4 MB of the batch)."""
    ints = 2 + (rec.weight_versions is not None)
    arrays = rec.n_tokens * (ints * I32.itemsize + F64.itemsize * len(rec.floats)) + rec.seqs * 64
    return arrays + (len(meta) * rec.seqs if meta else 0)


class SequenceBatcher:
    """Collects groups and cuts them into record batches of the `sequences` table, bounded in rows and bytes."""

    def __init__(self, max_rows: int = ROW_GROUP_ROWS, max_bytes: int = ROW_GROUP_BYTES) -> None:
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.schema = sequences_schema()
        self._pending = _Pending()

    def add(self, fate: Fate, rec: GroupRecord) -> pa.RecordBatch | None:
        """Add one group's sequences; returns a record batch once the rows or bytes held reach the bound."""
        p = self._pending
        meta = meta_text(rec)
        p.fates.append(fate)
        p.records.append(rec)
        p.metas.append(meta)
        p.rows += rec.seqs
        p.size += record_bytes(rec, meta)
        if p.rows >= self.max_rows or p.size >= self.max_bytes:
            return self.flush()
        return None

    def flush(self) -> pa.RecordBatch | None:
        """The groups held so far as one record batch (None if none)."""
        p, self._pending = self._pending, _Pending()
        if not p.records:
            return None
        return sequences_batch(p.fates, p.records, self.schema, p.metas)


def _lists(values: Sequence[np.ndarray], lengths: np.ndarray, dtype: pa.DataType) -> pa.Array:
    """A list array whose row i is the next lengths[i] values (values concatenated, never copied per row)."""
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(values) if values else np.empty(0, I32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, dtype))


def _float_lists(records: Sequence[GroupRecord], name: str, lengths: np.ndarray, per_seq: np.ndarray) -> pa.Array:
    """A float field as float64 lists; null (and empty) for the sequences of groups that did not send it."""
    sent = np.fromiter((name in r.floats for r in records), np.bool_, count=len(records))
    present = np.repeat(sent, per_seq)
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(np.where(present, lengths, 0), out=offsets[1:])
    values = [r.floats[name].astype(F64, copy=False) for r in records if name in r.floats]
    flat = np.concatenate(values) if values else np.empty(0, F64)
    mask = None if sent.all() else pa.array(~present)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.float64()), mask=mask)


def _version_lists(records: Sequence[GroupRecord], lengths: np.ndarray, per_seq: np.ndarray) -> pa.Array:
    """The per-token weight versions as int32 lists; null for the sequences of groups sent without them."""
    sent = np.fromiter((r.weight_versions is not None for r in records), np.bool_, count=len(records))
    present = np.repeat(sent, per_seq)
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(np.where(present, lengths, 0), out=offsets[1:])
    values = [r.weight_versions for r in records if r.weight_versions is not None]
    flat = np.concatenate(values) if values else np.empty(0, I32)
    mask = None if sent.all() else pa.array(~present)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.int32()), mask=mask)


_SCALARS = (
    "group",
    "group_id",
    "env",
    "env_id",
    "policy_step",
    "fate",
    "trained_step",
    "drop_reason",
    "dropped_step",
    "acked_at",
    "meta",
)
"""Columns that hold one value per group, repeated for each of its sequences."""
_PER_SEQ = ("seq", "length", "score", "tokens", "masks", *FLOAT_FIELDS, VERSIONS_FIELD)


def sequences_batch(
    fates: Sequence[Fate],
    records: Sequence[GroupRecord],
    schema: pa.Schema,
    metas: Sequence[str | None] | None = None,
) -> pa.RecordBatch:
    """The `sequences` rows of these groups (fates[i] says what became of records[i]). Per-group values are
    built once per group and repeated by index (`take`), per-token arrays concatenated once: no Python loop
    runs per sequence or per token."""
    per_seq = np.fromiter((r.lengths.shape[0] for r in records), np.int64, count=len(records))
    lengths = np.concatenate([r.lengths for r in records])
    by_group: dict[str, list[Any]] = {
        "group": [f.group for f in fates],
        "group_id": [f.group_id for f in fates],
        "env": [f.env for f in fates],
        "env_id": [f.env_id for f in fates],
        "policy_step": [f.policy_step for f in fates],
        "fate": [f.fate for f in fates],
        "trained_step": [f.trained_step for f in fates],
        "drop_reason": [f.drop_reason for f in fates],
        "dropped_step": [f.dropped_step for f in fates],
        "acked_at": [_micros(f.acked_at) for f in fates],
        "meta": list(metas) if metas is not None else [meta_text(r) for r in records],
    }
    index = pa.array(np.repeat(np.arange(len(records)), per_seq))
    starts = np.cumsum(per_seq) - per_seq
    arrays = []
    for f in schema:
        assert f.name in _SCALARS or f.name in _PER_SEQ, f.name
        if f.name in _SCALARS:
            values = pa.array(by_group[f.name], pa.int64() if f.type == TIMESTAMP else f.type)
            arrays.append(values.take(index).cast(f.type) if f.type == TIMESTAMP else values.take(index))
        elif f.name == "seq":
            arrays.append(pa.array((np.arange(len(lengths)) - np.repeat(starts, per_seq)).astype(I32)))
        elif f.name == "length":
            arrays.append(pa.array(lengths.astype(I32, copy=False)))
        elif f.name == "score":
            arrays.append(pa.array(np.concatenate([r.scores for r in records])))
        elif f.name in ("tokens", "masks"):
            arrays.append(_lists([getattr(r, f.name) for r in records], lengths, pa.int32()))
        elif f.name == VERSIONS_FIELD:
            arrays.append(_version_lists(records, lengths, per_seq))
        else:
            arrays.append(_float_lists(records, f.name, lengths, per_seq))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


# ------------------------------------------------------------------------------------------- ledger tables


_ARROW = {
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float64": pa.float64(),
    "string": pa.string(),
    "bool": pa.bool_(),
    "int32 list": pa.list_(pa.int32()),
    "timestamp": TIMESTAMP,
}
"""The Arrow types a ledger column's `Column.arrow` names."""
_DERIVED: dict[str, list[pa.Field]] = {
    "id": [pa.field("group", pa.int64(), nullable=False)],
    "env_id": [],
    "group_id": [
        pa.field("group_id", pa.string()),
        pa.field("env", pa.string(), nullable=False),
        pa.field("env_id", pa.int32()),
    ],
    "step": [
        pa.field("trained_step", pa.int64()),
        pa.field("drop_reason", pa.string()),
        pa.field("dropped_step", pa.int64()),
    ],
    "reason": [],
}
"""The `groups` columns the export derives from a ledger column (`Column.arrow` None), in its place: the
group's ledger id is `group`, its env's name follows its group id, `step` and `reason` split by fate."""


def groups_schema() -> pa.Schema:
    """The `groups` table: the ledger's row of every group, kept payload or not; its columns are the ledger's
    (api/store/ledger_contract.py `LedgerGroup`), in their order."""
    out: list[pa.Field] = []
    for c in GROUP_RECORD:
        out += _DERIVED[c.name] if c.arrow is None else [pa.field(c.name, _ARROW[c.arrow], nullable=c.nullable)]
    return pa.schema(out)


_COPIED = tuple((c.name, c.arrow == "timestamp") for c in GROUP_RECORD if c.arrow is not None)


def group_row(row: LedgerGroup, env: str) -> dict[str, Any]:
    f = fate_of(row, env)
    out: dict[str, Any] = {
        "group": row.id,
        "group_id": row.group_id,
        "env": env,
        "env_id": f.env_id,
        "trained_step": f.trained_step,
        "drop_reason": f.drop_reason,
        "dropped_step": f.dropped_step,
    }
    for name, timestamp in _COPIED:
        value = getattr(row, name)
        out[name] = _micros(value) if timestamp else value
    return out


_BY_ENV = pa.list_(
    pa.struct([pa.field("env", pa.string()), pa.field("groups", pa.int64()), pa.field("seqs", pa.int64())])
)
_STALENESS = pa.list_(pa.struct([pa.field("staleness", pa.int64()), pa.field("groups", pa.int64())]))


def steps_schema() -> pa.Schema:
    """The `steps` table: one row per formed batch. Its mix and staleness histogram are lists of structs (not
    maps), which every reader the export promises takes as they are."""
    return pa.schema(
        [
            pa.field("step", pa.int64(), nullable=False),
            pa.field("formed_at", TIMESTAMP, nullable=False),
            pa.field("formation_s", pa.float64(), nullable=False),
            pa.field("committed_at", TIMESTAMP),
            pa.field("groups", pa.list_(pa.int64()), nullable=False),
            pa.field("seqs", pa.int64(), nullable=False),
            pa.field("tokens", pa.int64(), nullable=False),
            pa.field("mix", _BY_ENV, nullable=False),
            pa.field("staleness", _STALENESS, nullable=False),
        ]
    )


def step_row(row: LedgerStep) -> dict[str, Any]:
    envs = sorted(set(row.groups_by_env) | set(row.seqs_by_env))
    return {
        "step": row.step,
        "formed_at": _micros(row.formed_at),
        "formation_s": row.formation_s,
        "committed_at": _micros(row.committed_at),
        "groups": list(row.group_ids),
        "seqs": row.seqs,
        "tokens": row.tokens,
        "mix": [{"env": e, "groups": row.groups_by_env.get(e, 0), "seqs": row.seqs_by_env.get(e, 0)} for e in envs],
        "staleness": [{"staleness": int(k), "groups": v} for k, v in sorted(row.staleness.items())],
    }


class RowBatcher:
    """Ledger rows (one dict each, keys as the schema's fields) cut into record batches of `max_rows`."""

    def __init__(self, schema: pa.Schema, max_rows: int = ROW_GROUP_ROWS) -> None:
        self.schema = schema
        self.max_rows = max_rows
        self._rows: list[Mapping[str, Any]] = []

    def add(self, row: Mapping[str, Any]) -> pa.RecordBatch | None:
        self._rows.append(row)
        return self.flush() if len(self._rows) >= self.max_rows else None

    def flush(self) -> pa.RecordBatch | None:
        rows, self._rows = self._rows, []
        if not rows:
            return None
        return pa.RecordBatch.from_pylist(list(rows), schema=self.schema)
