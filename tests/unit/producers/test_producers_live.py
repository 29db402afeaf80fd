"""`api.producers.live`: the table of producers stays bounded, and `stall_reason` speaks only when nothing can
arrive (no live producer for the connected envs, or every live one held back waiting for the trainer)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.producers import live
from api.producers.live import Producer, TooManyProducers, record, undrained

GONE = 30.0


def beat(pid: str, envs: list[int], at: float, **kw: object) -> Producer:
    """A producer heard of at `at`, its verdicts judged at step 0 before any weights were announced."""
    return Producer(pid, "h", envs, last_seen=at, first_seen=at, **{"judged_step": 0, **kw})  # type: ignore[arg-type]


def stall_reason(connected: dict[int, str], table: dict[str, Producer], now: float, gone_after: float) -> str | None:
    """`live.stall_reason` with the trainer at step 0, no weights announced: where `beat` judges."""
    return live.stall_reason(connected, table, now, gone_after, step=0, weights=None)


def test_a_heartbeat_keeps_the_first_seen_time() -> None:
    table: dict[str, Producer] = {}
    record(table, beat("a", [0], 1.0), 1.0, GONE, 4)
    record(table, beat("a", [0], 5.0, in_flight=3), 5.0, GONE, 4)
    assert (table["a"].first_seen, table["a"].last_seen, table["a"].in_flight) == (1.0, 5.0, 3)


@given(st.lists(st.tuples(st.integers(0, 20), st.floats(0, 1000)), max_size=60), st.integers(1, 8))
def test_the_table_never_passes_its_bound_and_refuses_only_when_every_one_is_live(
    beats: list[tuple[int, float]], bound: int
) -> None:
    table: dict[str, Producer] = {}
    now = 0.0
    for pid, dt in beats:
        now += dt
        try:
            record(table, beat(str(pid), [0], now), now, GONE, bound)
        except TooManyProducers:
            assert len(table) == bound and all(p.live(now, GONE) for p in table.values())
        assert len(table) <= bound


def test_no_env_and_no_producer_is_a_stall_and_a_live_producer_is_not() -> None:
    assert "no environment is registered" in (stall_reason({}, {}, 0.0, GONE) or "")
    assert stall_reason({}, {"a": beat("a", [], 0.0)}, 1.0, GONE) is None
    assert "no producer is live" in (stall_reason({}, {"a": beat("a", [0], 0.0)}, 100.0, GONE) or "")


def test_an_env_no_producer_reports_for_is_never_judged() -> None:
    table = {"a": beat("a", [0], 0.0)}
    assert stall_reason({0: "math", 1: "atropos"}, table, 100.0, GONE) is None  # env 1's handler may send


def test_gone_producers_of_every_connected_env_are_a_stall_naming_the_last_one() -> None:
    table = {"a": beat("a", [0], 0.0), "b": beat("b", [0], 50.0)}
    why = stall_reason({0: "math_0"}, table, 50.0 + GONE + 1, GONE)
    assert why is not None and "no live producer for env(s) math_0" in why and "b on h" in why and "31 s ago" in why
    assert stall_reason({0: "math_0"}, table, 50.0 + GONE, GONE) is None


def test_every_live_producer_held_back_on_the_trainer_is_a_stall_but_a_full_queue_is_not() -> None:
    held = {"a": beat("a", [0], 0.0, held={"math_0": "ahead_of_trainer"}, weights_step=3)}
    why = stall_reason({0: "math_0"}, held, 1.0, GONE)
    assert why is not None and "held back (ahead_of_trainer)" in why and "POST /weights" in why
    full = {"a": beat("a", [0], 0.0, held={"math_0": "queue_full"})}
    assert stall_reason({0: "math_0"}, full, 1.0, GONE) is None
    one_free = {**held, "b": beat("b", [0], 0.0)}
    assert stall_reason({0: "math_0"}, one_free, 1.0, GONE) is None


STEPS = st.one_of(st.none(), st.integers(0, 5))


@given(st.integers(0, 5), st.integers(0, 5), STEPS, STEPS, STEPS)
def test_a_held_back_verdict_is_a_stall_only_when_judged_where_the_trainer_stands(
    judged_step: int, step: int, judged_weights: int | None, weights: int | None, generating: int | None
) -> None:
    """Judged at an earlier step, before the weights announced last, or with older weights than those (not read
    yet): the producer may start groups once it reads where the trainer is, so nothing says it cannot."""
    p = beat(
        "a",
        [0],
        0.0,
        held={"math_0": "ahead_of_trainer"},
        judged_step=judged_step,
        judged_weights=judged_weights,
        weights_step=generating,
    )
    why = live.stall_reason({0: "math_0"}, {"a": p}, 1.0, GONE, step=step, weights=weights)
    current = judged_step >= step and judged_weights == weights
    read = weights is None or generating is None or generating >= weights
    assert (why is not None) == (current and read)
    unknown = beat("b", [0], 0.0, held={"math_0": "draining"}, judged_step=None)  # an earlier release's record
    assert live.stall_reason({0: "math_0"}, {"b": unknown}, 1.0, GONE, step=0, weights=None) is None


@pytest.mark.parametrize("now", [0.0, 10.0, GONE])
def test_a_producer_is_live_within_gone_after(now: float) -> None:
    assert beat("a", [0], 0.0).live(now, GONE)
    assert not beat("a", [0], 0.0).live(now + GONE + 0.001, GONE)


@given(
    st.lists(st.tuples(st.booleans(), st.one_of(st.none(), st.integers(0, 6)), st.floats(0, 100)), max_size=12),
    st.integers(0, 6),
)
def test_a_sync_waits_exactly_for_the_live_drain_producers_not_drained_for_it(
    rows: list[tuple[bool, int | None, float]], pending: int
) -> None:
    now = 100.0
    table = {f"p{i}": beat(f"p{i}", [0], at, drains=d, drained_for=f) for i, (d, f, at) in enumerate(rows)}
    waited = {p.producer_id for p in undrained(table, pending, now, GONE)}
    for pid, p in table.items():
        expected = p.drains and now - p.last_seen <= GONE and (p.drained_for is None or p.drained_for < pending)
        assert (pid in waited) == expected


def test_a_producer_drained_for_an_earlier_sync_is_waited_for_and_a_gone_one_is_not() -> None:
    table = {"a": beat("a", [0], 99.0, drains=True, drained_for=3), "b": beat("b", [0], 1.0, drains=True)}
    assert [p.producer_id for p in undrained(table, 4, 100.0, GONE)] == ["a"]
    assert undrained(table, 3, 100.0, GONE) == []
