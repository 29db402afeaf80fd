"""A batch as numpy arrays: ragged (flat + offsets), padded `[n, L]`, or packed rows. Pure: numpy only.

Everything here is built from the wire records (`api.wire.records`) or the Atropos JSON reply, and is shared
by the sync and async clients. Shapes: `n` sequences, `T` tokens in all, `G` groups, `R` packed rows.

Masks arrive exactly as the rollout handler sent them (any int32). Every view reads them with Atropos's
convention: a position is trained on unless its mask is -100 (`trained`, the one place that rule lives).
Handlers that send 0/1 masks instead are remapped per env with `Batch.with_zero_one_masks`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

import numpy as np

from api.wire.records import FLOAT_FIELDS, VERSIONS_FIELD, GroupRecord
from api.wire.rules import MASK_IGNORE
from trainer_client.tensors import to_tensors

I32 = np.dtype(np.int32)
I64 = np.dtype(np.int64)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)

GRPO_EPS = 1e-6
"""Added to a group's score standard deviation: a group with equal scores gets zero advantages, not NaN."""
NO_ENV = -1
"""`env_ids` value of a group sent without an env id."""
NO_VERSION = -1
"""`weight_versions` value of a token whose group was sent without per-token versions, and of padding."""


@dataclass(frozen=True, slots=True)
class Padded:
    """Sequences as rows of one `[n, L]` array; `L` is the longest sequence, rounded up if asked."""

    tokens: np.ndarray
    """int32 [n, L]; `pad_id` after each sequence."""
    masks: np.ndarray
    """int32 [n, L]; -100 where not trained on, including padding."""
    attention_mask: np.ndarray
    """bool [n, L]; True on real tokens."""
    advantages: np.ndarray
    """float32 [n, L]; 0 on padding."""
    floats: dict[str, np.ndarray] = field(default_factory=dict)
    """Per-token float fields the batch carries (`inference_logprobs`, `ref_logprobs`), float32 [n, L]."""
    weight_versions: np.ndarray | None = None
    """int64 [n, L] when a group of the batch sent `token_weight_versions`: the trainer step of the weights that
    sampled each token, -1 on padding and where a group sent none."""

    @property
    def trained(self) -> np.ndarray:
        """bool [n, L]: the positions the loss is taken on (mask not -100); False on padding."""
        return trained_positions(self.masks)

    def to_torch(self, device: Any = None, *, non_blocking: bool = True) -> dict[str, Any]:
        """Tensors `[n, L]` on `device` (None: the CPU): `tokens` and `labels` int64 (`labels`: the token id
        where trained on, -100 elsewhere, as `cross_entropy` ignores), `trained` and `attention_mask` bool,
        `advantages` and the floats float32. See `trainer_client.tensors` for how they travel."""
        # the handler's raw `advantages` (NaN where a group sent none) gives way to the merged ones
        arrays = {
            **self.floats,
            "tokens": self.tokens,
            "masks": self.masks,
            "attention_mask": self.attention_mask,
            "advantages": self.advantages,
        }
        if self.weight_versions is not None:
            arrays["weight_versions"] = self.weight_versions
        return to_tensors(arrays, device, non_blocking=non_blocking)


