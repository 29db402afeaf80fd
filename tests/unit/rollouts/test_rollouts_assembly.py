"""A sealed group assembled from its slots' stored records (api/rollouts/assembly.py), property-tested through the
service's transactions over a memory store: whatever rollouts were acknowledged (logprobs float32 or not, on every
slot or some, `overrides` on some, `policy_step` on some, scored at their post or at the seal), the group ingest
stores from the seal's binary body is the group stored from the same rollouts sent whole as JSON."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from api.config.settings import Settings
from api.ingest.queue_limits import QueueLimits
from api.ingest.submissions import decode
from api.owners import ANYONE
from api.rollouts import txns as rs
from api.run import state
from api.store.memory import MemoryTxn, State
from api.wire import records
from api.wire.records import MSGPACK
from api.wire.rollouts import OpenRequest, RolloutPost, SealRequest
from api.wire.schema import Registration
from tests.factories import registration

STEP = 3
LIMITS = QueueLimits()
SETTINGS = Settings(store="memory://")

logprob = st.sampled_from([-0.5, -0.25, 0.0]) | st.floats(-20.0, 0.0)
"""Float32-exact values (what inference engines send) and doubles that float32 would change."""
overrides = st.none() | st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 9) | st.text(max_size=3))


@st.composite
def rollout(draw: st.DrawFn, with_logprobs: bool) -> dict[str, Any]:
    n = draw(st.integers(1, 6))
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    body: dict[str, Any] = {
        "tokens": tokens,
        "masks": draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n)),
        "score": draw(st.none() | st.floats(-5, 5)),
    }
    if with_logprobs or draw(st.booleans()):
        body["inference_logprobs"] = draw(st.lists(logprob, min_size=n, max_size=n))
    if draw(st.booleans()):
        body["policy_step"] = draw(st.integers(0, STEP))
    if (o := draw(overrides)) is not None:
        body["overrides"] = o
    return body


@st.composite
def groups(draw: st.DrawFn) -> list[dict[str, Any]]:
    every = draw(st.booleans())  # logprobs on every slot (then the group has them), or on some
    return draw(st.lists(rollout(every), min_size=1, max_size=5))


def stored(txn: MemoryTxn, raw: bytes, content_type: str) -> records.GroupRecord:
    """The record ingest stores from this body (its payload, decoded as /batch serves it)."""
    [sub] = decode(raw, content_type, state.load(txn), LIMITS, many=False)
    return records.decode(sub.payload)


@settings(max_examples=200, deadline=None)
@given(groups(), st.data())
def test_the_sealed_group_is_the_group_sent_whole(posts: list[dict[str, Any]], data: st.DataObject) -> None:
    txn = MemoryTxn(State())
    state.save_run(txn, Registration.model_validate(registration(batch_size=8, max_token_len=64)), started=True)
    state.save_step(txn, STEP)
    g = len(posts)
    rs.open_txn(
        txn,
        OpenRequest(group_id="g", producer_id="p1", group_size=g, deadline_s=60.0),
        0.0,
        SETTINGS,
        ANYONE,
        limits=LIMITS,
    )
    for slot in data.draw(st.permutations(range(g))):  # in any order
        post = RolloutPost.model_validate({"group_id": "g", "slot": slot, "producer_id": "p1", **posts[slot]})
        rs.post_txn(txn, post, 0.0, SETTINGS, limits=LIMITS)
    scores = [p["score"] if p["score"] is not None else float(i) for i, p in enumerate(posts)]
    if any(p["score"] is None for p in posts):  # scored at the seal
        assert rs.seal_txn(
            txn, SealRequest(group_id="g", producer_id="p1", scores={str(i): s for i, s in enumerate(scores)}), 0.0
        )
    body = rs.group_body(txn, "g")
    assert body is not None, "sealing"
    whole: dict[str, Any] = {
        "tokens": [p["tokens"] for p in posts],
        "masks": [p["masks"] for p in posts],
        "scores": scores,
        "env_id": None,
        "group_id": "g",
        "producer_id": "p1",
    }
    if all("inference_logprobs" in p for p in posts):
        whole["inference_logprobs"] = [p["inference_logprobs"] for p in posts]
    if steps := [p["policy_step"] for p in posts if "policy_step" in p]:
        whole["policy_step"] = min(steps)
    if any("overrides" in p for p in posts):
        whole["overrides"] = [p.get("overrides") or {} for p in posts]
    sealed, sent = stored(txn, body, MSGPACK), stored(txn, json.dumps(whole).encode(), "application/json")
    for name in ("lengths", "tokens", "masks", "scores"):
        a, b = getattr(sealed, name), getattr(sent, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert sealed.floats.keys() == sent.floats.keys()
    for name, a in sealed.floats.items():
        assert a.dtype == sent.floats[name].dtype and np.array_equal(a, sent.floats[name]), name
    assert (sealed.meta, sealed.policy_step, sealed.group_id) == (sent.meta, sent.policy_step, sent.group_id)
