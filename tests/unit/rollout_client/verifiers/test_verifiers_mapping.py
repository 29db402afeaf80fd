"""rollout_client.verifiers.mapping: a verifiers episode as rollbuf sequences. Property-tested over episodes
built as plain records (the mapping reads attributes only), in both per-token forms verifiers produces: lists
(0.4.0) and int32/bool/float32 numpy arrays (0.4.1.dev); and checked exactly on an episode recorded from a
real verifiers 0.4.0 run (`data/verifiers_episode_0.4.0.json`, the tiny env of tests/verifiers_tiny.py)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from rollout_client.verifiers.mapping import (
    UNSAMPLED_LOGPROB,
    branch_streams,
    branch_versions,
    episode_failure,
    group_verdict,
    map_episode,
)

RECORDED = Path(__file__).parent / "data" / "verifiers_episode_0.4.0.json"


@dataclass
class Error:
    type: str
    message: str = ""


@dataclass
class Agent:
    name: str = "agent"
    trainable: bool = True


@dataclass
class Node:
    weight_versions: list[int] | None = None
    token_ids: Any = None
    mask: Any = None


@dataclass
class Branch:
    index: int
    token_ids: Any
    sampled_mask: Any
    logprobs: Any
    trainable: bool = True
    nodes: list[Node] = field(default_factory=list)


@dataclass
class Trace:
    id: str
    reward: float
    branches: list[Branch]
    agent: Agent = field(default_factory=Agent)
    stop_condition: str | None = "agent_completed"
    num_turns: int = 1
    is_truncated: bool = False
    ok: bool = True
    errors: list[Error] = field(default_factory=list)
    dropped: str | None = None


@dataclass
class Episode:
    traces: list[Trace]
    ok: bool = True
    is_timeout: bool = False
    errors: list[Error] = field(default_factory=list)
    id: str = "ep"


def as_arrays(b: Branch) -> Branch:
    """The branch as verifiers 0.4.1.dev gives it: int32 / bool / float32 numpy arrays."""
    return Branch(
        b.index,
        np.asarray(b.token_ids, dtype=np.int32),
        np.asarray(b.sampled_mask, dtype=bool),
        np.asarray(b.logprobs, dtype=np.float32),
        b.trainable,
        b.nodes,
    )


# logprobs exact in float32, so the array form must give the very same numbers
LOGPROB = st.integers(-4096, 0).map(lambda k: k / 64)


@st.composite
def branches(draw: st.DrawFn, index: int = 0) -> Branch:
    n = draw(st.integers(1, 12))
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    sampled = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    lps = [draw(LOGPROB) if s else 0.0 for s in sampled]  # verifiers spreads 0.0 off the sampled positions
    return Branch(index, tokens, sampled, lps, trainable=draw(st.booleans()) or draw(st.booleans()))


@st.composite
def traces(draw: st.DrawFn, i: int) -> Trace:
    bs = [draw(branches(index=k)) for k in range(draw(st.integers(1, 3)))]
    return Trace(
        id=f"t{i}",
        reward=draw(st.sampled_from([0.0, 0.5, 1.0])),
        branches=bs,
        agent=Agent(trainable=draw(st.booleans()) or draw(st.booleans())),
        dropped=draw(st.sampled_from([None, None, None, "length"])),
    )


@st.composite
def episodes(draw: st.DrawFn) -> Episode:
    return Episode([draw(traces(i)) for i in range(draw(st.integers(0, 4)))])


@given(branches())
def test_branch_streams_mask_and_sentinel_every_position(b: Branch) -> None:
    tokens, masks, logprobs = branch_streams(b.token_ids, b.sampled_mask, b.logprobs)
    assert tokens == list(b.token_ids) and len(masks) == len(logprobs) == len(tokens)
    for t, s, lp, m, out in zip(b.token_ids, b.sampled_mask, b.logprobs, masks, logprobs, strict=True):
        assert (m, out) == ((t, lp) if s else (-100, UNSAMPLED_LOGPROB))


@given(branches())
def test_numpy_arrays_map_exactly_as_lists(b: Branch) -> None:
    assert branch_streams(b.token_ids, b.sampled_mask, b.logprobs) == branch_streams(
        *(lambda a: (a.token_ids, a.sampled_mask, a.logprobs))(as_arrays(b))
    )


@given(episodes())
def test_every_trainable_branch_of_every_kept_trace_and_nothing_else(ep: Episode) -> None:
    mapped = map_episode(ep)
    expected: list[tuple[str, int]] = []
    left: Counter[str] = Counter()
    for t in ep.traces:
        if t.dropped:
            left[f"dropped:{t.dropped}"] += 1
        elif not t.agent.trainable:
            left["untrainable_trace"] += 1
        else:
            for b in t.branches:
                if not b.trainable:
                    left["untrainable_branch"] += 1
                elif not any(b.sampled_mask):
                    left["nothing_sampled"] += 1
                else:
                    expected.append((t.id, b.index))
    assert [(s.overrides["trace_id"], s.overrides["branch"]) for s in mapped.sequences] == expected
    assert mapped.left_out == left
    rewards = {t.id: t.reward for t in ep.traces}
    assert all(s.score == rewards[s.overrides["trace_id"]] for s in mapped.sequences)
    # the same episode in verifiers 0.4.1.dev's array form maps to the same sequences
    arrays = Episode(
        [Trace(t.id, t.reward, [as_arrays(b) for b in t.branches], t.agent, dropped=t.dropped) for t in ep.traces]
    )
    assert map_episode(arrays) == mapped


def test_a_failed_episode_is_named_by_its_error() -> None:
    assert episode_failure(Episode([])) is None
    assert episode_failure(Episode([], ok=False, is_timeout=True)) == "episode_timeout"
    assert episode_failure(Episode([], ok=False, errors=[Error("EnvError")])) == "episode_error:EnvError"
    failed = Trace("t", 0.0, [], ok=False, errors=[Error("ProviderError", "400")])
    assert episode_failure(Episode([failed], ok=False)) == "episode_error:ProviderError"
    assert episode_failure(Episode([], ok=False)) == "episode_error"


@given(st.lists(st.sampled_from([0.0, 0.5, 1.0]), max_size=6), st.booleans())
def test_group_verdict(scores: list[float], variance: bool) -> None:
    verdict = group_verdict(scores, require_variance=variance)
    if len(scores) < 2:
        assert verdict == "too_few_sequences"
    elif variance and len(set(scores)) == 1:
        assert verdict == "no_reward_variance"
    else:
        assert verdict is None


@given(st.lists(st.integers(1, 10), min_size=1, max_size=5), st.integers(1, 10))
def test_branches_past_the_token_limit_are_left_out(lengths: list[int], limit: int) -> None:
    bs = [Branch(k, [1] * n, [True] * n, [-0.5] * n) for k, n in enumerate(lengths)]
    mapped = map_episode(Episode([Trace("t", 1.0, bs)]), token_limit=limit)
    assert [s.overrides["branch"] for s in mapped.sequences] == [k for k, n in enumerate(lengths) if n <= limit]
    assert mapped.left_out["too_long"] == sum(n > limit for n in lengths)


def test_weight_versions_recorded_where_the_server_reports_them() -> None:
    b = Branch(0, [1, 2], [False, True], [0.0, -0.5], nodes=[Node(), Node([7, 9])])
    (seq,) = map_episode(Episode([Trace("t", 1.0, [b])])).sequences
    assert seq.overrides["weight_versions"] == [7, 9]


def test_a_recorded_verifiers_episode_maps_exactly_in_both_forms() -> None:
    from verifiers.v1 import WireEpisode

    episode = WireEpisode.model_validate(json.loads(RECORDED.read_text()))
    (trace,) = episode.traces
    mapped = map_episode(episode)
    (seq,) = mapped.sequences
    prompt = [257, *b"user\nSay apple.", 258, 10, 257, *b"assistant\n"]
    completion = [*b"apple", 258]
    assert seq.tokens == prompt + completion
    assert seq.masks == [-100] * len(prompt) + completion
    assert seq.logprobs == [1.0] * len(prompt) + [-(i + 1) / 64 for i in range(len(completion))]
    assert seq.score == trace.reward == 1.0
    assert seq.overrides == {
        "trace_id": trace.id,
        "branch": 0,
        "agent": "agent",
        "stop_condition": "agent_completed",
        "num_turns": 1,
        "truncated": False,
        "episode_id": episode.id,
    }
    assert not mapped.left_out
    # 0.4.1.dev's form: the same branch's streams as numpy arrays
    (branch,) = trace.branches
    arrays = as_arrays(Branch(0, branch.token_ids, branch.sampled_mask, branch.logprobs))
    assert branch_streams(arrays.token_ids, arrays.sampled_mask, arrays.logprobs) == (
        seq.tokens,
        seq.masks,
        seq.logprobs,
    )


def nodes_of(spec: list[tuple[list[bool], list[int] | None]]) -> Branch:
    """A branch from its nodes: each node's mask (True: sampled) and the versions the server reported on it."""
    nodes = [Node(versions, list(range(len(mask))), mask) for mask, versions in spec]
    tokens = [t for node in nodes for t in node.token_ids]
    sampled = [m for node in nodes for m in node.mask]
    return Branch(0, tokens, sampled, [-0.5] * len(tokens), nodes=nodes)


