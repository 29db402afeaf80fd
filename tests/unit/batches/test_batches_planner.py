"""Invariants of batch formation, checked on generated queues (hypothesis) against brute force."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from api.batches.aging import PassedOver, age, is_due
from api.batches.planner import (
    SMALLER,
    TRIM,
    WAIT,
    BatchSpec,
    EnvWindow,
    LookAhead,
    NoBatch,
    Plan,
    arrival_that_fills,
    plan_batch,
)
from api.batches.windows import take_window
from api.run.state import scale_shares
from api.store.items import ItemMeta

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
    plan = plan_batch(windows, BatchSpec(batch_size, no_exact_fill=WAIT), {})
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
    plan = plan_batch([window(0, [3] * 10)], BatchSpec(16, no_exact_fill=WAIT), {})
    assert isinstance(plan, NoBatch) and plan.blocked
    assert "no choice of the 10 queued groups (sizes [3]) adds up to exactly batch_size 16" in plan.reason
    assert "no_exact_fill is 'wait'" in plan.reason


def test_no_exact_fill_at_all_forms_a_smaller_batch_by_default() -> None:
    plan = plan_batch([window(0, [63] * 6)], BatchSpec(256), {})
    assert isinstance(plan, Plan) and plan.smaller and plan.seqs == 252 and len(plan.take[0]) == 4


def test_mixed_sizes_that_one_more_group_completes_are_waiting_not_blocked() -> None:
    """Groups of 6 and 8 filling 64: a queue that cannot add up now is no stall when arrivals can end it."""
    for policy in (WAIT, SMALLER):
        plan = plan_batch([window(0, [6] * 7 + [8] * 3)], BatchSpec(64, no_exact_fill=policy), {})  # 66, no 64
        assert isinstance(plan, NoBatch) and not plan.blocked
    assert "one more group of" in plan.reason and "would form a batch" in plan.reason


def test_a_wait_for_arrivals_says_what_is_queued_and_ends_when_waited_out() -> None:
    """The wait is the caller's to bound in time (`awaiting`: the sequences queued); waited out, the trainer's
    policy applies: "smaller" serves the fullest batch under batch_size, "wait" reports the stall."""
    queue = [window(0, [6] * 7 + [8] * 3)]  # 66 sequences, no 64
    waiting = plan_batch(queue, BatchSpec(64), {})
    assert isinstance(waiting, NoBatch) and waiting.awaiting == 66
    served = plan_batch(queue, BatchSpec(64), {}, arrivals_waited_out=True)
    assert isinstance(served, Plan) and served.smaller and served.seqs == 60
    stalled = plan_batch(queue, BatchSpec(64, no_exact_fill=WAIT), {}, arrivals_waited_out=True)
    assert isinstance(stalled, NoBatch) and stalled.blocked and stalled.awaiting is None


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


# ------------------------------------------------------------------------------- beyond the window, aging


def form(queues: list[EnvWindow], spec: BatchSpec, credits: dict[int, float], look: LookAhead) -> Plan | NoBatch:
    """What api/batches/formation.py does with a store: the window first, then the longer read when it holds no fill."""

    def read(max_seqs: int, max_items: int | None) -> list[EnvWindow]:
        out = []
        for q in queues:
            win = take_window(iter(q.items), min_step=None, max_seqs=max_seqs, max_items=max_items)
            out.append(EnvWindow(q.env_id, q.name, q.weight, q.min_share, win.items, q.due, win.more))
        return out

    plan = plan_batch(read(spec.batch_size, None), spec, credits, looked_further=False)
    if isinstance(plan, NoBatch) and plan.look_further:
        plan = plan_batch(read(look.sequences, look.groups), spec, credits)
    return plan


@st.composite
def deep_queues(draw: st.DrawFn) -> tuple[list[EnvWindow], int]:
    """Queues several windows deep, sizes mixed (survivor-like runs of near-equal sizes included)."""
    batch_size = draw(st.integers(4, 32))
    n_envs = draw(st.integers(1, 3))
    shares = scale_shares({e: draw(st.one_of(st.none(), st.floats(0.05, 0.5))) for e in range(n_envs)})
    windows = []
    for e in range(n_envs):
        top = draw(st.integers(1, min(9, batch_size)))
        sizes = draw(st.lists(st.integers(max(1, top - 3), top), max_size=12))
        windows.append(window(e, sizes, draw(st.sampled_from([0.5, 1.0, 2.0])), shares.get(e, 0.0)))
    return windows, batch_size


@settings(max_examples=300, deadline=None)
@given(deep_queues())
def test_a_batch_forms_whenever_any_choice_of_the_whole_queue_is_an_exact_fill(
    case: tuple[list[EnvWindow], int],
) -> None:
    """Brute force over the whole queue (within the look-ahead), not only the window of the oldest items."""
    queues, batch_size = case
    plan = form(queues, BatchSpec(batch_size, no_exact_fill=WAIT), {}, LookAhead())
    exists = brute_force_exists(queues, batch_size, prefix_only=False)
    assert (isinstance(plan, Plan) and plan.seqs == batch_size) == exists, plan
    if isinstance(plan, Plan):
        got = taken(plan, queues)
        for w in queues:
            assert sum(m.seqs for m in got.get(w.env_id, [])) >= required(w, batch_size), "minimum not met"


@settings(max_examples=200, deadline=None)
@given(deep_queues())
def test_the_oldest_item_is_taken_whenever_an_exact_fill_of_its_env_s_share_holds_it(
    case: tuple[list[EnvWindow], int],
) -> None:
    """The fill is the oldest one: an env's oldest item is passed over only when no choice of its items (up to the
    newest one taken) with the same total holds it."""
    queues, batch_size = case
    plan = form(queues, BatchSpec(batch_size, no_exact_fill=WAIT), {}, LookAhead())
    if not isinstance(plan, Plan):
        return
    for w in queues:
        ids = plan.take.get(w.env_id, [])
        if not ids or ids[0] == w.items[0].item_id:
            continue
        total = sum(m.seqs for m in w.items if m.item_id in set(ids))
        rest = [m.seqs for m in w.items[1:] if m.item_id <= ids[-1]]
        sums = {w.items[0].seqs + sum(c) for r in range(len(rest) + 1) for c in itertools.combinations(rest, r)}
        assert total not in sums, "passed over the oldest item though a choice of the same total held it"
        assert plan.passed_over[w.env_id] == w.items[0].item_id


def test_survivor_groups_behind_the_window_form_a_batch() -> None:
    """The issue's queue: five odd survivor groups, then whole groups of 64: the window alone never fills 256."""
    queue = window(0, [59, 60, 61, 62, 63, 64, 64, 63, 64, 64, 61, 64])
    spec = BatchSpec(256, no_exact_fill=WAIT)
    assert isinstance(plan_batch([window(0, [59, 60, 61, 62, 63])], spec, {}), NoBatch)
    plan = form([queue], spec, {}, LookAhead())
    assert isinstance(plan, Plan) and plan.seqs == 256 and len(plan.take[0]) == 4
    assert plan.passed_over == {0: queue.items[0].item_id}


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([16, 32, 64]),
    st.integers(1, 3),
    st.integers(1, 3),
)
def test_no_item_is_passed_over_more_than_due_after_batches(seed: int, batch_size: int, n_envs: int, due: int) -> None:
    """Formation run batch after batch with arrivals of survivor-like sizes (most whole, some short): once an env's
    oldest item is first passed over at step s, it is in a batch by step s + due_after ("smaller" policy)."""
    import random

    rng = random.Random(seed)
    look = LookAhead(groups=64, sequences=8 * batch_size, due_after=due)
    group = batch_size // 4
    queues: dict[int, list[ItemMeta]] = {e: [] for e in range(n_envs)}
    weights = {e: rng.choice([0.5, 1.0, 2.0]) for e in range(n_envs)}
    passed: PassedOver = {}
    credits: dict[int, float] = {}
    first_passed: dict[int, int] = {}
    step = 0  # batches formed: what the run's step counts
    for _ in range(60):
        for e in range(n_envs):
            for _ in range(rng.randint(0, 5)):
                queues[e].append(items([group if rng.random() < 0.6 else rng.randint(group - 3, group)])[0])
        windows = [
            EnvWindow(e, f"env{e}", weights[e], 0.0, q, is_due(passed, e, q[0] if q else None, step, due))
            for e, q in queues.items()
        ]
        plan = form(windows, BatchSpec(batch_size), credits, look)
        if isinstance(plan, NoBatch):
            continue
        for item_id in plan.passed_over.values():
            first_passed.setdefault(item_id, step)
        served = {i for ids in plan.take.values() for i in ids}
        for e, q in queues.items():
            queues[e] = [m for m in q if m.item_id not in served]
        for item_id, since in list(first_passed.items()):
            if item_id in served:
                assert step - since <= due, (item_id, since, step)
                del first_passed[item_id]
            else:
                assert step - since < due, f"item {item_id} passed over since step {since}, still queued at {step}"
        passed, credits = age(passed, plan, step), plan.credits
        step += 1


