"""The body budget: bytes held across requests never pass the limit, and every hold gives back what it took."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.http.inflight import BodyBudget, Busy


def test_a_take_past_the_limit_is_busy_and_holds_nothing_more() -> None:
    budget = BodyBudget(limit=100, retry_after=3)
    first = budget.hold()
    first.take(60)
    second = budget.hold()
    with pytest.raises(Busy) as refused:
        second.take(41)
    assert refused.value.status_code == 503 and refused.value.headers == {"Retry-After": "3"}
    assert budget.held == 60 and second.bytes == 0
    second.take(40)
    first.release()
    second.give(15)
    assert budget.held == 25
    second.release()
    assert budget.held == 0


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 50), st.booleans()), max_size=60))
def test_holds_never_pass_the_limit_and_release_everything(ops: list[tuple[int, int, bool]]) -> None:
    budget = BodyBudget(limit=120)
    holds = [budget.hold() for _ in range(4)]
    for which, n, give in ops:
        hold = holds[which]
        if give:
            hold.give(n)
        else:
            try:
                hold.take(n)
            except Busy:
                pass
        assert 0 <= budget.held <= budget.limit
        assert budget.held == sum(h.bytes for h in holds)
    for hold in holds:
        hold.release()
    assert budget.held == 0


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 50), st.booleans()), max_size=60))
def test_no_holder_passes_its_share_and_each_gives_back_what_it_took(ops: list[tuple[int, int, bool]]) -> None:
    budget = BodyBudget(limit=120, per_holder=70)
    holds = [budget.hold(f"key {i % 2}") for i in range(4)]  # two holders, two requests each
    for which, n, give in ops:
        hold = holds[which]
        if give:
            hold.give(n)
        else:
            try:
                hold.take(n)
            except Busy as refused:
                assert "max_inflight_bytes" in refused.detail
        assert budget.held <= 120 and all(v <= 70 for v in budget.by_holder.values())
        assert budget.held == sum(h.bytes for h in holds) == sum(budget.by_holder.values())
    for hold in holds:
        hold.release()
    assert budget.held == 0 and budget.by_holder == {}


def test_a_charge_past_the_limit_runs_only_alone() -> None:
    """A body whose decoding costs more than the whole budget runs when nothing else is held, instead of never."""
    budget = BodyBudget(limit=100, per_holder=60)
    big, other = budget.hold("a"), budget.hold("b")
    big.take(50)
    other.take(1)
    with pytest.raises(Busy):
        big.charge(200)
    other.release()
    big.charge(200)
    assert budget.held == budget.peak == 250
    with pytest.raises(Busy):
        other.take(1)  # while it runs, nothing else is taken
    big.release()
    assert budget.held == 0 and budget.by_holder == {}
