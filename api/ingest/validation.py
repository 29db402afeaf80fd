"""Checks that protect the trainer, and packing of a JSON group into a record. Pure: no I/O.

The rules on arrays (`check_lengths`, `check_rows`, `check_values`) are the binary path's too, so the two
encodings accept the same groups.

Every rule raises `InvalidData` with the location of the offending field relative to the group, so the
route can prefix it with where the group sits in the request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from api.errors import InvalidData
from api.run.printable import check_printable
from api.wire.records import F32, F64, FLOAT_FIELDS, I32, META_FIELDS, VERSIONS_FIELD, GroupRecord, narrowest
from api.wire.rules import INT32_MAX, INT32_MIN, PRODUCER_ID_MAX
from api.wire.schema import ScoredData


@dataclass(frozen=True, slots=True)
class GroupLimits:
    """What the trainer's registration and the server's settings allow of one group."""

    max_token_len: int
    """Longest sequence (the trainer's `max_token_len`)."""
    max_group_seqs: int
    """Most sequences in one group: the batch size, or a smaller server limit."""
    max_group_tokens: int | None = None
    """Most tokens in one group: the trainer's token budget per batch, if any."""


@dataclass(frozen=True, slots=True)
class Column:
    """One per-token field of a group: its values over all sequences, flat, and each row's length."""

    values: np.ndarray
    """int64 for tokens and masks, float64 for the float fields (narrowed to float32 where exact)."""
    lengths: np.ndarray
    """int64, one per row as sent (checked against the tokens' rows by `pack_group`)."""


COLUMN_DTYPES: dict[str, np.dtype[Any]] = {
    "tokens": np.dtype(np.int64),
    "masks": np.dtype(np.int64),
    **{name: F64 for name in FLOAT_FIELDS},
    VERSIONS_FIELD: np.dtype(np.int64),
}
"""The per-token fields that become columns, and the dtype each is read into before checking."""


def columns_from_lists(sd: ScoredData) -> dict[str, Column]:
    """The per-token fields of a schema-validated group as columns (the JSON path when not read directly)."""
    columns = {}
    for name, dtype in COLUMN_DTYPES.items():
        rows = getattr(sd, name)
        if rows is None:
            continue
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        try:
            # Row by row, then one concatenate: about twice as fast as fromiter over a chain for floats.
            values = np.concatenate([np.asarray(row, dtype=dtype) for row in rows]) if rows else np.empty(0, dtype)
        except OverflowError:
            raise InvalidData((name,), "values must fit in int32") from None
        columns[name] = Column(values, lengths)
    return columns


def pack_group(
    sd: ScoredData,
    *,
    env_id: int | None,
    current_step: int,
    limits: GroupLimits,
    columns: Mapping[str, Column] | None = None,
) -> GroupRecord:
    """Validate one JSON group and pack it into flat arrays; raise InvalidData naming the field and the rule.

    `columns` are its per-token fields when the JSON was read straight into arrays; without them they are
    taken from `sd`'s lists. Every rule is checked here, on the columns, whichever way they were read.
    A group without `policy_step` is stamped with `current_step`; one with a `policy_step` is checked against
    the run's step in the store transaction (`check_policy_step`), where the step is current.
    """
    cols = columns_from_lists(sd) if columns is None else columns
    lengths = cols["tokens"].lengths
    check_lengths(lengths, limits, "tokens")
    n = lengths.shape[0]
    mask_lengths = cols["masks"].lengths
    if mask_lengths.shape[0] != n:
        raise InvalidData(("masks",), f"{mask_lengths.shape[0]} mask rows for {n} sequences: need one per sequence")
    wrong = mask_lengths != lengths
    if wrong.any():
        i = int(np.argmax(wrong))
        raise InvalidData(
            ("masks", i), f"{int(mask_lengths[i])} mask values for {int(lengths[i])} tokens: lengths must match"
        )
    if len(sd.scores) != n:
        raise InvalidData(("scores",), f"{len(sd.scores)} scores for {n} sequences: need one per sequence")
    floats: dict[str, np.ndarray] = {}
    for name in FLOAT_FIELDS:
        col = cols.get(name)
        if col is not None:
            check_rows(name, col.lengths, lengths)
            floats[name] = narrowest(col.values)  # float32 where exact, else float64: numbers as sent
    check_distill(sd, lengths)
    versions = cols.get(VERSIONS_FIELD)
    if versions is not None:
        check_rows(VERSIONS_FIELD, versions.lengths, lengths)
        check_versions(lengths, versions.values)
    tokens, masks = cols["tokens"].values, cols["masks"].values
    scores = np.asarray(sd.scores, dtype=F64)
    check_values(lengths, tokens, masks, scores, floats)

    meta = {name: getattr(sd, name) for name in META_FIELDS if getattr(sd, name) is not None}
    check_printable(meta)
    return GroupRecord(
        env_id=env_id,
        lengths=lengths.astype(I32),
        tokens=tokens.astype(I32),
        masks=masks.astype(I32),
        scores=scores,
        policy_step=current_step if sd.policy_step is None else sd.policy_step,
        group_id=sd.group_id,
        floats=floats,
        meta=meta,
        producer_id=check_producer_id(sd.producer_id),
        weight_versions=None if versions is None else versions.values.astype(I32),
    )


# ------------------------------------------------------------------ the rules, shared with the binary path


def check_lengths(lengths: np.ndarray, limits: GroupLimits, field: str) -> int:
    """Sequences per group and tokens per sequence within the trainer's limits; returns the group's tokens.

    Errors are located at `field`: the JSON path's tokens, the binary path's lengths."""
    n = lengths.shape[0]
    if n == 0:
        raise InvalidData((field,), "a group needs at least one sequence")
    if n > limits.max_group_seqs:
        raise InvalidData((field,), f"{n} sequences in one group; at most {limits.max_group_seqs} are accepted")
    # Two reductions on the good path (numpy's per-call cost, not the values, is what a small group pays);
    # the offending index is looked for only when there is one.
    if int(np.minimum.reduce(lengths)) <= 0 or int(np.maximum.reduce(lengths)) > limits.max_token_len:
        i = int(np.argmax((lengths <= 0) | (lengths > limits.max_token_len)))
        length = int(lengths[i])
        if length > limits.max_token_len:
            rule = f"{length} tokens exceed the trainer's max_token_len of {limits.max_token_len}"
            raise InvalidData((field, i), rule)
        raise InvalidData((field, i), "empty sequence" if length == 0 else "lengths must be positive")
    total = int(lengths.sum(dtype=np.int64))
    if limits.max_group_tokens is not None and total > limits.max_group_tokens:
        rule = f"{total} tokens in one group exceed the trainer's max_batch_tokens of {limits.max_group_tokens}"
        raise InvalidData((field,), rule)
    return total


def check_rows(name: str, row_lengths: np.ndarray, lengths: np.ndarray) -> None:
    """One row per sequence, each as long as its tokens."""
    if row_lengths.shape[0] != lengths.shape[0]:
        raise InvalidData(
            (name,), f"{row_lengths.shape[0]} rows for {lengths.shape[0]} sequences: need one per sequence"
        )
    wrong = row_lengths != lengths
    if wrong.any():
        i = int(np.argmax(wrong))
        raise InvalidData((name, i), f"{int(row_lengths[i])} values for {int(lengths[i])} tokens: lengths must match")


def check_producer_id(value: object) -> str | None:
    """A group's `producer_id` (both paths): printable text, as the ledger stores and every view prints it."""
    if value is None or (isinstance(value, str) and 1 <= len(value) <= PRODUCER_ID_MAX and value.isprintable()):
        return value
    raise InvalidData(("producer_id",), f"must be a string of 1 to {PRODUCER_ID_MAX} printable characters, or null")


MAX_DISTILL_K = 1024
"""Most candidates per position in `distill_token_ids` / `distill_logprobs` (top-K distillation uses tens)."""


def check_distill(sd: ScoredData, lengths: np.ndarray) -> None:
    """`distill_*`: one row per sequence, a position per token, at most MAX_DISTILL_K candidates at each."""
    for name in ("distill_token_ids", "distill_logprobs"):
        rows = getattr(sd, name)
        if rows is None:
            continue
        check_rows(name, np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)), lengths)
        for i, row in enumerate(rows):
            k = max(map(len, row), default=0)
            if k > MAX_DISTILL_K:
                raise InvalidData((name, i), f"{k} candidates at one position; at most {MAX_DISTILL_K} are accepted")


