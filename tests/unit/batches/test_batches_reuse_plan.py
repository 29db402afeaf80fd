"""api.batches.reuse_plan: formation with reuse, checked on generated queues and pools (hypothesis) against brute
force: reused groups only where fresh ones cannot make the batch, never past their budget, age or share, never
without a learning signal; weights and minimum shares over the whole batch; no pool (or `max_served` 1) forms
exactly the batches `plan_batch` forms."""

from __future__ import annotations

import itertools
import math

from hypothesis import given
from hypothesis import strategies as st

from api.batches.planner import SMALLER, BatchSpec, EnvWindow, NoBatch, Plan, plan_batch
from api.batches.reuse_plan import (
    MISS_LIMIT,
    SCAN_LIMIT,
    Candidate,
    ReusePlan,
    candidate,
    eligible,
    offer,
    order_key,
    plan_with_reuse,
    share_seqs,
)
from api.run.state import scale_shares
from api.store.items import ItemMeta
from api.wire.replay import NO_REUSE, ReusePolicy

STEP = 20
POOL_IDS = itertools.count(1)  # pool groups were queued before any fresh one: smaller ids
FRESH_IDS = itertools.count(10**6)

policies_st = st.builds(
    ReusePolicy,
    max_served=st.integers(1, 4),
    max_age=st.none() | st.integers(0, 12),
    max_reused_share=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    order=st.sampled_from(["oldest", "advantage", "spread", "recent"]),
)


@st.composite
def candidates(draw: st.DrawFn) -> Candidate:
    seqs = draw(st.integers(1, 8))
    meta = ItemMeta(next(POOL_IDS), seqs, seqs * 10, draw(st.integers(0, STEP)))
    spread = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))
    return Candidate(meta, draw(st.integers(1, 4)), spread * draw(st.floats(0.5, 1.0)), spread)


@st.composite
def cases(
    draw: st.DrawFn,
) -> tuple[list[EnvWindow], int, dict[int, list[Candidate]], dict[int, ReusePolicy], float]:
    batch_size = draw(st.integers(1, 20))
    n_envs = draw(st.integers(1, 3))
    shares = scale_shares({e: draw(st.none() | st.floats(0.05, 0.6)) for e in range(n_envs)})
    windows, pools, policies = [], {}, {}
    for e in range(n_envs):
        sizes = draw(st.lists(st.integers(1, 8), max_size=5))
        fresh = [ItemMeta(next(FRESH_IDS), s, s * 10, STEP) for s in sizes]
        weight = draw(st.sampled_from([0.5, 1.0, 2.0]))
        windows.append(EnvWindow(e, f"env{e}", weight, shares.get(e, 0.0), fresh))
        policies[e] = draw(policies_st)
        pools[e] = sorted(draw(st.lists(candidates(), max_size=5)), key=lambda c, o=policies[e].order: order_key(o, c))
    return windows, batch_size, pools, policies, draw(st.sampled_from([0.25, 0.5, 1.0]))


def required(w: EnvWindow, batch_size: int) -> int:
    return math.ceil(w.min_share * batch_size - 1e-9)


def exact_fill_exists(windows: list[EnvWindow], batch_size: int) -> bool:
    """Brute force: some choice of items per env, each env at least its minimum, adds up to batch_size."""
    per_env = []
    for w in windows:
        sizes = [m.seqs for m in w.items]
        sums = {sum(c) for r in range(len(sizes) + 1) for c in itertools.combinations(sizes, r)}
        per_env.append([s for s in sums if s >= required(w, batch_size)])
    return any(sum(combo) == batch_size for combo in itertools.product(*per_env))


def with_offers(windows: list[EnvWindow], offers: dict[int, list[Candidate]]) -> list[EnvWindow]:
    return [EnvWindow(w.env_id, w.name, w.weight, w.min_share, [*w.items, *(c.meta for c in offers.get(w.env_id, []))])
            for w in windows]  # fmt: skip


