"""Rank shares: every sequence to exactly one rank, balanced, whole groups where that stays balanced."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from api.batches.sharding import BALANCE_TOLERANCE, rank_share, shard
from api.wire.records import GroupRecord


def record(lengths: list[int], gid: str) -> GroupRecord:
    ls = np.asarray(lengths, dtype=np.int32)
    total = int(ls.sum())
    tokens = np.arange(total, dtype=np.int32)
    return GroupRecord(
        env_id=0,
        lengths=ls,
        tokens=tokens,
        masks=tokens.copy(),
        scores=np.arange(len(ls), dtype=np.float64),
        policy_step=0,
        group_id=gid,
        floats={"inference_logprobs": tokens.astype(np.float32)},
        meta={"messages": [[{"role": "user", "content": str(i)}] for i in range(len(ls))], "generation_params": {}},
        weight_versions=tokens + 1000,
    )


groups_strategy = st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=6), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(groups_strategy, st.integers(1, 8), st.sampled_from(["tokens", "squared"]))
def test_every_sequence_goes_to_exactly_one_rank(groups: list[list[int]], world: int, cost: str) -> None:
    shares = shard([np.asarray(g) for g in groups], world, cost)  # type: ignore[arg-type]
    seen: dict[tuple[int, int], int] = {}
    for share in shares:
        for g, seqs in share:
            for i in range(len(groups[g])) if seqs is None else seqs.tolist():
                seen[(g, i)] = seen.get((g, i), 0) + 1
    assert seen == {(g, i): 1 for g, ls in enumerate(groups) for i in range(len(ls))}


@settings(max_examples=200, deadline=None)
@given(groups_strategy, st.integers(1, 8))
def test_whole_groups_kept_only_when_balanced(groups: list[list[int]], world: int) -> None:
    shares = shard([np.asarray(g) for g in groups], world)
    whole = all(seqs is None for share in shares for _, seqs in share)
    loads = [sum(sum(groups[g]) if s is None else sum(groups[g][i] for i in s) for g, s in share) for share in shares]
    even = sum(map(sum, groups)) / world
    if whole:
        assert all(shares) and max(loads) <= even * (1 + BALANCE_TOLERANCE) + 1e-9


def test_split_group_keeps_per_sequence_fields_aligned() -> None:
    recs = [record([5, 7, 9], "a")]
    parts = [rank_share(recs, r, 2) for r in range(2)]
    got = sorted(
        (int(p.lengths[0]), p.tokens.tolist(), p.meta["messages"][0][0]["content"])
        for share in parts
        for p in share
        for _ in [0]
        if p.seqs == 1
    )
    assert all(len(tokens) == length for length, tokens, _ in got)
    for share in parts:
        for p in share:
            assert p.meta["group_scores"] == [0.0, 1.0, 2.0]
            assert len(p.meta["messages"]) == p.seqs
            assert np.array_equal(p.floats["inference_logprobs"], p.tokens.astype(np.float32))
            assert p.weight_versions is not None and np.array_equal(p.weight_versions, p.tokens + 1000)
