"""`rollout_client.runner.following.Follower`: announced weights become the stamp of new groups; groups in flight meet
them by their env's `on_new_weights` (continue: the span is recorded; restart: cancelled, the task run again)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.wire.schema import EnvStatus, ScoredData
from rollout_client.env import Task
from rollout_client.examples import Arithmetic
from rollout_client.runner.following import RESTARTED, Follower, token_versions
from rollout_client.runner.inflight import Group, InFlight
from rollout_client.runner.stats import RunnerStats

pytestmark = pytest.mark.anyio


def status(weights: int | None, pending: int | None = None) -> EnvStatus:
    return EnvStatus(
        current_step=9,
        queue_size=0,
        unallocated_fraction=1.0,
        self_queue_size=0,
        max_group_size=2,
        env_weight=1.0,
        weights_step=weights,
        weights_pending=pending,
    )


GROUP = ScoredData(tokens=[[1, 2]], masks=[[-100, 2]], scores=[1.0], generation_params={"temperature": 1.0})


async def test_continue_records_the_span_and_restart_runs_the_task_again() -> None:
    keep, again = Arithmetic(name="keep"), Arithmetic(name="again")
    again.on_new_weights = "restart"
    follow = Follower([keep, again])
    in_flight = InFlight(16, RunnerStats())
    forever = asyncio.Event()
    tasks = [asyncio.create_task(forever.wait()) for _ in range(2)]
    for n, (env, t) in enumerate(zip((0, 1), tasks, strict=True)):
        in_flight.add(f"g{n}", Group(t, env, 2, policy_step=3))
        follow.launched(f"g{n}", env, Task(id=f"t{n}", prompt="Q"))
    assert follow.observed([status(None)], in_flight) is None  # nothing announced: the runner's own step rules
    assert follow.stamp("g0", GROUP, 3) is GROUP
    assert follow.observed([status(5), status(4)], in_flight) == 5
    assert follow.observed([status(5)], in_flight) is None  # not new
    # turns that name no weights: the range the group was in flight over, as an estimate
    assert follow.stamp("g0", GROUP, 3).generation_params == {
        "temperature": 1.0,
        "weight_versions": [3, 5],
        "weight_versions_exact": False,
    }
    await asyncio.sleep(0)
    assert tasks[1].cancelled() and not tasks[0].done()
    assert in_flight.stats.skipped[RESTARTED] == 1
    assert follow.ended("g1") is True  # cancelled to run again: its task is not discarded
    restarted = follow.restart(1)
    assert restarted is not None and restarted.id == "t1" and follow.restart(1) is None
    again = asyncio.create_task(forever.wait())
    in_flight.add("g2", Group(again, 1, 2, policy_step=5))
    follow.launched("g2", 1, restarted)
    assert follow.observed([status(6)], in_flight) == 6
    assert [(i, t.id) for i, t in follow.drop_restarts()] == [(1, "t1")]  # the run stops first: discarded
    assert follow.restart(1) is None
    assert follow.ended("g0") is False
    assert follow.stamp("fresh", GROUP, 5).generation_params == {
        "temperature": 1.0,
        "weight_versions": [5, 5],
        "weight_versions_exact": False,
    }
    forever.set()
    await tasks[0]


async def test_a_pending_sync_holds_only_drain_envs_which_are_drained_once_none_of_theirs_generates() -> None:
    keep, drain = Arithmetic(name="keep"), Arithmetic(name="drain")
    drain.on_new_weights = "drain"
    follow = Follower([keep, drain])
    assert follow.drains and Follower([keep]).drains  # every producer holds its generation for a sync
    in_flight = InFlight(16, RunnerStats())
    forever = asyncio.Event()
    tasks = [asyncio.create_task(forever.wait()) for _ in range(2)]
    for n, t in enumerate(tasks):
        in_flight.add(f"g{n}", Group(t, n, 2, policy_step=3))
    follow.observed([status(3)], in_flight)
    assert not follow.holds(1) and follow.drained_for(in_flight) is None  # no sync pending
    follow.observed([status(3, pending=4)], in_flight)
    assert follow.holds(1) and not follow.holds(0)
    assert follow.drained_for(in_flight) is None  # the drain env's group still generates
    in_flight.groups["g1"].submitting = True  # its tokens are sampled: it no longer holds the sync
    assert follow.episodes_over(in_flight)  # the continue env's group in flight does not count
    assert follow.drained_for(in_flight) is None  # until generation is held with no request in flight
    follow.quiesced = 4
    assert follow.drained_for(in_flight) == 4
    assert follow.observed([status(4)], in_flight) == 4  # announced: the sync is over
    assert not follow.holds(1) and follow.drained_for(in_flight) is None
    follow.observed([status(4, pending=4)], in_flight)  # a stale pending read beside the announcement
    assert not follow.holds(1)
    forever.set()
    await asyncio.gather(*tasks)


def with_turns(*per_sequence: list[int | None]) -> ScoredData:
    """A group whose sequences' turns name these weights versions (None: a turn that names none)."""
    turns = [
        [{"completion_tokens": 1} if v is None else {"completion_tokens": 1, "weights": v} for v in seq]
        for seq in per_sequence
    ]
    n = len(per_sequence)
    return ScoredData(
        tokens=[[1, 2]] * n, masks=[[-100, 2]] * n, scores=[1.0] * n, overrides=[{"turns": t} for t in turns]
    )


