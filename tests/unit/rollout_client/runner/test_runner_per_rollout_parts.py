"""The runner's per-rollout pieces alone (rollout_client/runner/per_rollout.py, `Environment.posts_each_rollout`): what
a slot holds, the task a sibling lease carries, what follows the last post, the sibling holds, the env checks,
and the executor posting each rollout as it ends and redoing only unacknowledged slots when a group runs again."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.wire.rollouts import GroupView
from rollout_client import Gate, ScriptedPolicy, Session, Task, Timeouts
from rollout_client.env import ExternalSequence
from rollout_client.examples import Arithmetic, arithmetic_script, arithmetic_task
from rollout_client.group import Rollout, build_group, rollout_seed
from rollout_client.resources import Capacity
from rollout_client.runner.execution import GroupExecutor, check_env
from rollout_client.runner.inflight import Group, InFlight
from rollout_client.runner.per_rollout import (
    REFUSED,
    SEAL,
    STORED,
    Holds,
    deadline_s,
    slot_content,
    task_from_wire,
    task_to_wire,
    verdict,
)
from rollout_client.runner.stats import RunnerStats


def rollout(external: list[ExternalSequence] | None = None) -> Rollout:
    return Rollout([1, 2, 3], [-100, 2, 3], [1.0, -0.5, -0.25], [], False, "stop", {}, score=0.5, external=external)


def view(state: str) -> GroupView:
    return GroupView(  # type: ignore[arg-type]
        group_id="g",
        env_id=0,
        state=state,
        group_size=4,
        min_group_size=2,
        producer="p",
        deadline=0.0,
        expires_at=0.0,
        done=[],
        leased={},
        redispatched=0,
        left_out={},
    )


def test_a_slot_holds_the_transcript_or_its_one_recorded_sequence() -> None:
    """As the whole group's row would: its overrides entry is the one `build_group` writes for it."""
    whole = build_group(Task("t", "p"), [rollout()], [0.5], [0.0], 0.0)
    c = slot_content(rollout())
    assert (c.tokens, c.masks, c.logprobs, c.score) == ([1, 2, 3], [-100, 2, 3], [1.0, -0.5, -0.25], 0.5)
    assert whole.overrides is not None and c.overrides == whole.overrides[0]
    seq = ExternalSequence([4, 5], [-100, 5], [1.0, -0.1], 2.0, overrides={"judge": "ok"})
    c = slot_content(rollout([seq]))
    assert (c.tokens, c.masks, c.logprobs, c.score) == ([4, 5], [-100, 5], [1.0, -0.1], 2.0)
    assert c.overrides == {"rollout_s": 0.0, "score_s": 0.0, "judge": "ok"}
    for n in (0, 2):
        with pytest.raises(ValueError, match="one sequence"):
            slot_content(rollout([seq] * n))


@given(
    st.text(min_size=1),
    st.text(),
    st.text(),
    st.none() | st.integers() | st.text(),
    st.dictionaries(st.text(), st.integers()),
)
def test_a_task_comes_back_from_a_sibling_lease_as_it_was_opened(
    env: str, task_id: str, prompt: str, answer: Any, meta: dict[str, int]
) -> None:
    task = Task(task_id, prompt, answer, meta)
    assert task_from_wire(task_to_wire(env, task)) == (env, task)


def test_a_lease_of_another_clients_group_names_no_task() -> None:
    for obj in (None, "2+2", {"prompt": "2+2"}, {"env": "e", "id": 1, "prompt": "x"}):
        assert task_from_wire(obj) is None


def test_after_the_last_post_the_runner_seals_only_an_open_group() -> None:
    assert verdict(None) == SEAL
    assert verdict(view("open")) == SEAL
    assert verdict(view("sealing")) == verdict(view("sealed")) == STORED
    assert verdict(view("expired")) == REFUSED