# ------------------------------------------------------------------------------------------------- trimming


def check_trimmed(plan: Plan, windows: list[EnvWindow], batch_size: int) -> None:
    """A plan under "trim": exactly batch_size served, each item once, FIFO prefixes per env, each minimum met
    after the cut, and the cut exactly the excess of the groups taken, off groups keeping at least one sequence."""
    got = taken(plan, windows)
    ids = [i for ids in plan.take.values() for i in ids]
    assert len(ids) == len(set(ids)), "an item taken twice"
    sizes = {m.item_id: m.seqs for ms in got.values() for m in ms}
    assert set(plan.trim) <= set(sizes), "a cut of an item not taken"
    assert all(1 <= keep < sizes[i] for i, keep in plan.trim.items())
    served = {i: plan.trim.get(i, n) for i, n in sizes.items()}
    assert plan.seqs == batch_size == sum(served.values())
    assert sum(sizes.values()) - sum(served.values()) == sum(sizes[i] - k for i, k in plan.trim.items())
    for w in windows:
        mine = [m.item_id for m in got.get(w.env_id, [])]
        assert mine == [m.item_id for m in w.items[: len(mine)]], "not a FIFO prefix"
        assert sum(served[i] for i in mine) >= required(w, batch_size), "minimum not met after the cut"


