"""Invariants of batch formation, checked on generated queues (hypothesis) against brute force."""

from __future__ import annotations

import itertools
import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from api.batcher import (
    BatchSpec,
    EnvWindow,
    NoBatch,
    Plan,
    arrival_that_fills,
    plan_batch,
    scale_shares,
    take_window,
)
from api.items import ItemMeta

_ids = itertools.count(1)


def items(sizes: list[int], tokens_per_seq: int = 10, step: int = 0) -> list[ItemMeta]:
    return [ItemMeta(next(_ids), s, s * tokens_per_seq, step) for s in sizes]


def window(env_id: int, sizes: list[int], weight: float = 1.0, share: float = 0.0) -> EnvWindow:
    return EnvWindow(env_id, f"env{env_id}", weight, share, items(sizes))


@st.composite
def queues(draw: st.DrawFn, max_items: int = 6) -> tuple[list[EnvWindow], int]:
    batch_size = draw(st.integers(1, 24))
    n_envs = draw(st.integers(1, 3))
    raw_shares = {e: draw(st.one_of(st.none(), st.floats(0.05, 0.6))) for e in range(n_envs)}
    shares = scale_shares(raw_shares)
    windows = []
    for e in range(n_envs):
        uniform = draw(st.booleans())
        if uniform:
            size = draw(st.integers(1, 9))
            sizes = [size] * draw(st.integers(0, max_items))
        else:
            sizes = draw(st.lists(st.integers(1, 9), max_size=max_items))
        weight = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))
        windows.append(window(e, sizes, weight, shares.get(e, 0.0)))
    return windows, batch_size


def required(w: EnvWindow, batch_size: int) -> int:
    return math.ceil(w.min_share * batch_size - 1e-9)


def brute_force_exists(windows: list[EnvWindow], batch_size: int, prefix_only: bool) -> bool:
    per_env: list[list[int]] = []
    for w in windows:
        sizes = [m.seqs for m in w.items]
        if prefix_only:
            sums = {sum(sizes[:k]) for k in range(len(sizes) + 1)}
        else:
            sums = {sum(c) for r in range(len(sizes) + 1) for c in itertools.combinations(sizes, r)}
        per_env.append([s for s in sums if s >= required(w, batch_size)])
    return any(sum(combo) == batch_size for combo in itertools.product(*per_env))


def taken(plan: Plan, windows: list[EnvWindow]) -> dict[int, list[ItemMeta]]:
    by_id = {m.item_id: (w.env_id, m) for w in windows for m in w.items}
    out: dict[int, list[ItemMeta]] = {}
    for env, ids in plan.take.items():
        for i in ids:
            assert by_id[i][0] == env
            out.setdefault(env, []).append(by_id[i][1])
    return out


@settings(max_examples=400, deadline=None)
@given(queues())
def test_exact_fill_is_found_whenever_one_exists(case: tuple[list[EnvWindow], int]) -> None:
    windows, batch_size = case
    plan = plan_batch(windows, BatchSpec(batch_size), {})
    exists = brute_force_exists(windows, batch_size, prefix_only=False)
    assert isinstance(plan, Plan) == exists, plan
    if isinstance(plan, Plan):
        got = taken(plan, windows)
        ids = [i for ids in plan.take.values() for i in ids]
        assert len(ids) == len(set(ids)), "an item taken twice"
        assert plan.seqs == batch_size == sum(m.seqs for ms in got.values() for m in ms)
        for w in windows:
            assert sum(m.seqs for m in got.get(w.env_id, [])) >= required(w, batch_size), "minimum not met"
            order = [m.item_id for m in got.get(w.env_id, [])]
            assert order == sorted(order), "items of an env out of FIFO order"


@settings(max_examples=300, deadline=None)
@given(queues())
def test_fifo_prefixes_are_used_when_they_suffice(case: tuple[list[EnvWindow], int]) -> None:
    windows, batch_size = case
    if not brute_force_exists(windows, batch_size, prefix_only=True):
        return
    plan = plan_batch(windows, BatchSpec(batch_size), {})
    assert isinstance(plan, Plan)
    for w in windows:
        ids = plan.take.get(w.env_id, [])
        assert ids == [m.item_id for m in w.items[: len(ids)]], "skipped an older item of the same env"


def test_blocked_when_sizes_can_never_add_up() -> None:
    plan = plan_batch([window(0, [3] * 10)], BatchSpec(16), {})
    assert isinstance(plan, NoBatch) and plan.blocked
    assert "cannot add up to exactly batch_size 16" in plan.reason


def test_mixed_sizes_that_one_more_group_completes_are_waiting_not_blocked() -> None:
    """Groups of 6 and 8 filling 64: a queue that cannot add up now is no stall when arrivals can end it."""
    plan = plan_batch([window(0, [6] * 7 + [8] * 3)], BatchSpec(64), {})  # 66 queued, no subset is 64
    assert isinstance(plan, NoBatch) and not plan.blocked
    assert "one more group of" in plan.reason and "would form a batch" in plan.reason