def test_the_deadline_is_the_runners_bound_on_a_group() -> None:
    assert deadline_s(120.0, 3600.0) == 120.0
    assert deadline_s(None, 3600.0) == deadline_s(float("inf"), 3600.0) == deadline_s(0.0, 3600.0) == 3600.0


@given(st.lists(st.sampled_from("abc"), max_size=20))
def test_a_sibling_group_is_let_go_with_its_last_slot(ids: list[str]) -> None:
    holds = Holds()
    for g in ids:
        holds.take(g)
    assert len(holds) == len(ids)
    left = Counter(ids)
    for g in ids:
        left[g] -= 1
        assert holds.give(g) == (left[g] == 0)
    assert len(holds) == 0


@dataclass
class Alone(Arithmetic):
    scores_each_rollout: bool = True
    posts_each_rollout: bool = True


def test_posting_each_rollout_needs_scores_each_rollout_and_no_restart() -> None:
    check_env(Alone(), 64)
    with pytest.raises(ValueError, match="needs scores_each_rollout"):
        check_env(Alone(scores_each_rollout=False), 64)
    bad = Alone()
    bad.on_new_weights = "restart"
    with pytest.raises(ValueError, match="restart"):
        check_env(bad, 64)


@dataclass
class FlakySlot(Alone):
    """Group "g": on the first attempt, slot 3 fails once the even slots are posted, the other odd slots are still
    running then (and cancelled); on the second, every slot runs through."""

    group_size: int = 8
    min_group_size: int | None = 8
    group_retries: int = 1
    runs: list[int] = field(default_factory=list)
    evens_posted: asyncio.Event = field(default_factory=asyncio.Event)

    async def rollout(self, task: Task, session: Session) -> None:
        slot = next(k for k in range(self.group_size) if rollout_seed("g", k) == session.seed)
        self.runs.append(slot)
        if self.runs.count(slot) == 1 and slot == 3:
            await self.evens_posted.wait()
            raise RuntimeError("slot 3 crashed")
        if self.runs.count(slot) == 1 and slot % 2 == 1:
            await asyncio.Event().wait()  # running when slot 3 fails
        await super().rollout(task, session)


class Recorder:
    """Stands in for `Poster` where no server is involved: what was posted, by slot."""

    def __init__(self, env: FlakySlot) -> None:
        self.env = env
        self.done: dict[int, Rollout] = {}
        self.handed_over: set[int] = set()
        self.posts: list[int] = []

    async def __call__(self, slot: int, r: Rollout) -> None:
        self.posts.append(slot)
        self.done[slot] = r
        if {0, 2, 4, 6} <= set(self.posts):
            self.env.evens_posted.set()


@pytest.mark.anyio
async def test_a_group_run_again_redoes_only_the_slots_not_posted() -> None:
    env = FlakySlot()
    stats = RunnerStats()
    in_flight = InFlight(8, stats)
    executor = GroupExecutor(
        [env],
        pool=None,
        policy=ScriptedPolicy(arithmetic_script),
        limits=Timeouts().limits(),
        group_timeout=None,
        in_flight=in_flight,
        capacity=[Capacity(None)],
        gate=Gate(),
        stats=stats,
        stopping=asyncio.Event(),
        on_rollout_end=in_flight.ended,
    )
    poster = Recorder(env)
    task = asyncio.create_task(executor.run(0, arithmetic_task(1), "g", poster))  # type: ignore[arg-type]
    in_flight.add("g", Group(task, 0, env.group_size, 0))  # type: ignore[arg-type]
    outcome = await task
    assert stats.retried == 1
    assert sorted(poster.posts) == list(range(8)), "each slot posted once, over both attempts"
    assert Counter(env.runs) == {0: 1, 2: 1, 4: 1, 6: 1, 1: 2, 3: 2, 5: 2, 7: 2}, "posted slots never run again"
    assert outcome.group is not None and len(outcome.group.tokens) == 8
    assert in_flight.groups["g"].held == 0, "every slot given back, those of posted slots at once"
