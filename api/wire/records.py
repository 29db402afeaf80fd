"""The group record: how one scored group is stored, and sent on the binary path (docs/binary-format.md).

A record is a msgpack map whose per-token fields are raw little-endian arrays (int32 tokens and masks;
advantages and logprobs as float32, or as float64 where float32 would not hold a field's values exactly)
over all sequences of the group, with `lengths` to split them. Records
concatenate: a queue item's payload is N records back to back, and a binary batch is a msgpack array
header followed by the stored bytes as they are, so serving a batch never re-encodes a payload (but for a group
cut under `no_exact_fill: "trim"`, `api/batches/trim.py`).
This module imports numpy and msgpack only: the clients use it too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import orjson

Buffer = bytes | bytearray | memoryview
"""Records are read from bytes, from a request body as received, or from views into a stored batch (no copy)."""
FORMAT_VERSION = 2
"""The newest record layout. A record is written as version 1 (the layout before float64 fields existed,
byte for byte) unless a float field is float64; readers take both."""
VERSIONS = (1, 2)
MSGPACK = "application/msgpack"
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")
"""Content types of the binary path; the first is the one rollbuf sends and advertises in /info."""
I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
F64 = np.dtype("<f8")

FLOAT_FIELDS = ("advantages", "ref_logprobs", "inference_logprobs")
"""Per-token float fields: float32 on the wire and in the store where that holds every value of the field
exactly (as for the float32 logprobs inference engines produce), else float64 (`narrowest`)."""
META_FIELDS = (
    "messages",
    "generation_params",
    "overrides",
    "group_overrides",
    "images",
    "distill_token_ids",
    "distill_logprobs",
)
"""Fields kept as they were sent (msgpack of their JSON value)."""
RECORD_KEYS = (
    "v",
    "env_id",
    "policy_step",
    "group_id",
    "lengths",
    "tokens",
    "masks",
    "scores",
    *FLOAT_FIELDS,
    "meta",
)
"""Every key of a record, in the order `encode` writes them (the canonical form the server stores as sent)."""
VERSIONS_FIELD = "token_weight_versions"
"""The optional per-token int32 field: the trainer step of the weights that sampled each token. Written after
`meta`, and only when the group carries it, so a group without it is stored and served byte for byte as before
(readers that do not know the key skip it)."""
VERSIONED_KEYS = (*RECORD_KEYS, VERSIONS_FIELD)
"""The keys of a record that carries per-token weight versions, in `encode`'s order."""