@given(cases(), st.none() | st.integers(10, 200))
def test_reuse_holds_budgets_ages_shares_and_minimums(
    case: tuple[list[EnvWindow], int, dict[int, list[Candidate]], dict[int, ReusePolicy], float],
    max_tokens: int | None,
) -> None:
    """Exact mode and token mode (`max_tokens`) alike."""
    windows, batch_size, pools, policies, batch_share = case
    spec = BatchSpec(batch_size, max_tokens, no_exact_fill=SMALLER)
    out = plan_with_reuse(windows, spec, {}, pools, policies, batch_share, STEP)
    fresh = plan_batch(windows, spec, {})
    if isinstance(fresh, Plan) and not fresh.smaller:
        assert out == ReusePlan(fresh, {})  # fresh first: reuse never displaces a fresh batch
        return
    by_id = {c.meta.item_id: (env, c) for env, cs in pools.items() for c in cs}
    if isinstance(out, NoBatch):
        assert out == fresh
        return
    plan = out.plan
    reused_seqs: dict[int, int] = {}
    for item, serve in out.reused.items():
        env, c = by_id[item]
        assert item in plan.take[env] and serve == c.served + 1 <= policies[env].max_served
        assert eligible(c, policies[env], STEP) and c.spread > 0
        assert policies[env].max_age is None or STEP - c.meta.policy_step <= policies[env].max_age
        reused_seqs[env] = reused_seqs.get(env, 0) + c.meta.seqs
    for env, n in reused_seqs.items():
        assert n <= share_seqs(policies[env].max_reused_share, batch_size)
    assert sum(reused_seqs.values()) <= share_seqs(batch_share, batch_size)
    taken = {i for ids in plan.take.values() for i in ids}
    assert {i for i in taken if i in by_id} == set(out.reused)  # every pool group taken is counted as reused
    seqs = {env: 0 for env in range(len(windows))}
    sizes = {m.item_id: m.seqs for w in windows for m in w.items} | {i: c.meta.seqs for i, (_, c) in by_id.items()}
    for env, ids in plan.take.items():
        seqs[env] += sum(sizes[i] for i in ids)
    if max_tokens is None:  # minimums over the whole batch (the token budget may leave them short, as without reuse)
        assert all(seqs[w.env_id] >= required(w, batch_size) for w in windows)
    assert plan.seqs == sum(seqs.values()) <= batch_size
    assert max_tokens is None or plan.tokens <= max_tokens
    if not out.reused:
        assert isinstance(fresh, Plan) and plan == fresh  # the fresh smaller batch, where reuse adds nothing
    elif isinstance(fresh, NoBatch):
        assert not plan.smaller  # where fresh groups wait for more, reuse serves only a full batch
    else:
        assert plan.seqs > fresh.seqs  # a smaller batch of fresh groups: reuse only where it serves more
    # Complete: where fresh and offered groups hold an exact fill (brute force), the batch is exactly full.
    weights = {w.env_id: w.weight for w in windows}
    offers = offer(pools, policies, weights, share_seqs(batch_share, batch_size), batch_size, STEP)
    if max_tokens is None and exact_fill_exists(with_offers(windows, offers), batch_size):
        assert plan.seqs == batch_size and not plan.smaller


@given(cases())
def test_without_reuse_the_batches_are_exactly_today_s(
    case: tuple[list[EnvWindow], int, dict[int, list[Candidate]], dict[int, ReusePolicy], float],
) -> None:
    """`max_served` 1 everywhere, or an empty pool: `plan_batch`'s plan, bit for bit."""
    windows, batch_size, pools, _, batch_share = case
    spec = BatchSpec(batch_size, no_exact_fill=SMALLER)
    today = plan_batch(windows, spec, {0: 3.0})
    for pool, policies in ((pools, dict.fromkeys(pools, NO_REUSE)), ({}, {})):
        out = plan_with_reuse(windows, spec, {0: 3.0}, pool, policies, batch_share, STEP)
        assert out == (today if isinstance(today, NoBatch) else ReusePlan(today, {}))


@given(
    st.dictionaries(st.integers(0, 2), st.lists(candidates(), max_size=6), max_size=3),
    st.dictionaries(st.integers(0, 2), policies_st, min_size=3, max_size=3),
    st.integers(0, 24),
    st.integers(1, 24),
)
def test_the_offer_is_in_order_within_bounds_and_leaves_nothing_that_fits(
    pools: dict[int, list[Candidate]], policies: dict[int, ReusePolicy], total: int, batch_size: int
) -> None:
    pools = {e: sorted(cs, key=lambda c, o=policies[e].order: order_key(o, c)) for e, cs in pools.items()}
    out = offer(pools, policies, {0: 1.0, 1: 2.0, 2: 0.5}, total, batch_size, STEP)
    assert sum(c.meta.seqs for cs in out.values() for c in cs) <= total
    for env, cs in out.items():
        cap = share_seqs(policies[env].max_reused_share, batch_size)
        assert sum(c.meta.seqs for c in cs) <= cap
        assert all(eligible(c, policies[env], STEP) for c in cs)
        positions = [pools[env].index(c) for c in cs]
        assert positions == sorted(positions)  # in the env's order
    # Brute force: no eligible candidate left out would still fit both its env's share and the batch's.
    left = total - sum(c.meta.seqs for cs in out.values() for c in cs)
    for env, cs in pools.items():
        room = share_seqs(policies[env].max_reused_share, batch_size) - sum(c.meta.seqs for c in out.get(env, []))
        for c in cs:
            if c not in out.get(env, []) and eligible(c, policies[env], STEP):
                assert c.meta.seqs > min(room, left)