@settings(max_examples=400, deadline=None)
@given(queues())
def test_trim_serves_exactly_batch_size_whenever_enough_is_queued_and_the_minimums_allow(
    case: tuple[list[EnvWindow], int],
) -> None:
    windows, batch_size = case
    plan = plan_batch(windows, BatchSpec(batch_size, no_exact_fill=TRIM), {}, arrivals_waited_out=True)
    available = sum(m.seqs for w in windows for m in w.items)
    minimums = sum(required(w, batch_size) for w in windows)
    enough = all(sum(m.seqs for m in w.items) >= required(w, batch_size) for w in windows)
    if available >= batch_size and minimums <= batch_size and enough:
        assert isinstance(plan, Plan) and not plan.smaller, plan
    if not isinstance(plan, Plan):
        return
    if brute_force_exists(windows, batch_size, prefix_only=False):
        assert not plan.trim, "cut although an exact fill of whole groups exists"
    elif not plan.smaller:
        check_trimmed(plan, windows, batch_size)
        if not any(w.min_share for w in windows):  # one group cut: the newest taken that can lose the excess
            assert len(plan.trim) == 1
            (cut_id,) = plan.trim
            excess = sum(m.seqs for ms in taken(plan, windows).values() for m in ms) - batch_size
            newer = [m for ms in taken(plan, windows).values() for m in ms if m.item_id > cut_id]
            assert all(m.seqs - 1 < excess for m in newer), "a newer group could have taken the cut"


