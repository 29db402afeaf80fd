"""The crash matrix's episodes (crash/episodes.py): the reference an uninterrupted run makes is a function of the
group id, slot, env and task alone, with the episode's length; task ids parse totally."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crash.episodes import ENVS, MAX_TURNS, MIN_TURNS, index_of, reference, task, turns_of


@settings(max_examples=15, deadline=None)
@given(
    group_id=st.text(min_size=1, max_size=40),
    env=st.sampled_from(sorted(ENVS)),
    index=st.integers(min_value=0, max_value=10**6),
    slot=st.integers(min_value=0, max_value=3),
)
def test_the_reference_is_the_same_on_every_run_and_as_long_as_its_task(
    group_id: str, env: str, index: int, slot: int
) -> None:
    [once] = reference(group_id, env, task(index).id, 256, slots=[slot])
    [again] = reference(group_id, env, task(index).id, 256, slots=[slot])
    assert once == again
    assert MIN_TURNS <= once.generations == turns_of(index) <= MAX_TURNS
    assert len(once.turns) == once.generations - 1  # the last completion ends the episode, in the final post


def test_the_slots_of_a_group_differ_and_both_envs_make_the_same_walk() -> None:
    replay = reference("group-1", "trek", "trek-7")
    snapshot = reference("group-1", "trek_snapshot", "trek-7")
    assert len({e.digest for e in replay}) == len(replay) == 4
    assert replay == snapshot  # the same episode: only how a slot resumes differs


def test_a_token_limit_ends_the_episode_early_as_the_runner_s_would() -> None:
    [whole] = reference("g", "trek", "trek-7", slots=[0])
    [cut] = reference("g", "trek", "trek-7", 64, slots=[0])
    assert cut.generations < whole.generations and cut.digest != whole.digest


@given(st.text(max_size=20))
def test_task_ids_parse_totally(text: str) -> None:
    try:
        index = index_of(text)
    except ValueError:
        return
    assert index >= 0 and index_of(task(index).id) == index


@pytest.mark.parametrize("bad", ["trek-", "trek-٣", "trek--1", "walk-3", "trek-1.5", "trek-³"])
def test_ids_that_are_not_episodes_tasks_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not an episodes task id"):
        index_of(bad)