def check_values(
    lengths: np.ndarray, tokens: np.ndarray, masks: np.ndarray, scores: np.ndarray, floats: Mapping[str, np.ndarray]
) -> None:
    """Token ids are in 0..int32 max, masks are any int32 (stored as sent: handlers use -100 / token id,
    0/1 and other conventions), scores and per-token floats are finite."""
    # int32 arrays (the binary path's) hold no value past int32: their bounds need no pass but the sign's.
    narrow = tokens.dtype.itemsize <= 4
    if tokens.size and (np.minimum.reduce(tokens) < 0 or (not narrow and np.maximum.reduce(tokens) > INT32_MAX)):
        bad = (tokens < 0) | (tokens > INT32_MAX)
        seq, offset = _position(lengths, int(np.argmax(bad)))
        value = int(tokens[int(np.argmax(bad))])
        rule = "token ids must be >= 0" if value < 0 else "token ids must fit in int32"
        raise InvalidData(("tokens", seq, offset), f"{rule}, got {value}")
    if masks.size and masks.dtype.itemsize > 4 and (masks.min() < INT32_MIN or masks.max() > INT32_MAX):
        seq, offset = _position(lengths, int(np.argmax((masks < INT32_MIN) | (masks > INT32_MAX))))
        raise InvalidData(("masks", seq, offset), "mask values must fit in int32")
    check_scores(scores)
    for name, values in floats.items():
        if not finite_as_f32(values):
            raise InvalidData((name,), "values must be finite float32 (no NaN, no infinity, none beyond 3.4e38)")