@dataclass(slots=True)
class GroupRecord:
    """One scored group, as flat arrays plus the lengths that split them into sequences.

    Never changed once built, but not `frozen`: a frozen dataclass's `__init__` costs 3 µs more per record (a
    group at ingest, each of a batch's records when the trainer decodes it)."""

    env_id: int | None
    lengths: np.ndarray
    tokens: np.ndarray
    masks: np.ndarray
    scores: np.ndarray
    policy_step: int
    group_id: str | None = None
    floats: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    producer_id: str | None = None
    """Who made it, as sent: the ledger row keeps it; the stored record (`encode`) does not (it is not served)."""
    weight_versions: np.ndarray | None = None
    """int32 [T], per token: the trainer step of the weights that sampled it (`VERSIONS_FIELD`), or None when the
    group was sent without it."""

    @property
    def seqs(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """Per-sequence views of a flat per-token array."""
        return np.split(flat, np.cumsum(self.lengths[:-1]))


_NOT_F32 = (1 << 29) - 1
"""The low bits of a float64's mantissa that float32's lacks: a value with any of them set is not a float32."""
_PEEK = 8
"""Values whose bits `narrowest` reads before casting the whole array."""


def narrowest(values: np.ndarray) -> np.ndarray:
    """A float field as float32 when that holds every value exactly, else as float64.

    Handlers send float32 values printed as doubles (vLLM's logprobs), which float32 keeps at half the
    size, or decimals and float64 results (`-0.7`), which only float64 gives back as they were sent. The
    latter show it in their first values' bits: those are read first, and the cast and comparison of the whole
    array (a third of a small group's validation, with its `errstate`) are left to the values that pass."""
    if values.dtype.kind == "f" and values.dtype.itemsize == 8 and values.ndim == 1 and values.shape[0]:
        head = values[:_PEEK].view(values.dtype.str.replace("f", "u"))
        if int(np.bitwise_or.reduce(head)) & _NOT_F32:
            return values.astype(F64, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):
        f32 = values.astype(F32)
    if f32.shape == values.shape and np.equal(f32, values).all():  # compared as float64: exact (NaN never)
        return f32
    return values.astype(F64, copy=False)


def float_dtype(values: np.ndarray) -> np.dtype[Any]:
    """How a float field is stored: float64 arrays as float64, anything else as float32."""
    return F64 if values.dtype == F64 else F32


def version_of(floats: dict[str, np.ndarray]) -> int:
    """1 when every float field is float32 (the layout version-1 readers know), 2 with a float64 field."""
    return 2 if any(a.dtype == F64 for a in floats.values()) else 1


def encode(rec: GroupRecord) -> bytes:
    body: dict[str, Any] = {
        "v": version_of(rec.floats),
        "env_id": rec.env_id,
        "policy_step": rec.policy_step,
        "group_id": rec.group_id,
        "lengths": rec.lengths.astype(I32, copy=False).tobytes(),
        "tokens": rec.tokens.astype(I32, copy=False).tobytes(),
        "masks": rec.masks.astype(I32, copy=False).tobytes(),
        "scores": rec.scores.astype(F64, copy=False).tobytes(),
    }
    for name in FLOAT_FIELDS:
        arr = rec.floats.get(name)
        body[name] = None if arr is None else arr.astype(float_dtype(arr), copy=False).tobytes()
    body["meta"] = rec.meta
    if rec.weight_versions is not None:
        body[VERSIONS_FIELD] = rec.weight_versions.astype(I32, copy=False).tobytes()
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def float_array(data: Buffer, n_tokens: int) -> np.ndarray:
    """A float field's bytes: 8 per token are float64, else float32 (`T >= 1`, so the sizes differ)."""
    return np.frombuffer(data, F64 if len(data) == 8 * n_tokens and n_tokens else F32)


def _from_map(m: dict[str, Any]) -> GroupRecord:
    version = m.get("v", 1)
    if version not in VERSIONS:
        raise ValueError(f"group record version {version!r}: this reader knows {VERSIONS}")
    n_tokens = len(m["tokens"]) // I32.itemsize
    floats = {name: float_array(m[name], n_tokens) for name in FLOAT_FIELDS if m.get(name) is not None}
    return GroupRecord(
        env_id=m.get("env_id"),
        lengths=np.frombuffer(m["lengths"], I32),
        tokens=np.frombuffer(m["tokens"], I32),
        masks=np.frombuffer(m["masks"], I32),
        scores=np.frombuffer(m["scores"], F64),
        policy_step=int(m.get("policy_step") or 0),
        group_id=m.get("group_id"),
        floats=floats,
        meta=m.get("meta") or {},
        weight_versions=None if m.get(VERSIONS_FIELD) is None else np.frombuffer(m[VERSIONS_FIELD], I32),
    )


def decode(data: Buffer) -> GroupRecord:
    return _from_map(msgpack.unpackb(data, raw=False))


def decode_meta(data: Buffer) -> tuple[dict[str, Any], str | None]:
    """A record's free-form fields and group id, its arrays skipped (not copied out)."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    meta: dict[str, Any] = {}
    group_id = None
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key == "meta":
            meta = unpacker.unpack() or {}
        elif key == "group_id":
            group_id = unpacker.unpack()
        else:
            unpacker.skip()
    return meta, group_id


def is_msgpack(content_type: str | None) -> bool:
    """Whether a Content-Type or Accept value names the binary path (parameters ignored)."""
    if not content_type:
        return False
    return any(part.split(";", 1)[0].strip().lower() in MSGPACK_TYPES for part in content_type.split(","))


def split_records(data: Buffer, *, array: bool) -> list[Buffer]:
    """The raw bytes of each record: of one record (`array=False`), or of a msgpack array of records.

    Raises ValueError when the data is not exactly that (truncated, trailing bytes, not an array).
    """
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    try:
        n = unpacker.read_array_header() if array else 1
        bounds = [unpacker.tell()]
        for _ in range(n):
            unpacker.skip()
            bounds.append(unpacker.tell())
    except msgpack.OutOfData:
        raise ValueError("truncated msgpack") from None
    except (msgpack.UnpackException, ValueError) as exc:
        raise ValueError(f"not valid msgpack: {exc or type(exc).__name__}") from None
    if bounds[-1] != len(data):
        raise ValueError(f"{len(data) - bounds[-1]} bytes after the end of the msgpack value")
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# ------------------------------------------------------------------------------------------- client side


def _flat_rows(rows: Any, dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence rows (lists, 1-D arrays, or one 2-D array) as one flat array and their lengths."""
    if isinstance(rows, np.ndarray) and rows.ndim == 2:
        return np.ascontiguousarray(rows, dtype=dtype).reshape(-1), np.full(rows.shape[0], rows.shape[1], I32)
    arrays = [np.asarray(r, dtype=dtype) for r in rows]
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=I32, count=len(arrays))
    flat = np.concatenate(arrays) if arrays else np.empty(0, dtype)
    return flat, lengths


