"""api.ledger.drop_bias: starvation below a minimum share for K batches, length and reward skews of unintended drops,
bounded windows, one log line per episode."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from api.ingest.side_buffer import EXPIRED
from api.ledger.drop_bias import (
    LENGTH_SKEW,
    REWARD_SKEW,
    STARVED,
    Decision,
    Dist,
    DropBias,
    EnvTarget,
    Episodes,
    StepMix,
    Thresholds,
    required_seqs,
    standardised_difference,
)
from api.run.filters import SCORE_RANGE, ZERO_VARIANCE

T = Thresholds(starve_steps=3, min_groups=4, window_steps=20, window_groups=50)
TARGETS = [EnvTarget("a", 1.0, 0.25), EnvTarget("b", 3.0)]


def trained(env: str, tokens: int = 100, reward: float = 0.5) -> Decision:
    return Decision(env, True, None, seqs=4, tokens=tokens, reward=reward, latency=1.0)


def dropped(env: str, reason: str = "stale", tokens: int = 100, reward: float = 0.5) -> Decision:
    return Decision(env, False, reason, seqs=4, tokens=tokens, reward=reward, latency=9.0)


def tail_below(seqs: list[int], need: int) -> int:
    tail = 0
    for n in reversed(seqs[-T.window_steps :]):
        if n >= need:
            break
        tail += 1
    return tail


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 16), min_size=0, max_size=30))
def test_starved_exactly_when_the_last_k_batches_were_below_the_floor(a_seqs: list[int]) -> None:
    """a: minimum 0.25, weight share 0.25 (floor 0.25); b: no minimum, weight share 0.75 (floor 0.375)."""
    monitor = DropBias(T)
    for step, n in enumerate(a_seqs):
        monitor.observe_step(StepMix(step, {"a": n, "b": 16 - n}))
    a, b = monitor.report(TARGETS).envs
    assert (a.floor, b.floor) == (0.25, 0.375)
    tail_a = tail_below(a_seqs, required_seqs(0.25, 16))
    tail_b = tail_below([16 - n for n in a_seqs], required_seqs(0.375, 16))
    assert (a.below_floor_steps, b.below_floor_steps) == (tail_a, tail_b)
    assert (STARVED in a.flags, STARVED in b.flags) == (tail_a >= T.starve_steps, tail_b >= T.starve_steps)


def test_a_disconnected_env_is_never_starved() -> None:
    monitor = DropBias(T)
    for step in range(10):
        monitor.observe_step(StepMix(step, {"b": 16}))
    [a, _] = monitor.report([EnvTarget("a", 1.0, 0.25, connected=False), EnvTarget("b", 3.0)]).envs
    assert (a.floor, a.flags) == (0.0, ())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from("abc"), st.integers(0, 9), min_size=1), max_size=40))
def test_shares_are_fractions_that_add_up(mixes: list[dict[str, int]]) -> None:
    monitor = DropBias(T)
    for step, mix in enumerate(mixes):
        monitor.observe_step(StepMix(step, mix))
    report = monitor.report(TARGETS)
    assert report.steps == min(len(mixes), T.window_steps)
    shares = [e.share for e in report.envs if e.share is not None]
    assert all(0.0 <= s <= 1.0 for s in shares)
    if any(sum(m.values()) for m in mixes):
        assert math.isclose(sum(shares), 1.0)
    assert math.isclose(sum(e.weight_share for e in report.envs), 1.0)  # "c" has no target: weight share 0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(4, 400), st.floats(-1, 1)), min_size=4, max_size=30),
    st.sampled_from(["stale", EXPIRED]),
)
def test_dropping_like_training_is_no_skew(groups: list[tuple[int, float]], reason: str) -> None:
    monitor = DropBias(T)
    for tokens, reward in groups:
        monitor.observe(trained("a", tokens, reward))
        monitor.observe(dropped("a", reason, tokens, reward))
    env = monitor.report(TARGETS).envs[0]
    assert env.flags == ()
    assert env.length_skew is not None and abs(env.length_skew) < 1e-9


def test_stale_drops_of_long_groups_are_a_length_skew_and_of_good_ones_a_reward_skew() -> None:
    monitor = DropBias(T)
    for i in range(10):
        monitor.observe(trained("a", tokens=100 + i, reward=0.1 * (i % 3)))
        monitor.observe(dropped("a", "stale", tokens=200 + i, reward=0.9 + 0.01 * i))
    env = monitor.report(TARGETS).envs[0]
    assert env.flags == (LENGTH_SKEW, REWARD_SKEW)
    assert env.length_skew is not None and env.length_skew > 0.9
    assert env.latency_dropped.mean == 9.0 and env.latency_trained.mean == 1.0
    assert env.dropped == {"stale": 10}


def test_the_trainers_own_filters_are_never_a_skew() -> None:
    """zero_variance and score_range select on reward by design: they are counted, not compared."""
    monitor = DropBias(T)
    for _ in range(10):
        monitor.observe(trained("a", tokens=100, reward=0.5))
        monitor.observe(dropped("a", ZERO_VARIANCE, tokens=900, reward=1.0))
        monitor.observe(dropped("a", SCORE_RANGE, tokens=10, reward=-5.0))
    env = monitor.report(TARGETS).envs[0]
    assert env.flags == () and env.dropped == {ZERO_VARIANCE: 10, SCORE_RANGE: 10}
    assert env.length_dropped.n == 0


def test_a_few_drops_or_a_small_fraction_are_not_judged() -> None:
    monitor = DropBias(T)
    for _ in range(3):  # below min_groups
        monitor.observe(dropped("a", tokens=900))
    for _ in range(40):
        monitor.observe(trained("a"))
    assert monitor.report(TARGETS).envs[0].flags == ()
    monitor = DropBias(Thresholds(min_groups=4, min_drop_fraction=0.2, window_groups=100))
    for _ in range(5):
        monitor.observe(dropped("a", tokens=900))
    for _ in range(45):  # 5 of 50 dropped: 10%, below the 20% asked for
        monitor.observe(trained("a"))
    assert monitor.report(TARGETS).envs[0].flags == ()


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 500), st.integers(0, 500))
def test_windows_are_bounded(steps: int, decisions: int) -> None:
    monitor = DropBias(T)
    for i in range(steps):
        monitor.observe_step(StepMix(i, {"a": 1}))
    for i in range(decisions):
        monitor.observe(trained("ab"[i % 2]))
    assert monitor.held() <= T.window_steps + 2 * T.window_groups


@given(st.lists(st.floats(-10, 10), min_size=1, max_size=20), st.lists(st.floats(-10, 10), min_size=1, max_size=20))
def test_standardised_difference_is_antisymmetric(xs: list[float], ys: list[float]) -> None:
    d = standardised_difference(Dist.of(xs), Dist.of(ys))
    back = standardised_difference(Dist.of(ys), Dist.of(xs))
    assert d is not None and back is not None
    assert d == -back or math.isclose(d, -back, abs_tol=1e-9)


def test_an_episode_is_logged_once_when_it_starts_and_once_when_it_ends() -> None:
    monitor = DropBias(T)
    episodes = Episodes()
    for step in range(5):
        monitor.observe_step(StepMix(step, {"a": 0, "b": 16}))
    started, ended = episodes.lines(monitor.report(TARGETS))
    assert len(started) == 1 and "env 'a' is starved" in started[0] and ended == []
    for _ in range(10):  # polled again and again: nothing more to say
        assert episodes.lines(monitor.report(TARGETS)) == ([], [])
    monitor.observe_step(StepMix(5, {"a": 4, "b": 12}))
    assert episodes.lines(monitor.report(TARGETS)) == ([], ["env 'a' is no longer starved"])
    for step in range(6, 9):
        monitor.observe_step(StepMix(step, {"a": 0, "b": 16}))
    started, _ = episodes.lines(monitor.report(TARGETS))
    assert len(started) == 1  # a new episode: said again


def test_report_json_has_no_infinities_for_json() -> None:
    monitor = DropBias(T)
    for _ in range(5):
        monitor.observe(trained("a", reward=0.0))
        monitor.observe(dropped("a", reward=1.0))
    env = monitor.report(TARGETS).envs[0]
    assert env.reward_skew == math.inf and REWARD_SKEW in env.flags
    assert env.to_json()["reward_skew"] == "inf"


MAX = 1.7976931348623157e308
EXTREME = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e200, -1e200, MAX, -MAX, 5e-324, -5e-324, 2.2250738585072014e-308, 0.0, -0.0]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(EXTREME, max_size=12), st.lists(EXTREME, max_size=12), st.lists(st.floats(0, 1e9), max_size=4))
def test_every_statistic_is_finite_or_a_stated_null_for_any_finite_input(
    kept: list[float], gone: list[float], latencies: list[float]
) -> None:
    """One group scoring 1e200 made GET /status 500 for good (an OverflowError squaring a deviation)."""
    for values in (kept, gone):
        dist = Dist.of(values)
        for x in (dist.mean, dist.std, dist.p50, dist.p90):
            assert x is None or math.isfinite(x)
        if values:
            assert dist.mean is not None and min(values) <= dist.mean <= max(values)
            assert dist.p50 is not None and min(values) <= dist.p50 <= max(values)
    monitor = DropBias(T)
    for i, reward in enumerate(kept):
        monitor.observe(Decision("a", True, None, 4, 100, reward, latencies[i % len(latencies)] if latencies else None))
    for reward in gone:
        monitor.observe(dropped("a", reward=reward))
    report = monitor.report(TARGETS)
    for env in report.envs:
        status = env.to_status()
        assert all(v is None or math.isfinite(v) for v in status.values() if isinstance(v, float))
        assert env.reward_skew is None or not math.isnan(env.reward_skew)
    assert "nan" not in str(report.to_json()).lower()
