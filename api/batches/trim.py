"""Cutting sequences off a group: the one way a served group differs from the group as stored. Pure: no I/O.

Used by `no_exact_fill: "trim"` (a group served with its first sequences only, `api/batches/formation.py`) and by
the data-parallel shares (`api/batches/sharding.py`). Every per-sequence field is cut alike: the per-token arrays
(tokens, masks, advantages, ref and inference logprobs, weight versions) through `lengths`, the scores, and the
free-form fields that hold one entry per sequence (messages, overrides, distill ids and logprobs: a list as long as
the group).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from api.wire.records import GroupRecord, decode, encode, msgpack_array_header, split_records


def cut(rec: GroupRecord, seqs: np.ndarray) -> GroupRecord:
    """The group restricted to these sequences (indices into it), every per-sequence field cut to match."""
    n = rec.seqs
    starts = np.concatenate([[0], np.cumsum(rec.lengths)[:-1]]).astype(np.int64)
    spans = [np.arange(starts[i], starts[i] + rec.lengths[i]) for i in seqs]
    index = np.concatenate(spans) if spans else np.empty(0, np.int64)
    meta = {k: ([v[i] for i in seqs] if isinstance(v, list) and len(v) == n else v) for k, v in rec.meta.items()}
    return replace(
        rec,
        lengths=rec.lengths[seqs],
        tokens=rec.tokens[index],
        masks=rec.masks[index],
        scores=rec.scores[seqs],
        floats={k: v[index] for k, v in rec.floats.items()},
        meta=meta,
        weight_versions=None if rec.weight_versions is None else rec.weight_versions[index],
    )


def first_sequences(payload: bytes, keep: int) -> tuple[bytes, int]:
    """A stored group (one record) as served with only its first `keep` sequences, and the tokens cut off.

    The first ones, not a choice by score or length: which sequences come last says nothing of their reward
    (the order the producer sent them), so the kept ones are an unbiased sample of the group, and the same cut
    is made again whenever a kept batch is served again."""
    rec = decode(payload)
    kept = cut(rec, np.arange(keep))
    return encode(kept), rec.n_tokens - kept.n_tokens


def apply_cuts(records: bytes | memoryview, n_groups: int, trims: Mapping[int, int]) -> bytes:
    """A stored batch's records (a msgpack array of `n_groups` records, as `Txn.get_batch` returns them after
    the header) with record `i` cut to its first `trims[i]` sequences: a batch served again is served as first."""
    parts = split_records(records, array=True)
    assert len(parts) == n_groups, "a kept batch's records do not match its header"
    out = [first_sequences(bytes(p), trims[i])[0] if i in trims else p for i, p in enumerate(parts)]
    return b"".join([msgpack_array_header(n_groups), *out])