@dataclass(frozen=True, slots=True)
class Packed:
    """Sequences packed first-fit-decreasing into `R` rows of `max_len` tokens, for attention with
    per-sequence boundaries (flash-attention varlen, or a block-diagonal mask from `segment_ids`)."""

    tokens: np.ndarray
    """int32 [R, max_len]; `pad_id` in unused positions."""
    masks: np.ndarray
    """int32 [R, max_len]; -100 where not trained on, including padding."""
    position_ids: np.ndarray
    """int32 [R, max_len]; restarts at 0 at each sequence's first token; 0 on padding."""
    segment_ids: np.ndarray
    """int32 [R, max_len]; the batch index of the sequence at each position, -1 on padding."""
    advantages: np.ndarray
    """float32 [R, max_len]; 0 on padding."""
    row: np.ndarray
    """int32 [n]: the row each sequence was placed in."""
    start: np.ndarray
    """int32 [n]: the column where each sequence starts in its row."""
    cu_seqlens: list[np.ndarray]
    """Per row, int32 cumulative sequence lengths `[0, l1, l1 + l2, ...]` in placement order."""
    floats: dict[str, np.ndarray] = field(default_factory=dict)
    weight_versions: np.ndarray | None = None
    """int64 [R, max_len] when a group of the batch sent per-token versions; -1 on padding (as `Padded`)."""

    @property
    def trained(self) -> np.ndarray:
        """bool [R, max_len]: the positions the loss is taken on (mask not -100); False on padding."""
        return trained_positions(self.masks)

    def to_torch(self, device: Any = None, *, non_blocking: bool = True) -> dict[str, Any]:
        """Tensors `[R, max_len]`: `tokens`, `labels`, `position_ids`, `segment_ids` int64, `trained` bool,
        `advantages` and the floats float32 (as `Padded.to_torch`)."""
        arrays = {
            **self.floats,
            "tokens": self.tokens,
            "masks": self.masks,
            "position_ids": self.position_ids,
            "segment_ids": self.segment_ids,
            "advantages": self.advantages,
        }
        if self.weight_versions is not None:
            arrays["weight_versions"] = self.weight_versions
        return to_tensors(arrays, device, non_blocking=non_blocking)


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch (or one rank's share of it) as flat arrays: sequence `i` is `tokens[offsets[i]:offsets[i+1]]`."""

    step: int | None
    """The step this batch belongs to (None when the server does not say: Atropos)."""
    tokens: np.ndarray
    """int32 [T]."""
    masks: np.ndarray
    """int32 [T], as the handlers sent them; -100 where not trained on (see `trained`)."""
    offsets: np.ndarray
    """int64 [n + 1]."""
    scores: np.ndarray
    """float64 [n]."""
    group_index: np.ndarray
    """int32 [n]: which group of this batch each sequence belongs to."""
    env_ids: np.ndarray
    """int32 [n]; -1 for groups sent without an env id."""
    policy_steps: np.ndarray
    """int64 [n]: the trainer step whose weights generated each sequence (-1 when unknown)."""
    floats: dict[str, np.ndarray]
    """Per-token float fields sent by at least one group, float32 [T]; NaN where a group did not send it."""
    group_scores: list[np.ndarray]
    """Per group, the scores of the whole group (more than its sequences here when a rank got part of it)."""
    group_ids: list[str | None]
    meta: list[dict[str, Any]]
    """Per group: messages, overrides, generation_params, ... as sent."""
    weight_versions: np.ndarray | None = None
    """int64 [T], beside the masks, when at least one group sent `token_weight_versions`: the trainer step of the
    weights that sampled each token; -1 in the groups that did not send them. None when no group did."""

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def trained(self) -> np.ndarray:
        """bool [T]: the positions the loss is taken on. Atropos's convention: every position whose mask is
        not -100 (its `BaseEnv` writes -100 on the prompt and the token id elsewhere)."""
        return trained_positions(self.masks)

    def with_zero_one_masks(self, env_ids: Iterable[int]) -> Batch:
        """This batch with the masks of these envs' sequences read as 0/1 (0: not trained, anything else:
        trained) and rewritten to Atropos's convention (-100 / the token id), so that `trained`, `padded()`,
        `packed()` and `to_torch()` all see them right. Other envs' masks are left as sent."""
        per_seq = np.isin(self.env_ids, np.fromiter(env_ids, I64))
        if not per_seq.any():
            return self
        rows = np.repeat(per_seq, self.lengths)
        masks = np.where(rows & (self.masks == 0), MASK_IGNORE, np.where(rows, self.tokens, self.masks))
        return replace(self, masks=masks.astype(I32))

    @property
    def n_seqs(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_groups(self) -> int:
        return len(self.group_ids)

    def sequences(self, flat: np.ndarray | None = None) -> list[np.ndarray]:
        """Per-sequence views of a flat per-token array (the tokens by default)."""
        return np.split(self.tokens if flat is None else flat, self.offsets[1:-1])

    def grpo_advantages(self, *, scale: bool = True, eps: float = GRPO_EPS) -> np.ndarray:
        """Per sequence, float32 [n]: (score - group mean) / (group std + eps); `scale=False` skips the
        division (as Dr. GRPO does). Mean and std are over the whole group, even on a rank holding part of it."""
        means = np.array([s.mean() for s in self.group_scores], F64)
        stds = np.array([s.std() for s in self.group_scores], F64)
        centred: np.ndarray = self.scores - means[self.group_index]
        if scale:
            centred = centred / (stds[self.group_index] + eps)
        return centred.astype(F32)

    @property
    def advantages(self) -> np.ndarray:
        """Per token, float32 [T]: the handler's advantages where it sent them, else the sequence's
        group-normalised GRPO advantage repeated over its tokens."""
        computed = np.repeat(self.grpo_advantages(), self.lengths)
        sent = self.floats.get("advantages")
        return computed if sent is None else np.where(np.isnan(sent), computed, sent)

    def padded(self, *, pad_to_multiple_of: int = 1, pad_id: int = 0) -> Padded:
        """`[n, L]` arrays, `L` the longest sequence rounded up to a multiple of `pad_to_multiple_of`.

        Built row by row with slice copies (memory speed, no per-token index arrays); when every sequence
        is exactly `L` long the arrays are reshaped views of the batch's own, with no copy at all."""
        if pad_to_multiple_of < 1:
            raise ValueError("pad_to_multiple_of must be at least 1")
        lengths = self.lengths
        longest = int(lengths.max()) if self.n_seqs else 0
        width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
        attention = np.arange(width) < lengths[:, None]
        sent = self.floats.get("advantages")
        flats: list[Fill] = [(self.tokens, pad_id, I32), (self.masks, MASK_IGNORE, I32)]
        flats += [(v, 0.0, F32) for v in self.floats.values()]
        if self.weight_versions is not None:
            flats.append((self.weight_versions, NO_VERSION, I64))
        if sent is not None:
            flats.append((self.advantages, 0.0, F32))
        out = _pad_rows(self.offsets, width, flats)
        if sent is None:  # one value per sequence: filled per row, never repeated over every token first
            advantages = np.where(attention, self.grpo_advantages()[:, None], np.float32(0))
        else:
            advantages = out.pop()
        versions = out.pop() if self.weight_versions is not None else None
        return Padded(
            tokens=out[0],
            masks=out[1],
            attention_mask=attention,
            advantages=advantages,
            floats=dict(zip(self.floats, out[2:], strict=True)),
            weight_versions=versions,
        )

    def packed(self, max_len: int, *, pad_id: int = 0) -> Packed:
        """Rows of at most `max_len` tokens, sequences placed first-fit-decreasing (longest first, each into
        the first row with room). Raises ValueError if a sequence is longer than `max_len`.

        Each sequence is one slice copy into its row (no per-token index arrays)."""
        lengths = self.lengths
        row, start = first_fit_decreasing(lengths, max_len)
        n_rows = int(row.max()) + 1 if self.n_seqs else 0
        shape = (n_rows, max_len)
        order = np.lexsort((start, row))  # by row, then by column: each row's sequences in placement order
        cu: list[np.ndarray] = []
        bounds = np.searchsorted(row[order], np.arange(n_rows + 1))
        for k in range(n_rows):
            members = order[bounds[k] : bounds[k + 1]]
            cu.append(np.concatenate([[0], np.cumsum(lengths[members])]).astype(I32))
        tokens = np.full(shape, pad_id, I32)
        masks = np.full(shape, MASK_IGNORE, I32)
        position_ids = np.zeros(shape, I32)
        segment_ids = np.full(shape, -1, I32)
        advantages = np.zeros(shape, F32)
        floats = {k: np.zeros(shape, F32) for k in self.floats}
        flat_adv = self.advantages
        ramp = np.arange(max_len, dtype=I32)
        pairs: list[tuple[np.ndarray, np.ndarray]] = [(tokens, self.tokens), (masks, self.masks)]
        pairs.append((advantages, flat_adv))
        pairs += [(floats[k], v) for k, v in self.floats.items()]
        versions = None
        if self.weight_versions is not None:
            versions = np.full(shape, NO_VERSION, I64)
            pairs.append((versions, self.weight_versions))
        bounds_ = zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist(), row.tolist(), start.tolist(), strict=True)
        for i, (a, b, r, c) in enumerate(bounds_):
            n = b - a
            for dst, src in pairs:
                dst[r, c : c + n] = src[a:b]
            position_ids[r, c : c + n] = ramp[:n]
            segment_ids[r, c : c + n] = i
        return Packed(
            tokens=tokens,
            masks=masks,
            position_ids=position_ids,
            segment_ids=segment_ids,
            advantages=advantages,
            row=row.astype(I32),
            start=start.astype(I32),
            cu_seqlens=cu,
            floats=floats,
            weight_versions=versions,
        )

    def to_torch(self, device: Any = None, *, non_blocking: bool = True) -> dict[str, Any]:
        """The flat arrays as tensors: `tokens`, `labels`, `offsets`, `group_index` int64, `trained` bool,
        `scores` float64, `advantages` and the floats float32 (as `Padded.to_torch`)."""
        arrays = {
            **self.floats,
            "tokens": self.tokens,
            "masks": self.masks,
            "offsets": self.offsets,
            "scores": self.scores,
            "advantages": self.advantages,
            "group_index": self.group_index,
        }
        if self.weight_versions is not None:
            arrays["weight_versions"] = self.weight_versions
        return to_tensors(arrays, device, non_blocking=non_blocking)


def trained_positions(masks: np.ndarray) -> np.ndarray:
    """Atropos's rule, in one place: a position is trained on unless its mask is -100."""
    trained: np.ndarray = np.asarray(masks) != MASK_IGNORE
    return trained


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin packing: (row, start column) per item. Items are placed longest first (ties: lower index first),
    each into the lowest-numbered row with room. Uses at most 11/9 OPT + 6/9 rows."""
    lengths = np.asarray(lengths, I64)
    if lengths.size and int(lengths.max()) > capacity:
        i = int(np.argmax(lengths > capacity))
        raise ValueError(f"sequence {i} has {int(lengths[i])} tokens; packed rows hold at most {capacity}")
    row = np.empty(lengths.shape[0], I64)
    start = np.empty(lengths.shape[0], I64)
    used = np.zeros(max(1, lengths.shape[0]), I64)  # at most one row per item
    n_rows = 0
    for i in np.argsort(-lengths, kind="stable").tolist():
        fits = np.flatnonzero(used[:n_rows] + lengths[i] <= capacity)
        k = int(fits[0]) if fits.size else n_rows
        n_rows = max(n_rows, k + 1)
        row[i], start[i] = k, used[k]
        used[k] += lengths[i]
    return row, start


Fill = tuple[np.ndarray, Any, np.dtype[Any]]
"""A flat array, the value after each sequence, the dtype of the result."""


def _pad_rows(offsets: np.ndarray, width: int, flats: Sequence[Fill]) -> list[np.ndarray]:
    """Each flat `[T]` array as `[n, width]` rows, `fill` after each sequence: one slice copy per row and array,
    or a reshaped view when every sequence is exactly `width` long."""
    n = offsets.shape[0] - 1
    lengths = np.diff(offsets)
    if n and bool((lengths == width).all()):
        return [flat.astype(dtype, copy=False).reshape(n, width) for flat, _, dtype in flats]
    outs = [np.zeros((n, width), dtype) if fill == 0 else np.full((n, width), fill, dtype) for _, fill, dtype in flats]
    pairs = [(out, flat) for out, (flat, _, _) in zip(outs, flats, strict=True)]
    for i, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)):
        for out, flat in pairs:
            out[i, : b - a] = flat[a:b]
    return outs


# ------------------------------------------------------------------------------------------- building


def from_records(records: Sequence[GroupRecord], step: int | None) -> Batch:
    """A batch from binary group records (`api.wire.records.decode_batch`): a few concatenations, no per-token loop."""
    lengths = [r.lengths for r in records]
    group_sizes = np.fromiter((r.seqs for r in records), I64, count=len(records))
    offsets = np.zeros(int(group_sizes.sum()) + 1, I64)
    if len(records):
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    floats = {}
    for name in FLOAT_FIELDS:
        if any(name in r.floats for r in records):
            parts = [r.floats[name] if name in r.floats else np.full(r.n_tokens, np.nan, F32) for r in records]
            floats[name] = _concat(parts, F32)
    versions = None
    if any(r.weight_versions is not None for r in records):
        parts = [
            np.full(r.n_tokens, NO_VERSION, I64) if r.weight_versions is None else r.weight_versions for r in records
        ]
        versions = _concat(parts, I64)
    return Batch(
        step=step,
        tokens=_concat([r.tokens for r in records], I32),
        masks=_concat([r.masks for r in records], I32),
        offsets=offsets,
        scores=_concat([r.scores for r in records], F64),
        group_index=np.repeat(np.arange(len(records), dtype=I32), group_sizes),
        env_ids=np.repeat(np.array([NO_ENV if r.env_id is None else r.env_id for r in records], I32), group_sizes),
        policy_steps=np.repeat(np.array([r.policy_step for r in records], I64), group_sizes),
        floats=floats,
        group_scores=[np.asarray(r.meta.get("group_scores", r.scores), F64) for r in records],
        group_ids=[r.group_id for r in records],
        meta=[{k: v for k, v in r.meta.items() if k != "group_scores"} for r in records],
        weight_versions=versions,
    )


def from_json(groups: Iterable[Mapping[str, Any]], step: int | None) -> Batch:
    """A batch from the Atropos JSON reply's `batch` list (per-sequence lists of numbers)."""
    groups = list(groups)
    rows = [g["tokens"] for g in groups]
    lengths = np.fromiter((len(t) for r in rows for t in r), I64)
    sizes = np.fromiter((len(r) for r in rows), I64, count=len(rows))
    total = int(lengths.sum())
    offsets = np.zeros(lengths.shape[0] + 1, I64)
    np.cumsum(lengths, out=offsets[1:])

    def flat(key: str, dtype: np.dtype[Any]) -> np.ndarray:
        return np.fromiter(chain.from_iterable(chain.from_iterable(g[key] for g in groups)), dtype, count=total)

    floats = {}
    for name in FLOAT_FIELDS:
        if any(g.get(name) is not None for g in groups):
            parts = [
                np.fromiter(chain.from_iterable(g[name]), F32)
                if g.get(name) is not None
                else np.full(sum(map(len, g["tokens"])), np.nan, F32)
                for g in groups
            ]
            floats[name] = _concat(parts, F32)
    versions = None
    if any(g.get(VERSIONS_FIELD) is not None for g in groups):
        parts = [
            np.fromiter(chain.from_iterable(g[VERSIONS_FIELD]), I64)
            if g.get(VERSIONS_FIELD) is not None
            else np.full(sum(map(len, g["tokens"])), NO_VERSION, I64)
            for g in groups
        ]
        versions = _concat(parts, I64)
    skip = {
        "tokens",
        "masks",
        "scores",
        "env_id",
        "policy_step",
        "group_id",
        "group_scores",
        VERSIONS_FIELD,
        *FLOAT_FIELDS,
    }
    return Batch(
        step=step,
        tokens=flat("tokens", I32),
        masks=flat("masks", I32),
        offsets=offsets,
        scores=np.fromiter(chain.from_iterable(g["scores"] for g in groups), F64, count=lengths.shape[0]),
        group_index=np.repeat(np.arange(len(groups), dtype=I32), sizes),
        env_ids=np.repeat(np.array([_or(g.get("env_id"), NO_ENV) for g in groups], I32), sizes),
        policy_steps=np.repeat(np.array([_or(g.get("policy_step"), -1) for g in groups], I64), sizes),
        floats=floats,
        group_scores=[np.asarray(g.get("group_scores") or g["scores"], F64) for g in groups],
        group_ids=[g.get("group_id") for g in groups],
        meta=[{k: v for k, v in g.items() if k not in skip and v is not None} for g in groups],
        weight_versions=versions,
    )


def _or(value: Any, default: int) -> Any:
    return default if value is None else value


def _concat(parts: Sequence[np.ndarray], dtype: np.dtype[Any]) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)
