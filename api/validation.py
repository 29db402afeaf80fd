"""Checks that protect the trainer, and packing of a submitted group into a record. Pure: no I/O.

Every rule raises `InvalidData` with the location of the offending field relative to the group, so the
route can prefix it with where the group sits in the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from api.errors import InvalidData
from api.records import F32, F64, FLOAT_FIELDS, I32, META_FIELDS, GroupRecord
from api.schema import INT32_MAX, INT32_MIN, MASK_IGNORE, ScoredData


@dataclass(frozen=True, slots=True)
class GroupLimits:
    """What the trainer's registration and the server's settings allow of one group."""

    max_token_len: int
    """Longest sequence (the trainer's `max_token_len`)."""
    max_group_seqs: int
    """Most sequences in one group: the batch size, or a smaller server limit."""
    max_group_tokens: int | None = None
    """Most tokens in one group: the trainer's token budget per batch, if any."""


def _flat(rows: list[list[Any]], total: int, dtype: np.dtype[Any]) -> np.ndarray:
    # Row by row, then one concatenate: about twice as fast as fromiter over a chain for floats.
    flat = np.concatenate([np.asarray(row, dtype=dtype) for row in rows]) if rows else np.empty(0, dtype)
    assert flat.shape[0] == total, "rows were length-checked before flattening"
    return flat


def pack_group(sd: ScoredData, *, env_id: int | None, policy_step: int, limits: GroupLimits) -> GroupRecord:
    """Validate one group and pack it into flat arrays; raise InvalidData naming the field and the rule."""
    n = len(sd.tokens)
    if n == 0:
        raise InvalidData(("tokens",), "a group needs at least one sequence")
    if n > limits.max_group_seqs:
        raise InvalidData(("tokens",), f"{n} sequences in one group; at most {limits.max_group_seqs} are accepted")
    if len(sd.masks) != n:
        raise InvalidData(("masks",), f"{len(sd.masks)} mask rows for {n} sequences: need one per sequence")
    if len(sd.scores) != n:
        raise InvalidData(("scores",), f"{len(sd.scores)} scores for {n} sequences: need one per sequence")

    lengths = np.fromiter(map(len, sd.tokens), dtype=np.int64, count=n)
    for i, length in enumerate(lengths.tolist()):
        if length == 0:
            raise InvalidData(("tokens", i), "empty sequence")
        if length > limits.max_token_len:
            raise InvalidData(
                ("tokens", i), f"{length} tokens exceed the trainer's max_token_len of {limits.max_token_len}"
            )
        if len(sd.masks[i]) != length:
            raise InvalidData(("masks", i), f"{len(sd.masks[i])} mask values for {length} tokens: lengths must match")
    total = int(lengths.sum())
    if limits.max_group_tokens is not None and total > limits.max_group_tokens:
        raise InvalidData(
            ("tokens",),
            f"{total} tokens in one group exceed the trainer's max_batch_tokens of {limits.max_group_tokens}",
        )

    floats: dict[str, np.ndarray] = {}
    for name in FLOAT_FIELDS:
        rows = getattr(sd, name)
        if rows is None:
            continue
        _check_rows(name, rows, lengths)
        arr = _flat(rows, total, F64)
        if not np.isfinite(arr).all():
            raise InvalidData((name,), "values must be finite (no NaN or infinity)")
        floats[name] = arr.astype(F32)
    for name in ("distill_token_ids", "distill_logprobs"):
        rows = getattr(sd, name)
        if rows is not None:
            _check_rows(name, rows, lengths)

    tokens = _flat(sd.tokens, total, np.dtype(np.int64))
    if tokens.size and (tokens.min() < INT32_MIN or tokens.max() > INT32_MAX):
        raise InvalidData(("tokens",), "token ids must fit in int32")
    masks = _flat(sd.masks, total, np.dtype(np.int64))
    bad = (masks != MASK_IGNORE) & (masks != tokens)
    if bad.any():
        pos = int(np.argmax(bad))
        seq = int(np.searchsorted(np.cumsum(lengths), pos, side="right"))
        offset = pos - int(lengths[:seq].sum())
        raise InvalidData(
            ("masks", seq, offset),
            f"mask must be {MASK_IGNORE} or the token id {int(tokens[pos])}, got {int(masks[pos])}",
        )
    scores = np.asarray(sd.scores, dtype=F64)
    if not np.isfinite(scores).all():
        raise InvalidData(("scores", int(np.argmin(np.isfinite(scores)))), "scores must be finite (no NaN or infinity)")

    meta = {name: getattr(sd, name) for name in META_FIELDS if getattr(sd, name) is not None}
    return GroupRecord(
        env_id=env_id,
        lengths=lengths.astype(I32),
        tokens=tokens.astype(I32),
        masks=masks.astype(I32),
        scores=scores,
        policy_step=policy_step,
        group_id=sd.group_id,
        floats=floats,
        meta=meta,
    )


def _check_rows(name: str, rows: list[list[Any]], lengths: np.ndarray) -> None:
    if len(rows) != len(lengths):
        raise InvalidData((name,), f"{len(rows)} rows for {len(lengths)} sequences: need one per sequence")
    for i, (row, length) in enumerate(zip(rows, lengths.tolist(), strict=True)):
        if len(row) != length:
            raise InvalidData((name, i), f"{len(row)} values for {length} tokens: lengths must match")
