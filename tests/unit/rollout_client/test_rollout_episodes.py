"""Durable episodes, the producer's pure side (rollout_client/episodes.py, `Session.end_turn`, `load_prefix`,
`replay`): a session rebuilt from any prefix of its turns and continued equals the uninterrupted one, token for
token, without generating the prefix again; the rules that choose how a leased slot continues; and a prefix
whose log is not a runner's (forged, Unicode digits) or whose tools do not replay the same is refused."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.wire.rollouts import TurnSnapshot, TurnView
from rollout_client import ScriptedPolicy, Task
from rollout_client.episodes import (
    Prefix,
    ReplayDiverged,
    RestoreFailed,
    TurnPiece,
    consistent_versions,
    generations,
    resume_mode,
    unpack,
)
from rollout_client.examples import SnapshotWalk, Walk, WalkEpisode, walk_script
from rollout_client.group import Rollout, run_rollout
from rollout_client.policy import Completion

TASK = Task("t", "go")


class Counting(ScriptedPolicy):
    """The scripted walk policy, counting its generations."""

    def __init__(self) -> None:
        super().__init__(walk_script)
        self.calls = 0

    async def generate(self, prompt_ids: list[int], **kw: Any) -> Completion:
        self.calls += 1
        return await super().generate(prompt_ids, **kw)


class Recording:
    """A turn sink that acknowledges every turn at once (what a server that never fails would do)."""

    def __init__(self, prefix: Prefix | None = None) -> None:
        self.pieces: list[TurnPiece] = []
        self.acked = 0 if prefix is None else prefix.turns
        self.acked_tokens = 0 if prefix is None else len(prefix.tokens)
        self.versions_sent: bool | None = None

    async def put(self, piece: TurnPiece) -> None:
        self.pieces.append(piece)
        self.acked, self.acked_tokens = piece.turn + 1, self.acked_tokens + len(piece.tokens)

    async def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def views(pieces: list[TurnPiece]) -> list[TurnView]:
    """The turns as a lease carries them back."""
    return [
        TurnView(
            turn=p.turn,
            producer="p1",
            tokens=p.tokens,
            masks=p.masks,
            inference_logprobs=p.logprobs,
            token_weight_versions=p.versions,
            tool_results=p.log,
        )
        for p in pieces
    ]


def snapshot_of(piece: TurnPiece) -> TurnSnapshot | None:
    if piece.snapshot is None:
        return None
    assert isinstance(piece.snapshot, bytes)
    return TurnSnapshot(data=base64.b64encode(piece.snapshot).decode())


def whole(env: Walk, slot: int = 0) -> tuple[Rollout, list[TurnPiece]]:
    sink = Recording()
    rollout = asyncio.run(run_rollout(env, TASK, ScriptedPolicy(walk_script), slot, group_key="g", turn_sink=sink))
    return rollout, sink.pieces


@settings(max_examples=25)
@given(turns=st.integers(1, 8), cut=st.integers(0, 8), slot=st.integers(0, 3), snapshot=st.booleans())
def test_a_session_continued_from_any_prefix_of_its_turns_equals_the_uninterrupted_one(
    turns: int, cut: int, slot: int, snapshot: bool
) -> None:
    env = SnapshotWalk() if snapshot else Walk()
    env.turns = turns
    uninterrupted, pieces = whole(env, slot)
    assert len(pieces) == turns - 1, "each step but the last is a turn; the last completion is the final post's"
    cut = min(cut, len(pieces))
    prefix = Prefix.of(views(pieces[:cut]), snapshot_of(pieces[cut - 1]) if cut else None)
    mode = resume_mode(env.resumes, env.on_new_weights, prefix, None)
    assert mode == ("restart" if cut == 0 else env.resumes)
    policy, sink = Counting(), Recording(prefix)
    resumed = asyncio.run(run_rollout(env, TASK, policy, slot, group_key="g", turn_sink=sink, prefix=prefix, mode=mode))
    assert (resumed.tokens, resumed.masks, resumed.logprobs) == (
        uninterrupted.tokens,
        uninterrupted.masks,
        uninterrupted.logprobs,
    ), "token-exact continuation"
    assert resumed.score == uninterrupted.score
    assert policy.calls == turns - cut, "the prefix's completions are not generated again"
    assert [p.turn for p in sink.pieces] == list(range(cut, turns - 1)), "it posts from turn prefix.turns on"
    assert [p.tokens for p in sink.pieces] == [p.tokens for p in pieces[cut:]]
    assert resumed.resumed_tokens == len(prefix.tokens)
    assert [t["prompt_tokens"] for t in resumed.turns] == [t["prompt_tokens"] for t in uninterrupted.turns]


def test_each_turn_carries_its_completions_and_tool_results_and_the_snapshot_after_it() -> None:
    _, pieces = whole(SnapshotWalk())
    first = pieces[0]
    assert first.log[0]["completion"].startswith(" MOVE ") and first.log[0]["tokens"] == len(first.log[0]["completion"])
    assert first.log[1] == {"tool": first.log[1]["tool"]} and first.log[1]["tool"].startswith("POS ")
    assert isinstance(first.snapshot, bytes) and json.loads(first.snapshot)["turn"] == 1
    _, replayed = whole(Walk())
    assert all(p.snapshot is None for p in replayed), "an env that replays sends no snapshot"


def test_a_tool_that_does_not_replay_the_same_is_refused_and_a_restore_that_fails_is_named() -> None:
    env = Walk()
    _, pieces = whole(env)
    forged = [*pieces[:2]]
    forged[1] = TurnPiece(1, [t + 1 for t in forged[1].tokens], *vars_of(forged[1]))
    prefix = Prefix.of(views(forged), None)
    with pytest.raises(ReplayDiverged):
        asyncio.run(run_rollout(env, TASK, Counting(), 0, group_key="g", prefix=prefix, mode="replay"))

    class Broken(SnapshotWalk):
        def restore(self, task: Task, snapshot: bytes | str) -> dict[str, Any]:
            raise ValueError("the sandbox image is gone")

    _, pieces = whole(SnapshotWalk())
    prefix = Prefix.of(views(pieces[:2]), snapshot_of(pieces[1]))
    with pytest.raises(RestoreFailed, match="sandbox image is gone"):
        asyncio.run(run_rollout(Broken(), TASK, Counting(), 0, group_key="g", prefix=prefix, mode="snapshot"))


def vars_of(p: TurnPiece) -> tuple[Any, ...]:
    return (p.masks, p.logprobs, p.versions, p.log, p.snapshot)


@given(st.lists(st.sampled_from([-100, 5]), max_size=12), st.lists(st.integers(0, 4), max_size=4))
def test_generations_split_the_trained_tokens_exactly_or_refuse(masks: list[int], lengths: list[int]) -> None:
    log = [{"completion": "x" * n, "tokens": n} for n in lengths]
    got = generations(masks, log)
    if got is None:
        return
    trained = [i for i, m in enumerate(masks) if m != -100]
    assert sorted(i for g in got for i in range(g.start, g.start + g.length)) == trained
    assert [g.length for g in got] == lengths


@pytest.mark.parametrize(
    "entry",
    [
        {"completion": "x", "tokens": "１"},  # a Unicode digit, not an int
        {"completion": "x", "tokens": True},
        {"completion": "x", "tokens": -1},
        {"completion": 3, "tokens": 1},
        {"completion": "x", "tokens": 5},  # more than the trained tokens
    ],
)
def test_a_log_that_is_not_a_runners_makes_a_prefix_that_restarts(entry: dict[str, Any]) -> None:
    item = TurnView(
        turn=0, producer="x", tokens=[1, 2], masks=[-100, 2], inference_logprobs=None,
        token_weight_versions=None, tool_results=[entry],
    )  # fmt: skip
    prefix = Prefix.of([item], TurnSnapshot(uri="s3://bucket/state"))
    assert prefix.generations is None and prefix.snapshot == "s3://bucket/state"
    assert resume_mode("replay", "continue", prefix, None) == "restart"
    assert resume_mode("snapshot", "continue", prefix, None) == "restart"


def test_how_a_leased_slot_continues() -> None:
    item = TurnView(
        turn=0, producer="x", tokens=[1, 2], masks=[-100, 2], inference_logprobs=[1.0, -0.5],
        token_weight_versions=[3, 3], tool_results=[{"completion": "b", "tokens": 1}],
    )  # fmt: skip
    snap = Prefix.of([item], TurnSnapshot(data=base64.b64encode(b"s").decode()))
    bare = Prefix.of([item], None)
    assert resume_mode("snapshot", "continue", snap, 9) == "snapshot", "continue keeps the prefix's versions"
    assert resume_mode("snapshot", "continue", bare, None) == "restart", "no snapshot to restore from"
    assert resume_mode("replay", "continue", bare, None) == "replay"
    assert resume_mode("replay", "drain", bare, 3) == "replay", "the prefix's weights are the current ones"
    assert resume_mode("replay", "drain", bare, 4) == "restart", "other weights sampled the prefix"
    assert resume_mode("replay", "restart", bare, 4) == "restart"
    assert resume_mode("restart", "continue", snap, None) == "restart"
    assert resume_mode("replay", "continue", None, None) == "restart"
    assert unpack(None) is None and unpack(TurnSnapshot(data="YWI=")) == b"ab"


def test_a_slots_turns_send_versions_all_or_none() -> None:
    assert consistent_versions(None, [1]) == (True, [1]) and consistent_versions(None, None) == (True, None)
    assert consistent_versions(True, [2]) == (True, [2]) and consistent_versions(True, None) == (False, None)
    assert consistent_versions(False, [2]) == (True, None), "the first turn sent none: none is sent"


def test_a_walk_episode_is_deterministic() -> None:
    a, b = WalkEpisode(3), WalkEpisode(3)
    assert [a.step(" MOVE 4\n") for _ in range(3)] == [b.step(" MOVE 4\n") for _ in range(3)]
    assert a.position == 12 and a.score() == 1.0 and a.step("nothing") == ("POS 12\n", True)