def test_a_group_states_the_versions_its_turns_name_exact_only_under_the_sync_handshake() -> None:
    follow = Follower([Arithmetic()])
    in_flight = InFlight(16, RunnerStats())
    assert follow.observed([status(3)], in_flight) == 3  # announced before this producer held anything
    stamped = follow.stamp("g", with_turns([3, 3], [3]), 2)
    assert stamped.policy_step == 3 and stamped.generation_params == {
        "weight_versions": [3, 3],
        "weight_versions_exact": False,
    }
    follow.observed([status(3, pending=4)], in_flight)
    follow.quiesced = 4  # the watch held generation: no request in flight
    assert follow.observed([status(4)], in_flight) == 4 and follow.handshake
    span = follow.stamp("g", with_turns([3, 4], [4]), 3)
    assert span.policy_step == 3 and span.generation_params == {
        "weight_versions": [3, 4],
        "weight_versions_exact": True,
    }
    follow.quiesced = None
    assert follow.observed([status(5)], in_flight) == 5 and not follow.handshake  # announced without holding
    late = follow.stamp("g", with_turns([4], [5]), 4).generation_params or {}
    assert late == {"weight_versions": [4, 5], "weight_versions_exact": False}  # 4 ended without the handshake
    early = follow.stamp("g", with_turns([3]), 3).generation_params or {}
    assert early["weight_versions_exact"] is True  # 3 ended under it
    unknown = follow.stamp("g", with_turns([5, None]), 5)  # a turn that names no version: the range, estimated
    assert unknown.policy_step is None and (unknown.generation_params or {})["weight_versions_exact"] is False


episodes = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 9)), min_size=1, max_size=5)
"""Per turn: tokens observed before it (prompt, tool output), tokens it sampled, its weights version."""


def episode(turns: list[tuple[int, int, int]], tail: int) -> tuple[list[int], dict[str, object], list[int]]:
    """The tokens, the `overrides` record a session writes, and the version each token should carry."""
    tokens: list[int] = []
    records, expected = [], []
    for observed, sampled, weights in turns:
        tokens += [1] * observed
        expected += [weights] * (observed + sampled)
        records.append({"prompt_tokens": len(tokens), "completion_tokens": sampled, "weights": weights})
        tokens += [2] * sampled
    tokens += [3] * tail
    expected += [turns[-1][2]] * tail
    return tokens, {"turns": records}, expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(episodes, st.integers(0, 3)), min_size=1, max_size=4))
def test_each_token_carries_the_version_of_the_turn_that_sampled_or_read_it(
    sequences: list[tuple[list[tuple[int, int, int]], int]],
) -> None:
    built = [episode(turns, tail) for turns, tail in sequences]
    if any(not tokens for tokens, _, _ in built):
        return  # an empty sequence is no group
    group = ScoredData(
        tokens=[t for t, _, _ in built],
        masks=[t for t, _, _ in built],
        scores=[0.0] * len(built),
        overrides=[o for _, o, _ in built],
    )
    assert token_versions(group) == [e for _, _, e in built]


def test_no_per_token_versions_where_a_turn_names_none_or_lies_outside_its_tokens() -> None:
    tokens, record, _ = episode([(2, 3, 4), (1, 2, 5)], 1)
    turns: list[dict[str, object]] = record["turns"]  # type: ignore[assignment]
    group = ScoredData(tokens=[tokens], masks=[tokens], scores=[0.0], overrides=[record])
    assert token_versions(group) == [[4, 4, 4, 4, 4, 5, 5, 5, 5]]
    unnamed = [turns[0], {k: v for k, v in turns[1].items() if k != "weights"}]
    assert token_versions(group.model_copy(update={"overrides": [{"turns": unnamed}]})) is None
    beyond = [turns[0], {**turns[1], "completion_tokens": 9}]
    assert token_versions(group.model_copy(update={"overrides": [{"turns": beyond}]})) is None
    assert token_versions(group.model_copy(update={"overrides": None})) is None


def test_the_stamp_carries_per_token_versions_beside_the_range() -> None:
    follow = Follower([Arithmetic()])
    in_flight = InFlight(16, RunnerStats())
    assert follow.observed([status(4)], in_flight) == 4
    tokens, record, expected = episode([(2, 3, 3), (1, 2, 4)], 0)
    stamped = follow.stamp("g", ScoredData(tokens=[tokens], masks=[tokens], scores=[0.0], overrides=[record]), 3)
    assert stamped.policy_step == 3 and (stamped.generation_params or {})["weight_versions"] == [3, 4]
    assert stamped.token_weight_versions == [expected]
