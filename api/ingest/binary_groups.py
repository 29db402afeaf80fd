"""Validation of groups sent on the binary path (docs/binary-format.md). Pure: no I/O.

The rules are the JSON path's (`api.ingest.validation`), checked on the flat arrays with numpy. A record that is
already in the form the server stores (every key, in `encode`'s order, with `policy_step` set) is stored
as the client's bytes; any other valid record is re-encoded once.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
from pydantic import ValidationError

from api.errors import InvalidData
from api.ingest.validation import (
    GroupLimits,
    check_distill,
    check_lengths,
    check_producer_id,
    check_values,
    check_versions,
)
from api.run.printable import check_printable
from api.wire.records import (
    F32,
    F64,
    FLOAT_FIELDS,
    I32,
    META_FIELDS,
    RECORD_KEYS,
    VERSIONED_KEYS,
    VERSIONS,
    VERSIONS_FIELD,
    Buffer,
    GroupRecord,
    encode,
    narrowest,
    split_records,
    version_of,
)
from api.wire.rules import GROUP_ID_MAX
from api.wire.schema import ScoredData


@dataclass(slots=True)  # not frozen, as GroupRecord: a frozen __init__ costs per group
class BinaryGroup:
    record: GroupRecord
    payload: bytes
    """The record as stored: the client's bytes when they were already canonical."""
    passthrough: bool
    sent_policy_step: int | None = None
    """`policy_step` as sent (nil: the server stamped its current step)."""


def check_body(
    raw: bytes | bytearray, *, many: bool, env_ids: Container[int], current_step: int, limits: GroupLimits
) -> list[BinaryGroup]:
    """A /scored_data body (one record) or /scored_data_list body (an array of them), every group checked;
    errors are located in the request (`["body", i, field]` in a list)."""
    try:
        # A list's records are views, each copied once, into its payload; a lone record is the body itself,
        # stored as it came when it is in the stored form. One record is framed by its own decoding (a walk
        # over the list's framing would feed the whole body to an Unpacker: a copy and a parse more).
        parts = split_records(memoryview(raw), array=True) if many else [raw]
    except ValueError as exc:
        raise InvalidData(("body",), str(exc)) from None
    groups = []
    for i, part in enumerate(parts):
        try:
            groups.append(check_record(part, env_ids=env_ids, current_step=current_step, limits=limits))
        except InvalidData as exc:
            raise (exc.at("body", i) if many else exc.at("body")) from None
    return groups


def check_record(raw: Buffer, *, env_ids: Container[int], current_step: int, limits: GroupLimits) -> BinaryGroup:
    """Validate one record's bytes; raise InvalidData located relative to the record."""
    try:
        m = msgpack.unpackb(raw, raw=False)
    except msgpack.ExtraData as exc:  # as `split_records` words the framing's errors
        raise InvalidData((), f"{len(exc.extra)} bytes after the end of the msgpack value") from None
    except msgpack.OutOfData:
        raise InvalidData((), "truncated msgpack") from None
    except (ValueError, msgpack.UnpackException) as exc:
        raise InvalidData((), f"not a valid msgpack group record: {exc}") from None
    if not isinstance(m, dict):
        raise InvalidData((), f"a group record is a msgpack map, got {type(m).__name__}")
    version = m.get("v", 1)
    if version not in VERSIONS:
        raise InvalidData(("v",), f"format version {version!r} is not supported; this server reads {VERSIONS}")
    env_id = _opt_int(m, "env_id", minimum=None)
    if env_id is not None and env_id not in env_ids:
        raise InvalidData(("env_id",), f"no environment with env_id {env_id} is registered")
    policy_step = _opt_int(m, "policy_step", minimum=0)  # not ahead of the trainer: checked in the transaction
    group_id = m.get("group_id")
    if group_id is not None and not (isinstance(group_id, str) and 1 <= len(group_id) <= GROUP_ID_MAX):
        raise InvalidData(("group_id",), f"must be a string of 1 to {GROUP_ID_MAX} characters, or nil")
    producer_id = check_producer_id(m.get("producer_id"))  # not stored in the record: a key beyond RECORD_KEYS

    lengths = _array(m, "lengths", I32)
    total = check_lengths(lengths, limits, "lengths")
    tokens = _array(m, "tokens", I32, count=total, lengths=lengths)
    masks = _array(m, "masks", I32, count=total, lengths=lengths)
    scores = _array(m, "scores", F64, count=lengths.shape[0], what="one per sequence")
    floats = {name: _float_field(m, name, total, lengths) for name in FLOAT_FIELDS if m.get(name) is not None}
    check_values(lengths, tokens, masks, scores, floats)
    versions = None
    if m.get(VERSIONS_FIELD) is not None:
        versions = _array(m, VERSIONS_FIELD, I32, count=total, lengths=lengths)
        check_versions(lengths, versions)
    raw_meta = m.get("meta")
    meta = _check_meta(raw_meta, lengths)

    record = GroupRecord(
        env_id=env_id,
        lengths=lengths,
        tokens=tokens,
        masks=masks,
        scores=scores,
        policy_step=current_step if policy_step is None else policy_step,
        group_id=group_id,
        floats=floats,
        meta=meta,
        producer_id=producer_id,
        weight_versions=versions,
    )
    keys = tuple(m)
    stored_keys = RECORD_KEYS if versions is None else VERSIONED_KEYS
    if producer_id is not None and keys == (*stored_keys, "producer_id"):  # the stored form but its last key: cut it
        cut = _without_producer(raw, producer_id, len(stored_keys))
        if cut is not None:
            raw, keys = cut, stored_keys
    stored_form = (
        keys == stored_keys
        and version == version_of(floats)
        and all(len(m[name]) == floats[name].nbytes for name in floats)  # no float64 that float32 holds
        and raw_meta == meta
    )
    if stored_form and policy_step is not None:
        return BinaryGroup(record, raw if isinstance(raw, bytes) else bytes(raw), True, policy_step)
    payload = _stamped(raw, current_step) if stored_form else None
    return BinaryGroup(record, encode(record) if payload is None else payload, False, policy_step)


