"""The runner's watch, alone (rollout_client/runner/watching.py): what a tick says to hold back, cancel and end, the
stall it reports, and the server's reasons told once per kind of block."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_client.runner.pacing import AHEAD, DRAINING, QUEUE_FULL, is_stale
from rollout_client.runner.watching import Monitor, Sight, held_back

REASONS = st.sampled_from([None, QUEUE_FULL, AHEAD])


def sight(**kw: object) -> Sight:
    base: dict[str, object] = {"held": [None], "draining": [False], "groups": [], "policy_step": 0, "trainer_step": 0}
    return Sight(**{**base, **kw})  # type: ignore[arg-type]


@given(st.lists(st.tuples(REASONS, st.booleans()), max_size=8))
def test_an_env_waits_for_its_backpressure_first_then_for_a_drain(envs: list[tuple[str | None, bool]]) -> None:
    held = held_back([h for h, _ in envs], [d for _, d in envs])
    assert list(held) == [h if h is not None else (DRAINING if d else None) for h, d in envs]


@given(
    st.lists(st.tuples(st.integers(0, 20), st.booleans()), max_size=12),
    st.integers(0, 25),
    st.none() | st.integers(0, 5),
)
def test_exactly_the_groups_too_stale_and_not_submitting_are_cancelled(
    groups: list[tuple[int, bool]], trainer_step: int, max_staleness: int | None
) -> None:
    seen = [(f"g{k}", step, submitting) for k, (step, submitting) in enumerate(groups)]
    tick = Monitor(max_staleness, None, None).tick(sight(groups=seen, trainer_step=trainer_step), 0.0)
    expected = [g for g, step, submitting in seen if not submitting and is_stale(step, trainer_step, max_staleness)]
    assert list(tick.stale) == expected
    assert tick.end is None and tick.stalled is None


def test_an_inference_outage_past_its_timeout_ends_the_run() -> None:
    monitor = Monitor(None, None, inference_outage_timeout=10.0)
    assert monitor.tick(sight(inference_down_for=10.0), 0.0).end is None
    assert monitor.tick(sight(inference_down_for=10.5), 1.0).end == "the inference server stayed unreachable for 10.0 s"
    assert Monitor(None, None, None).tick(sight(inference_down_for=1e9), 0.0).end is None, "None turns it off"


def test_held_ahead_past_stall_warning_is_reported_until_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "rollout_client.runner")
    monitor = Monitor(1, stall_warning=60.0, inference_outage_timeout=None)
    ahead = sight(held=[AHEAD], policy_step=3, trainer_step=5)
    assert monitor.tick(ahead, 100.0).stalled is None
    assert monitor.tick(ahead, 159.0).stalled is None
    stalled = monitor.tick(ahead, 160.0).stalled
    assert stalled is not None and "for 60 s at policy step 3 (trainer at 5)" in stalled and "resume()" in stalled
    assert monitor.tick(ahead, 170.0).stalled is not None
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1 and "resume() was never called" in told[0], "logged once per stall_warning"
    announced = sight(held=[AHEAD], policy_step=3, trainer_step=5, weights_step=4, resumed=True)
    assert "announced no weights after step 4" in (monitor.tick(announced, 171.0).stalled or "")
    assert monitor.tick(sight(held=[AHEAD], paused=True), 172.0).stalled is None, "a pause is not a stall"
    assert monitor.tick(ahead, 173.0).stalled is None, "held again: the clock starts over"


def test_the_same_block_with_new_numbers_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A commit-mode trainer at its read-ahead bound names a new step every episode: one warning, not one per
    episode; a different block, and the end of the block, are told again."""
    monitor = Monitor(None, None, None)
    caplog.set_level(logging.INFO, "rollout_client.runner")
    for step in range(5):
        reason = f"the trainer read ahead to step {step + 3} without committing {step}"
        tick = monitor.tick(sight(blocked_reason=reason), float(step))
    assert tick.server_blocked == "the trainer read ahead to step 7 without committing 4"
    monitor.tick(sight(blocked_reason="env 'odd' queues sizes [63] that cannot add up"), 5.0)
    assert monitor.tick(sight(), 6.0).server_blocked is None
    told = [r.getMessage() for r in caplog.records]
    assert sum("can form no batch" in m for m in told) == 2, told
    assert sum("forms batches again" in m for m in told) == 1, told
