"""A rollbuf batch as the per-sequence samples of a trainer that takes one sample per sequence (TRL's async GRPO
`RolloutSample`), and the policy versions they carry. Pure: no TRL, no I/O (`trl_worker` does the reading).

Versions: a group generated with the weights of rollbuf step `p` (its `policy_step`) carries version
`p // sync_every + offset`, where `sync_every` is how many optimizer steps (= rollbuf batches) pass between two
weight syncs. The version is absolute (it follows rollbuf's step, which a resume does not reset); `offset` only
lines it up with the counter of the trainer consuming the samples (`version_offset`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainer_client.arrays import Batch

GROUP_ID_STRIDE = 1 << 20
"""Group ids are `step * GROUP_ID_STRIDE + group index`: unique across batches (no batch holds 2^20 groups)."""


class UnusableBatch(ValueError):
    """A batch a sample-per-sequence trainer cannot take: it lacks what the loss needs (old logprobs)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One sequence, with the fields of TRL's `RolloutSample` that training reads (`prompt` and `completion`,
    messages TRL only logs, are empty: rollbuf carries tokens)."""

    input_ids: np.ndarray
    """int64 [L]."""
    completion_mask: np.ndarray
    """bool [L]: the positions trained on (the sampled tokens)."""
    old_log_probs: np.ndarray
    """float32 [L]: the inference server's logprob of each trained token; 0 elsewhere."""
    advantage: float
    """The sequence's GRPO advantage (group-normalised score, or the handler's own)."""
    model_version: int
    group_id: int
    metrics: dict[str, float] = field(default_factory=dict)
    """rollbuf's view of it: `rollbuf/staleness` (batch step minus policy step), `rollbuf/env_id`, `reward`."""


def version_of(policy_step: int, sync_every: int) -> int:
    """The absolute policy version of the weights of rollbuf step `policy_step`."""
    return policy_step // sync_every


def version_offset(trainer_version: int, step: int, sync_every: int) -> int:
    """What to add to absolute versions so that the weights being trained at rollbuf `step` have the trainer's
    counter value `trainer_version` (TRL counts weight syncs from 0 in each process, so a resume restarts it)."""
    return trainer_version - version_of(step, sync_every)


def samples_of(batch: Batch, *, sync_every: int = 1, offset: int = 0) -> list[Sample]:
    """One sample per sequence of `batch`, in order. UnusableBatch when a trained position has no logprob."""
    if batch.step is None:
        raise UnusableBatch("the batch has no step: the server is not rollbuf, or it was asked for without ?step=")
    trained = batch.trained
    logprobs = batch.floats.get("inference_logprobs")
    if logprobs is None or np.isnan(logprobs[trained]).any():
        envs = sorted({int(e) for e in batch.env_ids})
        raise UnusableBatch(
            f"batch {batch.step} has trained tokens without inference_logprobs (envs {envs}): the loss needs the "
            "sampler's logprob of every trained token; send them with the groups"
        )
    old = np.where(trained, logprobs, 0.0).astype(np.float32)
    advantages = batch.advantages  # per token: the handler's where sent, else the group-normalised score
    tokens = batch.tokens.astype(np.int64)
    out: list[Sample] = []
    for i, (a, b) in enumerate(zip(batch.offsets[:-1].tolist(), batch.offsets[1:].tolist(), strict=True)):
        policy_step = int(batch.policy_steps[i])
        metrics: dict[str, Any] = {
            "rollbuf/staleness": float(batch.step - policy_step),
            "rollbuf/env_id": float(batch.env_ids[i]),
            "reward": float(batch.scores[i]),
        }
        out.append(
            Sample(
                input_ids=tokens[a:b].copy(),
                completion_mask=trained[a:b].copy(),
                old_log_probs=old[a:b].copy(),
                advantage=float(advantages[a:b][trained[a:b]].mean()) if trained[a:b].any() else 0.0,
                model_version=version_of(max(policy_step, 0), sync_every) + offset,
                group_id=batch.step * GROUP_ID_STRIDE + int(batch.group_index[i]),
                metrics=metrics,
            )
        )
    return out
