"""An open group's spec, each rollout posted to it and a producer's seal, checked when they are acknowledged against
every rule their sealed group meets at ingest (api/ingest/validation.py, the same functions): what was acknowledged
is then never refused when the group is sealed. Pure: no store, no clock.

A rollout is checked as the one sequence of a group (`pack_group`): token ids in int32 and not negative, at most the
trainer's `max_token_len` tokens, masks and logprobs one per token and within their types, a finite score, its
record (`overrides`) as JSON can carry it. What only the whole group has is checked where it is known: G against
the trainer's batch size when the group opens, the group's tokens against a token budget as each rollout arrives.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from api.errors import Conflict, InvalidData
from api.ingest.validation import (
    GroupLimits,
    check_lengths,
    check_policy_step,
    check_producer_id,
    check_scores,
    check_versions_step,
    pack_group,
)
from api.run.printable import check_printable
from api.wire.records import F64, FLOAT_FIELDS, VERSIONS_FIELD, GroupRecord
from api.wire.rollouts import OpenRequest, RolloutPost
from api.wire.schema import ScoredData

PER_SEQUENCE = frozenset({"tokens", "masks", "scores", "overrides", VERSIONS_FIELD, *FLOAT_FIELDS})
"""A group's fields with a row per sequence: an error in one names the sequence, which a post does not have."""


def check_open(req: OpenRequest, limits: GroupLimits) -> None:
    """G within what the trainer serves in one batch (G one-token rollouts must fit as a group), the producer id as
    the sealed group's `producer_id` must be, and the task as JSON can carry it (it is stored, and handed out with
    every sibling lease)."""
    try:
        check_lengths(np.ones(req.group_size, dtype=np.int64), limits, "group_size")
        check_producer_id(req.producer_id)
        check_printable({"task": req.task})
    except InvalidData as exc:
        raise exc.at("body") from None


def check_rollout(
    req: RolloutPost, env_id: int | None, group_id: str, current_step: int, limits: GroupLimits
) -> GroupRecord:
    """The rollout as the one sequence of its group, under the rules of ingest; its `policy_step` at most the
    run's step (the sealed group's is the oldest of its rollouts', so one ahead is never acknowledged). Errors
    name the post's field (`body.tokens.5`, `body.score`). Returns it packed, as its slot stores it: what the seal
    concatenates (its score is the post's, 0.0 for none: scored at the seal)."""
    sd = ScoredData.model_construct(  # its fields were validated as the post's (strict types)
        tokens=[req.tokens],
        masks=[req.masks],
        scores=[0.0 if req.score is None else req.score],  # scored at the seal: checked there
        inference_logprobs=None if req.inference_logprobs is None else [req.inference_logprobs],
        overrides=None if req.overrides is None else [req.overrides],
        token_weight_versions=None if req.token_weight_versions is None else [req.token_weight_versions],
        env_id=env_id,
        group_id=group_id,
        policy_step=req.policy_step,
    )
    try:
        packed = pack_group(sd, env_id=env_id, current_step=current_step, limits=limits)
    except InvalidData as exc:
        raise _in_post(exc) from None
    try:
        check_policy_step(req.policy_step, current_step)
        check_versions_step(packed, current_step)
    except InvalidData as exc:  # valid in itself, refused by the run's state now: a conflict
        raise Conflict(exc.msg, loc=_in_post(exc).loc) from None
    return packed


def check_rollout_tokens(total: int, limits: GroupLimits) -> None:
    """A slot's rollout so far (its turns' tokens and a turn's) within the trainer's `max_token_len`, as its sealed
    rollout must be: each turn is checked alone, and its slot's length from the count its turns keep."""
    if total > limits.max_token_len:
        raise InvalidData(
            ("body", "tokens"), f"{total} tokens exceed the trainer's max_token_len of {limits.max_token_len}"
        )


def check_group_tokens(have: int, more: int, limits: GroupLimits) -> None:
    """The group's acknowledged tokens and this rollout's within the trainer's token budget per batch, if any (a
    sealed group may leave slots out, never add any: a total within the budget stays within it)."""
    if limits.max_group_tokens is not None and have + more > limits.max_group_tokens:
        rule = (
            f"{have} tokens acknowledged in this group and {more} more exceed the trainer's max_batch_tokens of "
            f"{limits.max_group_tokens}"
        )
        raise InvalidData(("body", "tokens"), rule)


def check_seal_scores(scores: dict[str, float]) -> None:
    """A producer's scores for its group, finite as ingest requires (named by slot)."""
    slots = list(scores)
    try:
        check_scores(np.fromiter(scores.values(), dtype=F64, count=len(slots)))
    except InvalidData as exc:
        raise InvalidData(("body", "scores", slots[int(exc.loc[1])]), exc.msg) from None


def _in_post(exc: InvalidData) -> InvalidData:
    """An error of the one-sequence group where the post has it: the sequence's index dropped (`tokens.0.5` is the
    post's `tokens.5`), `scores.0` its `score`."""
    loc: list[Any] = list(exc.loc)
    if len(loc) > 1 and loc[0] in PER_SEQUENCE and loc[1] == 0:
        del loc[1]
    if loc and loc[0] == "scores":
        loc[0] = "score"
    return InvalidData(("body", *loc), exc.msg)
