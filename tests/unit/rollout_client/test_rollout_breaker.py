"""The inference circuit breaker: one outage is one transition from reachable to unreachable, debounced."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_client.breaker import Breaker

events = st.lists(st.tuples(st.booleans(), st.floats(0.0, 10.0, allow_nan=False)), max_size=60)


@given(events, st.floats(0.0, 10.0, allow_nan=False))
def test_outages_never_exceed_openings_and_the_state_follows_the_last_event(
    steps: list[tuple[bool, float]], debounce: float
) -> None:
    b = Breaker(debounce_s=debounce)
    now, openings = 0.0, 0
    for ok, dt in steps:
        now += dt
        opened = not ok and b.failure(now)
        if ok:
            b.success(now)
        openings += int(opened)
        assert b.closed is ok
        assert b.down_for(now) >= 0.0
    assert b.outages <= openings
    if steps and not any(ok for ok, _ in steps):
        assert b.outages == 1


@given(st.integers(1, 50), st.floats(0.0, 4.9))
def test_late_failures_after_recovery_are_the_same_outage(flaps: int, late: float) -> None:
    """Requests sent before the server came back report after it did: never a second outage."""
    b = Breaker(debounce_s=5.0)
    b.failure(100.0)
    for k in range(flaps):
        b.success(200.0 + k)
        b.failure(200.0 + k + late / flaps)
    assert b.outages == 1


def test_a_failure_after_the_debounce_is_a_new_outage() -> None:
    b = Breaker(debounce_s=1.0)
    assert b.failure(0.0) and not b.failure(0.5)
    assert b.success(3.0) and not b.success(3.1)
    assert b.failure(10.0) and b.outages == 2 and b.down_for(12.0) == 2.0


def test_a_negative_debounce_is_refused() -> None:
    with pytest.raises(ValueError):
        Breaker(debounce_s=-1.0)


@given(st.floats(0.0, 100.0), st.floats(0.0, 1000.0))
def test_a_request_sent_before_the_server_was_reached_again_never_opens_it(before: float, late: float) -> None:
    """Its failure is the old outage's, however late it reports (under load: more than the debounce)."""
    b = Breaker(debounce_s=5.0)
    assert b.failure(100.0, sent=99.0)
    assert b.success(200.0)
    assert not b.failure(200.0 + late, sent=200.0 - before - 1e-6) and b.closed and b.outages == 1
    assert b.stale(199.0) and not b.stale(200.0) and not b.stale(None)


def test_a_request_sent_after_the_server_was_reached_again_opens_it() -> None:
    b = Breaker(debounce_s=1.0)
    assert b.failure(0.0, sent=0.0) and b.success(1.0)
    assert b.failure(10.0, sent=9.0) and b.outages == 2 and not b.closed
    assert not Breaker().stale(0.0), "nothing is stale before the breaker first closed"