def test_trim_cuts_the_newest_survivor_group_to_fit() -> None:
    """Survivors of 59-64 towards 256: the four oldest whole, the fifth cut to what is left; all-63s alike."""
    queue = window(0, [59, 60, 61, 62, 63, 63])
    plan = plan_batch([queue], BatchSpec(256, no_exact_fill=TRIM), {})
    assert isinstance(plan, Plan) and plan.seqs == 256 and not plan.smaller
    assert plan.take[0] == [m.item_id for m in queue.items[:5]] and plan.trim == {queue.items[4].item_id: 14}
    queue = window(0, [63] * 6)
    plan = plan_batch([queue], BatchSpec(256, no_exact_fill=TRIM), {})
    assert isinstance(plan, Plan) and plan.seqs == 256 and plan.trim == {queue.items[4].item_id: 4}
    assert plan.credits[0] == -256 + 256  # credit spent on what is served (earned 256 with one env)


def test_trim_respects_minimum_shares_after_the_cut() -> None:
    """Two envs each owed half of 256 in groups of 63: three of each, and the cut leaves each exactly 128."""
    a, b = window(0, [63] * 4, share=0.5), window(1, [63] * 4, share=0.5)
    plan = plan_batch([a, b], BatchSpec(256, no_exact_fill=TRIM), {})
    assert isinstance(plan, Plan) and plan.seqs == 256
    check_trimmed(plan, [a, b], 256)
    served = {e: sum(plan.trim.get(i, 63) for i in ids) for e, ids in plan.take.items()}
    assert served == {0: 128, 1: 128}


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([64, 256]), st.integers(1, 3))
def test_trim_serves_every_group_once_batch_after_batch(seed: int, batch_size: int, n_envs: int) -> None:
    """Formation run batch after batch with survivor-like arrivals under "trim": every batch exactly batch_size,
    each item served at most once (a cut one is consumed whole), and the queue drained to under a batch."""
    import random

    rng = random.Random(seed)
    look = LookAhead()
    group = batch_size // 4
    queues: dict[int, list[ItemMeta]] = {e: [] for e in range(n_envs)}
    served: set[int] = set()
    credits: dict[int, float] = {}
    passed: PassedOver = {}
    for step in range(200):
        if step >= 30 and sum(m.seqs for q in queues.values() for m in q) < batch_size:
            break
        if step < 30:
            for e in range(n_envs):
                for _ in range(rng.randint(0, 5)):
                    queues[e].append(items([rng.randint(group - 5, group)])[0])
        windows = [
            EnvWindow(e, f"env{e}", 1.0, 0.0, q, is_due(passed, e, q[0] if q else None, step, look.due_after))
            for e, q in queues.items()
        ]
        plan = form(windows, BatchSpec(batch_size, no_exact_fill=TRIM), credits, look)
        if isinstance(plan, NoBatch):
            assert plan.awaiting is not None or sum(len(q) for q in queues.values()) == 0 or not plan.blocked
            plan = plan_batch(windows, BatchSpec(batch_size, no_exact_fill=TRIM), credits, arrivals_waited_out=True)
            if isinstance(plan, NoBatch):
                assert sum(m.seqs for q in queues.values() for m in q) < batch_size, plan
                continue
        assert plan.seqs == batch_size and not plan.smaller
        ids = {i for ids in plan.take.values() for i in ids}
        assert not ids & served, "an item served twice"
        served |= ids
        for e, q in queues.items():
            queues[e] = [m for m in q if m.item_id not in ids]
        passed, credits = age(passed, plan, step), plan.credits
    assert sum(m.seqs for q in queues.values() for m in q) < batch_size


# ----------------------------------------------------------------------------------------- truthful reasons


def token_items(sizes: list[tuple[int, int]]) -> list[ItemMeta]:
    return [ItemMeta(next(_ids), s, t, 0) for s, t in sizes]


def test_token_mode_minimum_blocks_when_the_others_fill_the_token_budget() -> None:
    """The others hold a full token budget in far fewer than batch_size sequences: the minimum is what blocks (it
    was reported as waiting for data, since fewer than batch_size sequences were queued)."""
    others = EnvWindow(0, "math", 1.0, 0.0, token_items([(4, 400)] * 3))  # 1,200 tokens, 12 sequences
    plan = plan_batch([others, EnvWindow(1, "code", 1.0, 0.25, [])], BatchSpec(64, 1000, 0.9), {})
    assert isinstance(plan, NoBatch) and plan.blocked and plan.holding == 1
    assert "env 'code' has 0 sequences queued" in plan.reason and "needs 16" in plan.reason