_NIL_STEP = msgpack.packb("policy_step") + b"\xc0"
_FIXMAP = 0x80  # a fixmap header: the stored form has fewer than 16 keys


def _without_producer(raw: Buffer, producer_id: str, stored_keys: int) -> bytes | None:
    """A record in the stored form plus `producer_id` as its last key (as `encode_submission` writes it), with
    that key cut off: the ledger keeps the producer apart, and the group's bytes are still stored as sent
    rather than re-encoded. None when the bytes are not laid out so."""
    tail = msgpack.packb("producer_id") + msgpack.packb(producer_id)
    view = memoryview(raw)
    if view[0] != _FIXMAP | (stored_keys + 1) or bytes(view[-len(tail) :]) != tail:
        return None
    return b"".join((bytes((_FIXMAP | stored_keys,)), view[1 : -len(tail)]))


def _stamped(raw: Buffer, step: int) -> bytes | None:
    """A record in the stored form but for a nil `policy_step` (Atropos handlers send none), with the step
    written in: a splice, not a re-encoding of the whole group. Its keys are in `RECORD_KEYS` order, so the
    first match is the key itself, within the first bytes (only `v` and `env_id`, two ints, come before it)."""
    view = memoryview(raw)  # slices of a view: the join is the one copy
    at = bytes(view[:64]).find(_NIL_STEP)
    if at < 0:
        return None
    cut = at + len(_NIL_STEP) - 1
    return b"".join((view[:cut], msgpack.packb(step), view[cut + 1 :]))


def _float_field(m: dict[str, Any], name: str, total: int, lengths: np.ndarray) -> np.ndarray:
    """A float field sent as float32 (4 bytes per token) or float64 (8), stored float32 where that is exact."""
    value = m.get(name)
    if isinstance(value, bytes) and len(value) == 8 * total:
        return narrowest(np.frombuffer(value, F64))
    what = "one per token, the sum of lengths, float32 or float64"
    return _array(m, name, F32, count=total, what=what, lengths=lengths)


def _opt_int(m: dict[str, Any], name: str, *, minimum: int | None) -> int | None:
    value = m.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        rule = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise InvalidData((name,), f"must be {rule}, or nil")
    return value


def _array(
    m: dict[str, Any],
    name: str,
    dtype: np.dtype[Any],
    count: int | None = None,
    what: str = "",
    lengths: np.ndarray | None = None,
) -> np.ndarray:
    kind = {"i": "int32", "f": "float32" if dtype.itemsize == 4 else "float64"}[dtype.kind]
    value = m.get(name)
    if value is None:
        raise InvalidData((name,), "field required")
    if not isinstance(value, bytes):
        raise InvalidData((name,), f"must be msgpack bin of little-endian {kind} values, got {type(value).__name__}")
    if len(value) % dtype.itemsize:
        raise InvalidData((name,), f"{len(value)} bytes is not a whole number of {kind} values")
    arr = np.frombuffer(value, dtype)
    if count is not None and arr.shape[0] != count:
        n = arr.shape[0]
        rule = what or "one per token, the sum of lengths"
        if lengths is not None and n < count:  # values are flat: name the sequence where they run out
            ends = np.cumsum(lengths, dtype=np.int64)
            seq = int(np.searchsorted(ends, n, side="right"))
            start = int(ends[seq - 1]) if seq else 0
            have = max(0, n - start)
            raise InvalidData(
                (name, seq),
                f"{n} values for {count} tokens ({rule}): they run out in "
                f"sequence {seq}, which gets {have} of its {int(lengths[seq])}",
            )
        raise InvalidData((name,), f"{n} values where {count} are needed: {rule}")
    return arr


def _check_meta(raw: Any, lengths: np.ndarray) -> dict[str, Any]:
    """The metadata fields under the JSON path's rules, as the server stores them (nil fields left out)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidData(("meta",), f"must be a msgpack map of ScoredData fields, got {type(raw).__name__}")
    known = {k: v for k, v in raw.items() if k in META_FIELDS and v is not None}
    if not known:  # what `encode_submission` sends without metadata: nothing to validate
        return {}
    try:
        sd = ScoredData.model_validate({"tokens": [], "masks": [], "scores": [], **known})
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_context=False, include_input=False)[0]
        raise InvalidData(("meta", *err["loc"]), err["msg"]) from None
    meta = {name: getattr(sd, name) for name in META_FIELDS if getattr(sd, name) is not None}
    try:
        check_distill(sd, lengths)
        check_printable(meta)
    except InvalidData as exc:
        raise exc.at("meta") from None
    return meta