def _float_rows(rows: Any) -> np.ndarray:
    """A float field, flat: float32 arrays stay float32; anything else (Python floats, float64 arrays) is
    kept as float64 where float32 would change a value (`narrowest`), as on the JSON path."""
    if isinstance(rows, np.ndarray) and rows.dtype == F32:
        return np.ascontiguousarray(rows, F32).reshape(-1)
    if isinstance(rows, Sequence) and rows and all(isinstance(r, np.ndarray) and r.dtype == F32 for r in rows):
        return _flat_rows(rows, F32)[0]
    return narrowest(_flat_rows(rows, F64)[0])


def encode_submission(
    tokens: Sequence[Any] | np.ndarray,
    masks: Sequence[Any] | np.ndarray,
    scores: Sequence[float] | np.ndarray,
    *,
    env_id: int | None = None,
    policy_step: int | None = None,
    group_id: str | None = None,
    producer_id: str | None = None,
    advantages: Sequence[Any] | np.ndarray | None = None,
    ref_logprobs: Sequence[Any] | np.ndarray | None = None,
    inference_logprobs: Sequence[Any] | np.ndarray | None = None,
    token_weight_versions: Sequence[Any] | np.ndarray | None = None,
    **meta: Any,
) -> bytes:
    """One group as the body of `POST /scored_data` with `Content-Type: application/msgpack`.

    Takes what a JSON submission holds, per sequence (lists or numpy rows); `meta` are the other
    ScoredData fields (messages, overrides, ...). The server checks everything; this only converts types
    (an id outside int32 raises OverflowError; float32 arrays stay float32, other floats are float32 where
    that is exact, else float64). With `policy_step` set, the bytes are already in the form
    the server stores, so it stores them as they are (`producer_id`, written last, is cut off by the server and
    kept apart, in the ledger).
    """
    flat_tokens, lengths = _flat_rows(tokens, I32)
    flat_masks, _ = _flat_rows(masks, I32)
    given = {"advantages": advantages, "ref_logprobs": ref_logprobs, "inference_logprobs": inference_logprobs}
    floats = {name: _float_rows(rows) for name, rows in given.items() if rows is not None}
    body: dict[str, Any] = {
        "v": version_of(floats),
        "env_id": env_id,
        "policy_step": policy_step,
        "group_id": group_id,
        "lengths": lengths.tobytes(),
        "tokens": flat_tokens.tobytes(),
        "masks": flat_masks.tobytes(),
        "scores": np.asarray(scores, dtype=F64).tobytes(),
    }
    for name in FLOAT_FIELDS:
        arr = floats.get(name)
        body[name] = None if arr is None else arr.tobytes()
    unknown = sorted(set(meta) - set(META_FIELDS))
    if unknown:
        raise TypeError(f"unknown group fields {unknown}; known: {', '.join(META_FIELDS)}")
    body["meta"] = {k: v for k, v in meta.items() if v is not None}
    if token_weight_versions is not None:
        body[VERSIONS_FIELD] = _flat_rows(token_weight_versions, I32)[0].tobytes()
    if producer_id is not None:
        body["producer_id"] = producer_id
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def encode_submission_list(groups: Iterable[bytes]) -> bytes:
    """Encoded groups (from `encode_submission`) as the body of `POST /scored_data_list`."""
    parts = list(groups)
    return b"".join([msgpack_array_header(len(parts)), *parts])


