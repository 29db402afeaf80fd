"""The runner's failure policy alone: the error-rate window, quarantine, rejections in a row."""

from __future__ import annotations

from collections import Counter, deque

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from rollout_client.runner.failures import Failed, FailurePolicy, Outcome, Refused, Stored

TASKS = ["a", "b", "c"]

outcomes = st.lists(
    st.one_of(
        st.builds(Stored, st.integers(0, 1), st.sampled_from(TASKS)),
        st.builds(Failed, st.integers(0, 1), st.sampled_from(TASKS)),
        st.just(Refused()),
    ),
    max_size=80,
)


@given(outcomes, st.none() | st.floats(0.0, 1.0), st.integers(1, 12))
@example([Stored(0, "a"), Failed(0, "a")], 0.5, 2)  # at the rate exactly: go on
def test_the_run_stops_exactly_when_the_window_fills_past_the_rate(
    seq: list[Outcome], max_rate: float | None, window: int
) -> None:
    """Over any outcomes: the error rate is the failed share of the last `window` finished groups (rejections
    are not finished groups); a failure stops the run exactly when the window is full and the rate is past
    `max_error_rate`, so the rate never sits past it, over a full window, without a stop verdict."""
    policy = FailurePolicy(max_error_rate=max_rate, error_window=window, max_rejected_in_a_row=10**6)
    last: deque[bool] = deque(maxlen=window)
    for outcome in seq:
        verdict = policy.record(outcome)
        if isinstance(outcome, Refused):
            assert verdict.stop is None
            continue
        last.append(isinstance(outcome, Failed))
        assert policy.error_rate == pytest.approx(sum(last) / len(last))
        past = max_rate is not None and len(last) == window and policy.error_rate > max_rate
        assert (verdict.stop is not None) == (past and isinstance(outcome, Failed))


@given(outcomes, st.integers(1, 4))
def test_a_task_is_quarantined_at_its_nth_failure_in_a_row(seq: list[Outcome], after: int) -> None:
    """Per (env, task): a stored group resets its count; the `after`-th failure in a row quarantines it,
    once, for good."""
    policy = FailurePolicy(quarantine_after=after, max_error_rate=None)
    in_a_row: Counter[tuple[int, str]] = Counter()
    quarantined: set[tuple[int, str]] = set()
    for outcome in seq:
        verdict = policy.record(outcome)
        if isinstance(outcome, Stored):
            in_a_row[outcome.env, outcome.task_id] = 0
            assert not verdict.quarantined
        elif isinstance(outcome, Failed):
            key = (outcome.env, outcome.task_id)
            in_a_row[key] += 1
            assert verdict.failures == in_a_row[key]
            assert verdict.quarantined == (in_a_row[key] >= after and key not in quarantined)
            if verdict.quarantined:
                assert in_a_row[key] == after
                quarantined.add(key)
        assert all(policy.is_quarantined(env, t) == ((env, t) in quarantined) for env in (0, 1) for t in TASKS)


@given(outcomes, st.integers(1, 5))
def test_rejections_in_a_row_stop_the_run_and_a_stored_group_resets_them(seq: list[Outcome], limit: int) -> None:
    """Failures neither count nor reset rejections in a row: only the server's verdicts do."""
    policy = FailurePolicy(max_rejected_in_a_row=limit, max_error_rate=None)
    in_a_row = 0
    for outcome in seq:
        verdict = policy.record(outcome)
        if isinstance(outcome, Stored):
            in_a_row = 0
        elif isinstance(outcome, Refused):
            in_a_row += 1
            assert (verdict.stop is not None) == (in_a_row >= limit)
        assert policy.rejected_in_a_row == in_a_row


def test_the_verdicts_say_why_the_run_ends() -> None:
    policy = FailurePolicy(max_error_rate=0.4, error_window=10)
    verdicts = [policy.record(Failed(0, str(i)) if i % 2 else Stored(0, str(i))) for i in range(12)]
    assert [v.stop for v in verdicts[:9]] == [None] * 9, "never before the window is full"
    assert verdicts[9].stop == "50% of the last 10 groups failed (max_error_rate 0.4)"
    rejecting = FailurePolicy()
    stops = [rejecting.record(Refused()).stop for _ in range(10)]
    assert stops == [None] * 9 + ["10 groups in a row rejected by the server"]


def test_rules_turned_off() -> None:
    policy = FailurePolicy(max_error_rate=None, quarantine_after=None, error_window=1)
    verdicts = [policy.record(Failed(0, "a")) for _ in range(50)]
    assert policy.error_rate == 1.0
    assert not any(v.stop or v.quarantined for v in verdicts) and not policy.is_quarantined(0, "a")
    with pytest.raises(ValueError, match="error_window"):
        FailurePolicy(error_window=0)


def test_only_the_most_recently_failed_tasks_are_tracked() -> None:
    """Past `tracked_tasks`, the task whose last failure is oldest is forgotten: its count starts again."""
    policy = FailurePolicy(quarantine_after=3, tracked_tasks=2, max_error_rate=None)
    for task in ["a", "b", "a", "c"]:  # "a" failed again after "b": "b" is the one forgotten
        policy.record(Failed(0, task))
    assert policy.record(Failed(0, "a")).quarantined
    assert policy.record(Failed(0, "b")).failures == 1