def test_per_token_versions_follow_the_nodes_that_sampled_them() -> None:
    """A prompt, a turn at 7 then 8 (per sampled token), a tool's output, a turn at 9 (one for the node): every
    token the version that sampled it, the prompt and the tool's output that of the next turn, which read them."""
    branch = nodes_of(
        [([False] * 3, None), ([False, True, True, True], [7, 7, 8]), ([False] * 2, None), ([True, True], [9])]
    )
    assert branch_versions(branch, 11) == [7, 7, 7, 7, 7, 7, 8, 9, 9, 9, 9]
    (seq,) = map_episode(Episode([Trace("t", 1.0, [branch])])).sequences
    assert seq.weight_versions == [7, 7, 7, 7, 7, 7, 8, 9, 9, 9, 9]
    assert seq.overrides["weight_versions"] == [7, 9]


def test_no_per_token_versions_where_the_server_reported_none_or_the_nodes_do_not_add_up() -> None:
    assert branch_versions(nodes_of([([False], None), ([True, True], None)]), 3) is None  # verifiers 0.4.0
    assert branch_versions(nodes_of([([True], [4]), ([True, True], None)]), 3) is None  # one turn unknown
    assert branch_versions(nodes_of([([True, True, True], [4, 5])]), 3) is None  # neither per token nor per node
    assert branch_versions(nodes_of([([True, True], [4])]), 3) is None  # the nodes hold 2 of the branch's 3 tokens


@given(st.lists(st.tuples(st.lists(st.booleans(), min_size=1, max_size=4), st.integers(0, 20)), min_size=1, max_size=6))
def test_each_sampled_token_carries_its_reported_version(spec: list[tuple[list[bool], int]]) -> None:
    branch = nodes_of([(mask, [v + i for i, s in enumerate(mask) if s]) for mask, v in spec])
    got = branch_versions(branch, len(branch.token_ids))
    flat = [(s, v + i if s else None) for mask, v in spec for i, s in enumerate(mask)]
    if not any(s for s, _ in flat):
        assert got is None
        return
    assert got is not None
    for k, (s, want) in enumerate(flat):
        if s:
            assert got[k] == want
        else:
            later = [w for t, w in flat[k:] if t]
            assert got[k] == (later[0] if later else [w for t, w in flat if t][-1])