# ------------------------------------------------------------------------------------------- Atropos JSON


def to_atropos(rec: GroupRecord) -> dict[str, Any]:
    """The group as an Atropos trainer reads it: all 14 ScoredData keys, per-sequence lists.

    Arrays stay numpy views; `orjson` writes them without building Python lists.
    """
    out: dict[str, Any] = {
        "tokens": rec.split(rec.tokens),
        "masks": rec.split(rec.masks),
        "scores": rec.scores,
    }
    for name in FLOAT_FIELDS:
        arr = rec.floats.get(name)
        # Printed as float64, whatever it is stored as: orjson writes the shortest text that reads back as the
        # same double, so a float32 value comes back as the double the handler sent (-0.699999988079071 for
        # vLLM's float32 -0.7) and a float64 one as sent (-0.7). Printed as float32 it would read -0.7 both times.
        out[name] = None if arr is None else rec.split(arr.astype(F64, copy=False))
    for name in META_FIELDS:
        out[name] = rec.meta.get(name)
    out["env_id"] = rec.env_id
    out["policy_step"] = rec.policy_step
    out["group_id"] = rec.group_id
    if rec.weight_versions is not None:  # only when sent: a group without it is served as Atropos serves it
        out[VERSIONS_FIELD] = rec.split(rec.weight_versions)
    if "group_scores" in rec.meta:  # a group split across ranks: the whole group's scores, for its advantages
        out["group_scores"] = rec.meta["group_scores"]
    return out


_ORJSON_OPTS = orjson.OPT_SERIALIZE_NUMPY
BLOB_EXT_TYPE = 66
"""The msgpack ext type of a blob reference in a stored record (api/wire/blobs.py)."""


def json_default(obj: Any) -> Any:
    """How JSON shows what a stored record may hold besides JSON values: a blob reference (a value kept in the blob
    tier and not put back, as in an export) as `{"blob": "sha256:<hex>", "size": n}`."""
    if isinstance(obj, msgpack.ExtType) and obj.code == BLOB_EXT_TYPE and len(obj.data) >= 40:
        return {"blob": "sha256:" + obj.data[-40:-8].hex(), "size": int.from_bytes(obj.data[-8:], "big")}
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, default=json_default, option=_ORJSON_OPTS)


def decode_batch(data: Buffer) -> list[GroupRecord]:
    """A batch as stored and sent on the binary path: a msgpack array of group records."""
    return [_from_map(m) for m in msgpack.unpackb(data, raw=False)]


def atropos_batch_json(batch: Buffer) -> bytes:
    """`{"batch": [group, ...]}` as Atropos trainers read it, from a stored batch."""
    return dumps({"batch": [to_atropos(rec) for rec in decode_batch(batch)]})


def msgpack_array_header(n: int) -> bytes:
    packer = msgpack.Packer()
    return packer.pack_array_header(n)  # type: ignore[no-any-return]