def test_a_minimum_that_is_not_what_holds_the_batch_is_waiting_and_no_hold() -> None:
    """Too little data anywhere: the batch waits for data whatever the minimum; no quiet-share hold starts."""
    for spec, sizes in ((BatchSpec(64, 1000, 0.9), [(4, 100)]), (BatchSpec(16), [(4, 40)])):
        windows = [EnvWindow(0, "math", 1.0, 0.0, token_items(sizes)), EnvWindow(1, "code", 1.0, 0.25, [])]
        plan = plan_batch(windows, spec, {})
        assert isinstance(plan, NoBatch) and not plan.blocked and plan.holding is None
        assert plan.reason.startswith("waiting for data: env 'code' has 0 sequences queued")


@given(
    st.lists(st.tuples(st.integers(1, 8), st.integers(10, 400)), max_size=8),
    st.lists(st.tuples(st.integers(1, 8), st.integers(10, 400)), max_size=3),
    st.floats(0.05, 0.9),
)
def test_token_mode_minimum_blocks_exactly_when_the_others_would_release_a_batch(
    others: list[tuple[int, int]], reserved: list[tuple[int, int]], share: float
) -> None:
    spec = BatchSpec(16, 800, 0.9)
    a, b = token_items(others), token_items(reserved)
    plan = plan_batch([EnvWindow(0, "a", 1.0, 0.0, a), EnvWindow(1, "b", 1.0, share, b)], spec, {})
    if not (isinstance(plan, NoBatch) and "env 'b'" in plan.reason):
        return
    free = plan_batch([EnvWindow(0, "a", 1.0, 0.0, a), EnvWindow(1, "b", 1.0, 0.0, b)], spec, {})
    assert plan.blocked == isinstance(free, Plan)
    assert (plan.holding == 1) == plan.blocked


def test_token_mode_groups_larger_than_any_batch_block_with_reason() -> None:
    """Queued before the trainer registered smaller budgets: FIFO means no batch ever forms; said, not 'waiting'."""
    windows = [EnvWindow(0, "math", 1.0, 0.0, token_items([(4, 2000)])), EnvWindow(1, "code", 1.0, 0.0, [])]
    plan = plan_batch(windows, BatchSpec(64, 1000, 0.9), {})
    assert isinstance(plan, NoBatch) and plan.blocked
    assert "larger than a batch may hold ('math' 4 sequences, 2000 tokens" in plan.reason


def test_token_mode_waiting_says_which_env_more_data_would_fill_from() -> None:
    windows = [EnvWindow(0, "math", 1.0, 0.0, token_items([(2, 100)]))]
    plan = plan_batch(windows, BatchSpec(64, 1000, 0.9), {})
    assert isinstance(plan, NoBatch) and not plan.blocked
    assert plan.reason == (
        "waiting for data: 100 of 1000 tokens (2 sequences) fit so far, under min_batch_fill 0.9 (more from 'math' "
        "would fit)"
    )


def test_stale_drops_are_named_in_both_modes() -> None:
    """Queued data dropped as stale while the queues were read: the reason says so, for a minimum (blocked) and
    for waiting (whose reason the server's stall warning logs)."""
    for spec in (BatchSpec(16), BatchSpec(16, 1000, 0.9)):
        lacking = EnvWindow(1, "code", 1.0, 0.5, [], stale=3)
        plan = plan_batch([window(0, [4] * 4), lacking], spec, {})
        assert isinstance(plan, NoBatch) and plan.blocked
        assert "env 'code' has 0 sequences queued (3 stale groups dropped just now)" in plan.reason
        plan = plan_batch([EnvWindow(0, "math", 1.0, 0.0, items([4]), stale=1)], spec, {})
        assert isinstance(plan, NoBatch) and not plan.blocked
        assert plan.reason.endswith(
            "; 1 stale group dropped just now (1 of 'math'): generated more than max_staleness steps behind the trainer"
        )