def check_scores(scores: np.ndarray) -> None:
    """Every score finite: NaN or infinity would poison the trainer's advantages (a producer's seal checks its
    group's scores with this too)."""
    finite = np.isfinite(scores)
    if not np.logical_and.reduce(finite):
        raise InvalidData(("scores", int(np.argmin(finite))), "scores must be finite (no NaN or infinity)")


F32_OVERFLOW = 2.0**128 - 2.0**103
"""The smallest magnitude a float64 rounds to float32 infinity from (halfway past float32's largest value)."""


def finite_as_f32(values: np.ndarray) -> bool:
    """Whether every value is finite as the trainer gets it: cast to float32, where past about 3.4e38 is infinity.

    Two reductions and no copy for float64 (a cast, an `errstate` and `isfinite` cost a small group three times
    as much); NaN fails both comparisons."""
    if not values.size:
        return True
    if values.dtype == F32:
        return bool(np.logical_and.reduce(np.isfinite(values)))
    return bool(-F32_OVERFLOW < np.minimum.reduce(values) and np.maximum.reduce(values) < F32_OVERFLOW)


def check_versions(lengths: np.ndarray, versions: np.ndarray) -> None:
    """Per-token weight versions (both paths) are trainer steps: from 0 to int32's largest, as they are stored.
    Whether they are ahead of the trainer is known in the store transaction (`check_versions_step`)."""
    if versions.size and (np.minimum.reduce(versions) < 0 or np.maximum.reduce(versions) > INT32_MAX):
        flat = int(np.argmax((versions < 0) | (versions > INT32_MAX)))
        seq, offset = _position(lengths, flat)
        value = int(versions[flat])
        rule = "weight versions must be >= 0" if value < 0 else "weight versions must fit in int32"
        raise InvalidData((VERSIONS_FIELD, seq, offset), f"{rule}, got {value}")


def check_versions_step(rec: GroupRecord, current_step: int) -> None:
    """No token comes from weights the trainer has not produced yet: every per-token weight version is at most the
    run's current step, as `policy_step` is (`check_policy_step`). A token ahead of the trainer would never be
    masked or dropped as stale."""
    versions = rec.weight_versions
    if versions is None or not versions.size or int(np.maximum.reduce(versions)) <= current_step:
        return
    flat = int(np.argmax(versions > current_step))
    seq, offset = _position(rec.lengths, flat)
    rule = f"{int(versions[flat])} is ahead of the trainer, which is at step {current_step}"
    raise InvalidData((VERSIONS_FIELD, seq, offset), rule)


def check_policy_step(policy_step: int | None, current_step: int) -> None:
    """A group cannot come from weights the trainer has not produced yet: `policy_step` is at most the
    run's current step (its `starting_step` before the first batch). Such a group would never be dropped
    as stale. Absent (Atropos handlers never send it), the server stamps the current step."""
    if policy_step is not None and policy_step > current_step:
        raise InvalidData(("policy_step",), f"{policy_step} is ahead of the trainer, which is at step {current_step}")


def _position(lengths: np.ndarray, flat: int) -> tuple[int, int]:
    """(sequence, offset in it) of a flat token index."""
    ends = np.cumsum(lengths)
    seq = int(np.searchsorted(ends, flat, side="right"))
    start = int(ends[seq - 1]) if seq else 0
    return seq, flat - start