def test_each_order_draws_its_groups_first() -> None:
    old, new = ItemMeta(1, 2, 20, 3), ItemMeta(2, 2, 20, 9)
    a = Candidate(old, 1, advantage=0.2, spread=0.4)
    b = Candidate(new, 1, advantage=0.9, spread=0.3)
    assert sorted([b, a], key=lambda c: order_key("oldest", c)) == [a, b]
    assert sorted([a, b], key=lambda c: order_key("recent", c)) == [b, a]
    assert sorted([a, b], key=lambda c: order_key("advantage", c)) == [b, a]
    assert sorted([b, a], key=lambda c: order_key("spread", c)) == [a, b]


def test_a_short_queue_is_filled_with_reuse_up_to_the_share() -> None:
    """4 fresh sequences of 8 and a pool: the batch takes 4 reused, the share's worth, and no more."""
    fresh = EnvWindow(0, "math", 1.0, 0.0, [ItemMeta(100, 4, 40, STEP)])
    pool = [Candidate(ItemMeta(i, 2, 20, STEP - 1), 1, 1.0, 1.0) for i in (1, 2, 3)]
    policy = ReusePolicy(max_served=2, max_reused_share=0.5)
    out = plan_with_reuse([fresh], BatchSpec(8), {}, {0: pool}, {0: policy}, 0.5, STEP)
    assert isinstance(out, ReusePlan) and out.plan.take == {0: [100, 1, 2]} and out.reused == {1: 2, 2: 2}
    flat = ReusePolicy(max_served=2, max_reused_share=0.5)
    same = [Candidate(ItemMeta(i, 2, 20, STEP - 1), 1, 0.0, 0.0) for i in (1, 2, 3)]  # all scores equal
    assert isinstance(plan_with_reuse([fresh], BatchSpec(8), {}, {0: same}, {0: flat}, 0.5, STEP), NoBatch)
    aged = ReusePolicy(max_served=2, max_age=0, max_reused_share=0.5)
    assert isinstance(plan_with_reuse([fresh], BatchSpec(8), {}, {0: pool}, {0: aged}, 0.5, STEP), NoBatch)


def test_a_minimum_share_is_met_by_reuse_over_the_whole_batch() -> None:
    """An env whose minimum holds the batch back (it queues too little) may meet it with its reused groups."""
    code = EnvWindow(1, "code", 1.0, 0.5, [ItemMeta(101, 2, 20, STEP)])
    math_ = EnvWindow(0, "math", 1.0, 0.0, [ItemMeta(100 + k, 2, 20, STEP) for k in (10, 11, 12, 13)])
    spec = BatchSpec(8)
    assert isinstance(plan_batch([math_, code], spec, {}), NoBatch)
    pool = {1: [Candidate(ItemMeta(1, 2, 20, STEP - 2), 1, 0.5, 1.0)]}
    out = plan_with_reuse([math_, code], spec, {}, pool, {1: ReusePolicy(max_served=3)}, 0.5, STEP)
    assert isinstance(out, ReusePlan) and out.plan.seqs == 8 and out.reused == {1: 2}
    assert sorted(out.plan.take[1]) == [1, 101]


def test_the_pool_is_read_a_bounded_way_whatever_its_size() -> None:
    """An env's pool is read at most `SCAN_LIMIT` deep, and no further than `MISS_LIMIT` too-large groups in a row:
    planning costs the same with a pool of any size."""
    policy = ReusePolicy(max_served=2, max_reused_share=1.0)

    def pool(before: list[Candidate]) -> list[Candidate]:
        return [*before, Candidate(ItemMeta(10**5, 2, 20, STEP), 1, 1.0, 1.0)]

    spent = [Candidate(ItemMeta(i, 2, 20, STEP), 2, 1.0, 1.0) for i in range(SCAN_LIMIT)]  # past their budget
    large = [Candidate(ItemMeta(i, 9, 90, STEP), 1, 1.0, 1.0) for i in range(MISS_LIMIT)]  # never fit 8
    for before in (spent, large):
        assert offer({0: pool(before)}, {0: policy}, {0: 1.0}, 8, 8, STEP) == {}
        assert offer({0: pool(before[1:])}, {0: policy}, {0: 1.0}, 8, 8, STEP) == {0: pool([])}


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=16))
def test_a_groups_signal_is_zero_exactly_when_its_scores_are_all_equal(scores: list[float]) -> None:
    c = candidate(ItemMeta(1, len(scores), 10, 0), 1, scores)
    assert (c.spread == 0.0) == (min(scores) == max(scores))
    assert c.spread == max(scores) - min(scores)
    assert c.spread / 2 <= c.advantage * (1 + 1e-9) and c.advantage <= c.spread * (1 + 1e-9)
    assert not eligible(c, ReusePolicy(max_served=64, max_reused_share=1.0), 0) or c.spread > 0
