"""Rollouts checked when they are acknowledged (api/rollouts/checks.py), property-tested through the service's
transactions over a memory store: whatever a post holds (token ids past int32 or 64 bits, sequences past the
trainer's `max_token_len`, NaN and infinite scores and logprobs, records with lone surrogates, deep nesting or huge
integers, a `policy_step` ahead of the trainer), it is refused at the post with a 422 naming one of its fields, or
the group sealed from it passes ingest (`submissions.decode`, what POST /scored_data runs); and it is refused at the
post exactly when the same rollouts sent as a whole group are refused. Opens and seals alike."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from api.config.settings import Settings
from api.errors import Conflict, InvalidData
from api.ingest.queue_limits import QueueLimits
from api.ingest.submissions import decode
from api.ingest.validation import check_policy_step
from api.owners import ANYONE
from api.rollouts import txns as rs
from api.run import state
from api.run.state import RunState
from api.store.memory import MemoryTxn, State
from api.wire.records import MSGPACK
from api.wire.rollouts import OpenRequest, RolloutPost, SealRequest
from api.wire.schema import Registration
from tests.factories import registration

STEP = 3
BATCH, MAX_LEN = 8, 64
LIMITS = QueueLimits()
SETTINGS = Settings(store="memory://")
POST_FIELDS = set(RolloutPost.model_fields)

text = st.text(st.characters(categories=["Cs", "Ll", "Nd", "Cc"]), max_size=4)
"""Lone surrogates (a JSON `\\ud800` decodes to one), Unicode digits, control characters."""
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | text
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8
)


def nest(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


nested = st.integers(25, 40).map(nest)
"""Lists nested around the records' bound (MAX_META_DEPTH): some pass, some do not."""
ids = st.integers(0, 1000) | st.integers(-(2**70), 2**70)


@st.composite
def rollouts(draw: st.DrawFn) -> dict[str, Any]:
    tokens = draw(st.lists(ids, min_size=1, max_size=MAX_LEN + 8))
    n = len(tokens)
    masks = draw(st.just(tokens) | st.lists(st.integers(-(2**40), 2**40), min_size=n, max_size=n))
    body: dict[str, Any] = {"tokens": tokens, "masks": masks, "score": draw(st.floats())}
    if draw(st.booleans()):
        body["inference_logprobs"] = draw(st.lists(st.floats(), min_size=n, max_size=n))
    if draw(st.booleans()):
        body["policy_step"] = draw(st.integers(0, 2 * STEP))
    if draw(st.booleans()):
        body["overrides"] = draw(st.dictionaries(text, json_values | nested, max_size=3))
    return body


def started(max_batch_tokens: int | None = None) -> tuple[MemoryTxn, RunState]:
    """A store whose trainer registered (batch 8, `max_token_len` 64) and is at step 3."""
    txn = MemoryTxn(State())
    reg = Registration.model_validate(
        registration(batch_size=BATCH, max_token_len=MAX_LEN, max_batch_tokens=max_batch_tokens)
    )
    state.save_run(txn, reg, started=True)
    state.save_step(txn, STEP)
    return txn, state.load(txn)


def opened(txn: MemoryTxn, key: str, size: int = 2) -> None:
    req = OpenRequest(group_id=key, producer_id="p1", group_size=size, deadline_s=600.0)
    rs.open_txn(txn, req, 0.0, SETTINGS, ANYONE, limits=LIMITS)


def refused_at_ingest(raw: bytes, run: RunState, content_type: str = "application/json") -> bool:
    """Whether POST /scored_data refuses this group (JSON, or a sealed group's msgpack record): its validation, and
    the transaction's one check of the data (`policy_step` against the run's step)."""
    try:
        [sub] = decode(raw, content_type, run, LIMITS, many=False)
        check_policy_step(sub.sent_policy_step, run.step)
    except (InvalidData, RequestValidationError):
        return True
    return False