# ---------------------------------------------------------------------------------------------- the run's tail


def servable(case: tuple[list[EnvWindow], int]) -> tuple[list[EnvWindow], int]:
    """The queues without groups larger than a batch (ingest refuses them: a group is never split)."""
    windows, batch_size = case
    return [dataclasses.replace(w, items=[m for m in w.items if m.seqs <= batch_size]) for w in windows], batch_size


def drain_tail(windows: list[EnvWindow], spec: BatchSpec) -> tuple[list[Plan], NoBatch, list[EnvWindow]]:
    """Plan the run's tail (`final`) batch after batch, each plan's items leaving the queue (a cut one whole),
    until none forms: the plans, the last answer, and what is left."""
    plans: list[Plan] = []
    credits: dict[int, float] = {}
    while True:
        plan = plan_batch(windows, spec, credits, final=True)
        if isinstance(plan, NoBatch):
            return plans, plan, windows
        assert len(plans) < 100, "the tail never drains"
        plans.append(plan)
        gone = {i for ids in plan.take.values() for i in ids}
        windows = [dataclasses.replace(w, items=[m for m in w.items if m.item_id not in gone]) for w in windows]
        credits = plan.credits


@settings(max_examples=300, deadline=None)
@given(queues())
def test_a_batch_short_of_batch_size_is_served_only_once_nothing_else_can_arrive(
    case: tuple[list[EnvWindow], int],
) -> None:
    """Under "smaller": a queue short of a batch is never served while more may arrive; once nothing can (`final`),
    the whole queue is served, each group once, in batches of at most `batch_size` (minimum shares no longer
    hold), and none is left out."""
    windows, batch_size = servable(case)
    spec = BatchSpec(batch_size)
    available = sum(m.seqs for w in windows for m in w.items)
    if available < batch_size:
        assert isinstance(plan_batch(windows, spec, {}), NoBatch), "a short batch served while more may arrive"
    plans, last, left = drain_tail(windows, spec)
    served = [i for p in plans for ids in p.take.values() for i in ids]
    assert sorted(served) == sorted(m.item_id for w in windows for m in w.items), "not every group served once"
    assert all(0 < p.seqs <= batch_size and not p.trim for p in plans)
    assert not last.left_out and not last.blocked and not any(w.items for w in left)


@settings(max_examples=300, deadline=None)
@given(queues(), st.sampled_from([TRIM, WAIT]))
def test_under_exact_batch_sizes_the_tail_forms_exact_batches_and_leaves_out_only_what_cannot(
    case: tuple[list[EnvWindow], int], policy: str
) -> None:
    """Under "trim" and "wait" (a trainer that requires exact batch sizes): the tail's batches are exactly
    `batch_size` (whole groups under "wait"), and what is left out could make no such batch: fewer sequences than
    a batch under "trim", no choice of whole groups adding up under "wait"."""
    windows, batch_size = servable(case)
    plans, last, left = drain_tail(windows, BatchSpec(batch_size, no_exact_fill=policy))
    assert all(p.seqs == batch_size and not p.smaller for p in plans)
    if policy == WAIT:
        assert not any(p.trim for p in plans)
    rest = [m.seqs for w in left for m in w.items]
    assert last.left_out == bool(rest) and (not rest or "run_tail" in last.reason)
    if policy == TRIM:
        assert sum(rest) < batch_size
    else:
        assert not brute_force_exists([dataclasses.replace(w, min_share=0.0) for w in left], batch_size, False)


def test_token_mode_releases_the_tail_whatever_fills_the_budgets_once_final() -> None:
    """Token mode waits for `min_batch_fill` of the budget while more may arrive, and releases what is queued once
    nothing can."""
    queue = EnvWindow(0, "env0", 1.0, 0.0, token_items([(2, 100), (2, 100)]))
    spec = BatchSpec(16, max_tokens=1000)
    assert isinstance(plan_batch([queue], spec, {}), NoBatch)
    plan = plan_batch([queue], spec, {}, final=True)
    assert isinstance(plan, Plan) and plan.seqs == 4 and plan.tokens == 200
