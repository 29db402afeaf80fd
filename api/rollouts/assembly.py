"""A sealed group's body, assembled from its slots' stored records (api/store/rollouts.py `SlotRow.data`: each
rollout packed as the one sequence of a group when it was acknowledged): their arrays concatenated into one group
record, the body of a binary `POST /scored_data` (docs/binary-format.md). No rollout is parsed again. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from api.wire.records import F32, F64, FLOAT_FIELDS, I32, VERSIONS_FIELD, decode, version_of

__all__ = ["Part", "sealed_body"]


@dataclass(frozen=True, slots=True)
class Part:
    """One slot of the sealed group: its stored record, the score it is sealed with, its `policy_step` as posted."""

    data: bytes
    score: float
    policy_step: int | None


def sealed_body(parts: Sequence[Part], *, env_id: int | None, group_id: str, producer_id: str) -> bytes:
    """The group of these slots, in this order, as one msgpack group record: per-token arrays concatenated, a
    float field only if every slot has it (float32 unless a slot's is float64, as the JSON path narrows a whole
    group's), `overrides` one per slot (`{}` for a slot without) if any slot has them, and `policy_step` the oldest
    posted (staleness counts from the oldest weights in the group; none posted: stamped at ingest); per-token
    `token_weight_versions` only if every slot has them (after `meta`, where `encode` writes them)."""
    recs = [decode(p.data) for p in parts]
    floats: dict[str, np.ndarray] = {}
    for name in FLOAT_FIELDS:
        arrays = [r.floats.get(name) for r in recs]
        if arrays and all(a is not None for a in arrays):
            have = [a for a in arrays if a is not None]
            dtype = F32 if all(a.dtype == F32 for a in have) else F64
            floats[name] = np.concatenate([a.astype(dtype, copy=False) for a in have])
    steps = [p.policy_step for p in parts if p.policy_step is not None]
    body: dict[str, Any] = {
        "v": version_of(floats),
        "env_id": env_id,
        "policy_step": min(steps) if steps else None,
        "group_id": group_id,
        "lengths": np.concatenate([r.lengths for r in recs]).astype(I32, copy=False).tobytes(),
        "tokens": np.concatenate([r.tokens for r in recs]).astype(I32, copy=False).tobytes(),
        "masks": np.concatenate([r.masks for r in recs]).astype(I32, copy=False).tobytes(),
        "scores": np.array([p.score for p in parts], dtype=F64).tobytes(),
    }
    for name in FLOAT_FIELDS:
        arr = floats.get(name)
        body[name] = None if arr is None else arr.tobytes()
    meta: dict[str, Any] = {}
    overrides = [(r.meta.get("overrides") or [None])[0] for r in recs]
    if any(o is not None for o in overrides):
        meta["overrides"] = [o or {} for o in overrides]
    body["meta"] = meta
    versions = [r.weight_versions for r in recs]
    if versions and all(v is not None for v in versions):
        body[VERSIONS_FIELD] = np.concatenate(versions).astype(I32, copy=False).tobytes()  # type: ignore[arg-type]
    body["producer_id"] = producer_id
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]