@settings(max_examples=300, deadline=None)
@given(rollouts())
@example({"tokens": [2**40, 1], "masks": [1, 1], "score": 1.0})  # the findings: acknowledged, then refused
@example({"tokens": [-5, 1], "masks": [1, 1], "score": 1.0})
@example({"tokens": [1] * (MAX_LEN + 3000), "masks": [1] * (MAX_LEN + 3000), "score": 1.0})
@example({"tokens": [1], "masks": [1], "score": math.nan})  # was stored as null: unscored until its deadline
@example({"tokens": [1], "masks": [1], "score": 1.0, "overrides": {"a": ["\ud800"], "\udfff": 1}})
@example({"tokens": [1], "masks": [1], "score": 1.0, "policy_step": STEP + 1})
@example({"tokens": [0], "masks": [0], "score": 0.0, "overrides": {"\ud800\udc00": [[[[0]]]]}})
def test_a_rollout_is_refused_at_its_post_or_its_sealed_group_passes_ingest(rollout: dict[str, Any]) -> None:
    txn, run = started()
    opened(txn, "g")
    try:
        # As the route reads it: from the JSON text, which is what ingest reads too (a Python string holding
        # the two halves of a surrogate pair is refused as lone surrogates; its JSON text is one character).
        post = RolloutPost.model_validate_json(json.dumps({"group_id": "g", "slot": 0, "producer_id": "p1", **rollout}))
    except ValidationError:
        return  # the route's own 422
    try:
        for slot in (0, 1):  # two of the same: a group of G=2
            _, sealing = rs.post_txn(txn, post.model_copy(update={"slot": slot}), 0.0, SETTINGS, limits=LIMITS)
    except (InvalidData, Conflict) as exc:  # a Conflict: valid in itself, ahead of the run's step now
        assert exc.loc[0] == "body" and exc.loc[1] in POST_FIELDS | {"score"}, exc.loc
        assert txn.rollouts.slots("g") == [], "a refused rollout was stored"
        refused = True
    else:
        assert sealing, "the second of two scored rollouts seals the group"
        body = rs.group_body(txn, "g")
        assert body is not None
        assert not refused_at_ingest(body, run, MSGPACK), f"acknowledged, then refused at ingest: {rollout}"
        refused = False
    whole = {
        "tokens": [rollout["tokens"]] * 2,
        "masks": [rollout["masks"]] * 2,
        "scores": [rollout["score"]] * 2,
        "group_id": "whole",
        "policy_step": rollout.get("policy_step"),
    }
    if "inference_logprobs" in rollout:
        whole["inference_logprobs"] = [rollout["inference_logprobs"]] * 2
    if "overrides" in rollout:
        whole["overrides"] = [rollout["overrides"]] * 2
    assert refused_at_ingest(json.dumps(whole).encode(), run) == refused, "the post and ingest disagree"


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 2 * BATCH), text | st.just("p1"), json_values | nested)
def test_an_open_is_refused_or_its_group_can_be_served(size: int, producer: str, task: Any) -> None:
    """G within the trainer's batch, a producer id a sealed group may carry, a task every sibling lease can carry."""
    txn, run = started()
    try:
        req = OpenRequest(group_id="g", producer_id=producer, group_size=size, deadline_s=60.0, task=task)
    except ValidationError:
        return
    try:
        rs.open_txn(txn, req, 0.0, SETTINGS, ANYONE, limits=LIMITS)
    except InvalidData as exc:
        assert exc.loc[:2] in (("body", "group_size"), ("body", "producer_id"), ("body", "task")), exc.loc
        assert txn.rollouts.get("g") is None
        return
    assert size <= BATCH and producer.isprintable()
    json.dumps(task, allow_nan=False, ensure_ascii=False).encode()  # what a lease reply holds, without a surrogate
    whole = {"tokens": [[1]] * size, "masks": [[1]] * size, "scores": [0.0] * size, "producer_id": producer}
    assert not refused_at_ingest(json.dumps(whole).encode(), run)


def test_a_groups_tokens_stay_within_the_trainers_token_budget_as_rollouts_arrive() -> None:
    """With `max_batch_tokens`, a rollout that would take its group's acknowledged tokens past it is refused at its
    post (the group, sealed with every slot, would be); a duplicate of an acknowledged one is not counted twice."""
    txn, _ = started(max_batch_tokens=100)
    opened(txn, "g", size=4)

    def post(slot: int, n: int) -> str:
        body = {"group_id": "g", "slot": slot, "producer_id": "p1", "tokens": [1] * n, "masks": [1] * n, "score": 1.0}
        reply, _ = rs.post_txn(txn, RolloutPost.model_validate(body), 0.0, SETTINGS, limits=LIMITS)
        return reply.status

    assert post(0, 40) == "accepted" and post(1, 40) == "accepted"
    assert post(1, 40) == "duplicate"
    with pytest.raises(InvalidData) as refused:
        post(2, 21)
    assert refused.value.loc == ("body", "tokens") and "max_batch_tokens of 100" in refused.value.msg
    assert post(2, 20) == "accepted"
    assert txn.rollouts.get("g").tokens == 100  # type: ignore[union-attr]


def test_a_group_opened_before_the_trainer_had_a_budget_counts_its_tokens_from_its_rollouts() -> None:
    """A group's tokens are counted with every slot (`GroupRow.tokens`), so a budget the trainer registers while
    the group is open holds its next rollouts to what is already in."""
    txn, _ = started()
    opened(txn, "g", size=4)
    body = {"group_id": "g", "slot": 0, "producer_id": "p1", "tokens": [1] * 60, "masks": [1] * 60, "score": 1.0}
    rs.post_txn(txn, RolloutPost.model_validate(body), 0.0, SETTINGS, limits=LIMITS)
    assert txn.rollouts.get("g").tokens == 60  # type: ignore[union-attr]
    state.save_run(
        txn,
        Registration.model_validate(registration(batch_size=BATCH, max_token_len=MAX_LEN, max_batch_tokens=100)),
        started=True,
    )
    with pytest.raises(InvalidData):
        rs.post_txn(
            txn,
            RolloutPost.model_validate({**body, "slot": 1, "tokens": [1] * 41, "masks": [1] * 41}),
            0.0,
            SETTINGS,
            limits=LIMITS,
        )


@given(st.dictionaries(st.sampled_from(["0", "1"]), st.floats(), min_size=2))
def test_a_seal_with_scores_that_are_not_finite_is_refused_and_leaves_the_group_open(scores: dict[str, float]) -> None:
    txn, _ = started()
    opened(txn, "g")
    for slot in (0, 1):
        body = {"group_id": "g", "slot": slot, "producer_id": "p1", "tokens": [1], "masks": [1]}
        rs.post_txn(txn, RolloutPost.model_validate(body), 0.0, SETTINGS, limits=LIMITS)
    seal = SealRequest(group_id="g", producer_id="p1", scores=scores)
    if all(math.isfinite(v) for v in scores.values()):
        assert rs.seal_txn(txn, seal, 0.0)
        return
    with pytest.raises(InvalidData) as refused:
        rs.seal_txn(txn, seal, 0.0)
    assert refused.value.loc[:2] == ("body", "scores") and not math.isfinite(scores[str(refused.value.loc[2])])
    assert txn.rollouts.get("g").state == "open"  # type: ignore[union-attr]
