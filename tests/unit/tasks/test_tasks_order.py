"""The weighted (curriculum) order (api/tasks/order.py), as pure logic: each epoch hands out every task of every
level once, fixed by (seed, epoch), and heavier levels come sooner."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from api.tasks.order import level_at, weighted_at

LEVELS = ["a", "b", "c", "d"]
sizes_st = st.dictionaries(st.sampled_from(LEVELS), st.integers(0, 12), min_size=1).filter(lambda s: sum(s.values()))
weights_st = st.fixed_dictionaries({k: st.floats(0.01, 100) for k in LEVELS})


def walk(seed: int, epoch: int, weights: dict[str, float], sizes: dict[str, int]) -> list[tuple[str, int]]:
    """An epoch's (level, rank) picks, counted as the cursor counts them."""
    taken: dict[str, int] = {}
    out = []
    for position in range(sum(sizes.values())):
        level, rank = weighted_at(seed, epoch, position, weights, sizes, taken)
        taken[level] = taken.get(level, 0) + 1
        out.append((level, rank))
    return out


@given(seed=st.integers(0, 2**40), epoch=st.integers(0, 5), weights=weights_st, sizes=sizes_st)
def test_an_epoch_hands_out_every_task_once(seed: int, epoch: int, weights: dict[str, float], sizes: dict) -> None:
    picks = walk(seed, epoch, weights, sizes)
    for level in LEVELS:
        ranks = sorted(rank for picked, rank in picks if picked == level)
        assert ranks == list(range(sizes.get(level, 0))), f"level {level}: each of its tasks once"
    assert picks == walk(seed, epoch, weights, sizes), "fixed by the seed and the epoch"


@given(seed=st.integers(0, 2**40), weights=weights_st, left=st.dictionaries(st.sampled_from(LEVELS), st.integers(0, 3)))
def test_a_level_is_drawn_only_while_it_has_tasks_left(seed: int, weights: dict[str, float], left: dict) -> None:
    if not any(left.values()):
        return
    for position in range(20):
        assert left[level_at(seed, 0, position, weights, left)] > 0


def test_heavier_levels_come_sooner_and_epochs_differ() -> None:
    weights, sizes = {"easy": 9.0, "hard": 1.0}, {"easy": 1000, "hard": 1000}
    picks = walk(7, 0, weights, sizes)
    first = [level for level, _ in picks[:1000]]
    assert 850 < first.count("easy") < 950, "about 9 in 10 while both levels last"
    assert [level for level, _ in picks[1900:]] == ["hard"] * 100, "the light level's rest at the end"
    assert picks != walk(7, 1, weights, sizes) and picks != walk(8, 0, weights, sizes)