@given(st.lists(st.integers(1, 12), min_size=1, max_size=12), st.integers(1, 48))
def test_a_stall_is_reported_exactly_when_no_arrival_of_the_queued_sizes_can_end_it(
    queued: list[int], batch_size: int
) -> None:
    """Brute force: some multiset of queued groups plus up to batch_size arrivals of queued sizes sums to it."""
    reach = {0}
    for n in queued:
        reach |= {r + n for r in reach if r + n <= batch_size}
    for _ in range(batch_size):
        reach |= {r + s for r in reach for s in set(queued) if r + s <= batch_size}
    assert (arrival_that_fills(queued, batch_size) is not None) == (batch_size in reach)


def test_waiting_is_not_blocked() -> None:
    plan = plan_batch([window(0, [4, 4])], BatchSpec(16), {})
    assert isinstance(plan, NoBatch) and not plan.blocked
    assert plan.reason == "waiting for data: 8 of 16 sequences queued"


def test_missing_minimum_blocks_with_reason() -> None:
    windows = [window(0, [4] * 8), window(1, [], share=0.25)]
    plan = plan_batch(windows, BatchSpec(16), {})
    assert isinstance(plan, NoBatch) and plan.blocked
    assert "env 'env1'" in plan.reason and "needs 4" in plan.reason


def test_mixed_sizes_not_powers_of_two() -> None:
    plan = plan_batch([window(0, [3] * 6), window(1, [5] * 4)], BatchSpec(16), {})
    assert isinstance(plan, Plan) and plan.seqs == 16  # 3+3+5+5 or 3*2+5*2


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=2, max_size=4),
    sizes=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=4, max_size=4),
)
def test_weights_are_tracked_over_many_batches(weights: list[float], sizes: list[int]) -> None:
    """With data always available, each env's share of sequences is within 3 points of its weight share."""
    batch_size, n_batches = 64, 150
    served: Counter[int] = Counter()
    credits: dict[int, float] = {}
    for _ in range(n_batches):
        windows = [window(e, [sizes[e]] * (batch_size // sizes[e]), w) for e, w in enumerate(weights)]
        plan = plan_batch(windows, BatchSpec(batch_size), credits)
        assert isinstance(plan, Plan)
        credits = plan.credits
        for env, ids in plan.take.items():
            served[env] += len(ids) * sizes[env]
    total_weight = sum(weights)
    for e, w in enumerate(weights):
        share = served[e] / (batch_size * n_batches)
        assert abs(share - w / total_weight) <= 0.03, (e, share, w / total_weight)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 400)), max_size=12),
    batch_size=st.integers(1, 16),
    max_tokens=st.integers(400, 2000),
)
def test_token_budget_is_never_exceeded(sizes: list[tuple[int, int]], batch_size: int, max_tokens: int) -> None:
    metas = [ItemMeta(next(_ids), s, s * t, 0) for s, t in sizes]
    metas = [m for m in metas if m.tokens <= max_tokens and m.seqs <= batch_size]  # ingest rejects the others
    plan = plan_batch([EnvWindow(0, "e", 1.0, 0.0, metas)], BatchSpec(batch_size, max_tokens, 0.9), {})
    if isinstance(plan, Plan):
        assert plan.tokens <= max_tokens and plan.seqs <= batch_size
        ids = plan.take[0]
        assert ids == [m.item_id for m in metas[: len(ids)]]
    else:
        # waiting only when everything queued fits and still falls short of the fill target
        assert sum(m.tokens for m in metas) < 0.9 * max_tokens and sum(m.seqs for m in metas) < batch_size


def test_token_mode_releases_when_next_group_cannot_fit() -> None:
    metas = [ItemMeta(next(_ids), 2, 600, 0), ItemMeta(next(_ids), 2, 600, 0)]
    plan = plan_batch([EnvWindow(0, "e", 1.0, 0.0, metas)], BatchSpec(8, 1000, 0.9), {})
    assert isinstance(plan, Plan) and plan.tokens == 600


def test_window_sets_stale_items_aside() -> None:
    metas = [ItemMeta(i, 4, 40, step) for i, step in enumerate([0, 5, 1, 6, 7, 8], start=1)]
    win = take_window(iter(metas), min_step=5, max_seqs=8)
    assert [m.item_id for m in win.stale] == [1, 3]
    assert [m.item_id for m in win.items] == [2, 4]


def test_window_reads_only_what_a_batch_needs() -> None:
    consumed = 0

    def head() -> itertools.count[int]:
        return itertools.count()

    def metas():  # type: ignore[no-untyped-def]
        nonlocal consumed
        for i in head():
            consumed += 1
            yield ItemMeta(i, 8, 80, 0)

    win = take_window(metas(), min_step=None, max_seqs=64)
    assert len(win.items) == 8 and consumed == 8


def test_shares_scaled_down_past_one() -> None:
    assert scale_shares({0: 0.6, 1: 0.9, 2: None}) == {0: 0.6 / 1.5, 1: 0.9 / 1.5}
    assert scale_shares({0: 0.2}) == {0: 0.2}
