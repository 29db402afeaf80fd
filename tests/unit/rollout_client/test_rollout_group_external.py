"""Rollouts that generate outside their session (an agent harness calling inference itself, as verifiers'
does): `Session.record_sequence` and the group built from it, `Environment.skip_reason`."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_client import Environment, ExternalSequence, ScriptedPolicy, Session, Task, run_group

pytestmark = pytest.mark.anyio


def seq(n: int, score: float, tag: str) -> ExternalSequence:
    return ExternalSequence(
        list(range(1, n + 1)), [-100] + list(range(2, n + 1)), [1.0] + [-0.5] * (n - 1), score, {"tag": tag}
    )


class Recorded(Environment):
    """Rollout i records `per_rollout[i]` sequences (scores 0, 1, 0, ...) and leaves out one trace."""

    name = "recorded"

    def __init__(self, per_rollout: list[int], skip: str | None = None) -> None:
        self.per_rollout, self.skip, self.group_size, self.calls = per_rollout, skip, len(per_rollout), 0

    async def rollout(self, task: Task, session: Session) -> None:
        i, self.calls = self.calls, self.calls + 1
        session.record_sequences(seq(3 + k, float(k % 2), f"{i}/{k}") for k in range(self.per_rollout[i]))
        session.left_out["untrainable_trace"] += 1

    def score(self, task: Task, session: Session) -> float:
        return 42.0  # not used for a session with recorded sequences

    def skip_reason(self, sequences: int, scores: list[float]) -> str | None:
        return self.skip


async def test_recorded_sequences_make_the_group_in_order_with_their_own_scores() -> None:
    env = Recorded([2, 0, 1])
    out = await run_group(env, Task("t", "p"), ScriptedPolicy(lambda *_: ""))
    g = out.group
    assert g is not None and out.skipped is None
    assert [o["tag"] for o in g.overrides or []] == ["0/0", "0/1", "2/0"]
    assert g.scores == [0.0, 1.0, 0.0]
    assert g.tokens == [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3]]
    assert g.masks[1] == [-100, 2, 3, 4] and g.inference_logprobs is not None and g.inference_logprobs[1][0] == 1.0
    assert all("rollout_s" in o for o in g.overrides or [])
    assert g.group_overrides == {"task_id": "t", "left_out": {"untrainable_trace": 3}}


async def test_no_sequence_or_a_skip_reason_is_counted_not_built() -> None:
    assert (await run_group(Recorded([0, 0]), Task("t", "p"), ScriptedPolicy(lambda *_: ""))).skipped == "no_sequences"
    out = await run_group(Recorded([1, 1], skip="too_few"), Task("t", "p"), ScriptedPolicy(lambda *_: ""))
    assert out.group is None and out.skipped == "too_few"


class Versioned(Environment):
    """Two rollouts, each one sequence; the harness knows the versions of rollout 0's tokens, and of rollout 1's
    when `both`."""

    name = "versioned"
    group_size = 2

    def __init__(self, both: bool) -> None:
        self.both, self.calls = both, 0

    async def rollout(self, task: Task, session: Session) -> None:
        i, self.calls = self.calls, self.calls + 1
        versions = [i, i, i + 1] if i == 0 or self.both else None
        session.record_sequence(replace(seq(3, float(i), str(i)), weight_versions=versions))

    def score(self, task: Task, session: Session) -> float:
        return 0.0  # not used for a session with recorded sequences


async def test_the_group_carries_per_token_versions_only_when_every_sequence_has_them() -> None:
    out = await run_group(Versioned(both=True), Task("t", "p"), ScriptedPolicy(lambda *_: ""))
    assert out.group is not None and out.group.token_weight_versions == [[0, 0, 1], [1, 1, 2]]
    out = await run_group(Versioned(both=False), Task("t", "p"), ScriptedPolicy(lambda *_: ""))
    assert out.group is not None and out.group.token_weight_versions is None


@given(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4))
def test_record_sequence_refuses_streams_of_different_lengths(n: int, m: int, k: int) -> None:
    s = Session(ScriptedPolicy(lambda *_: ""))
    bad = ExternalSequence([1] * n, [1] * m, [1.0] * k, 0.0)
    if n and n == m == k:
        s.record_sequence(bad)
        assert s.external == [bad]
    else:
        with pytest.raises(ValueError, match="record_sequence"):
            s.record_sequence(bad)
