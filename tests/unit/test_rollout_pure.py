"""rollout_client's pure logic: token budget, pacing, task sources, completion parsing (the retry predicate
and backoff are client_core's: tests/unit/test_client_core_*.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.wire.schema import EnvStatus
from rollout_client import Curriculum, PromptTooLong, Task, Tasks, clip_max_tokens
from rollout_client.pacing import AHEAD, QUEUE_FULL, is_stale, pause_reason, pick_env
from rollout_client.policy import InferenceError, parse_completion


@given(st.integers(0, 5000), st.integers(1, 5000), st.none() | st.integers(1, 6000), st.none() | st.integers(1, 6000))
def test_clip_max_tokens_never_exceeds_a_limit(prompt: int, want: int, trainer: int | None, ctx: int | None) -> None:
    limits = [x for x in (trainer, ctx) if x is not None]
    try:
        n = clip_max_tokens(prompt, want, trainer, ctx)
    except PromptTooLong as exc:
        assert prompt >= min(limits) and exc.limit == min(limits)
        return
    assert 1 <= n <= want
    assert all(prompt + n <= lim for lim in limits)
    if not limits or prompt + want <= min(limits):
        assert n == want


def _status(**kw: float | None) -> EnvStatus:
    base = dict(current_step=0, queue_size=0, unallocated_fraction=1.0, self_queue_size=0, max_group_size=4,
                env_weight=1.0, queue_capacity_groups=None)  # fmt: skip
    return EnvStatus.model_validate({**base, **kw})


def test_pause_reason() -> None:
    kw = dict(batch_size=16, group_size=4, policy_step=5)
    assert pause_reason(_status(current_step=5), max_staleness=None, **kw) is None
    assert pause_reason(_status(queue_capacity_groups=0), max_staleness=None, **kw) == QUEUE_FULL
    assert pause_reason(_status(queue_capacity_groups=3), max_staleness=None, **kw) is None
    # this env gets half of each batch of 16: 8 sequences a step. 3 groups of 4 queued + 1 in flight + the
    # new one = 20 sequences: the new group is consumed 2 steps from now, at step 7, 2 steps after its weights
    half = _status(current_step=5, self_queue_size=3, env_weight=0.5)
    assert pause_reason(half, max_staleness=2, pending_seqs=4, **kw) is None
    assert pause_reason(half, max_staleness=1, pending_seqs=4, **kw) == AHEAD
    assert pause_reason(half, max_staleness=2, pending_seqs=9, **kw) == AHEAD
    behind = _status(current_step=8)  # weights 3 steps old: whatever is produced now arrives stale
    assert pause_reason(behind, max_staleness=2, **kw) == AHEAD
    assert pause_reason(_status(current_step=5, queue_size=1000), max_staleness=None, **kw) is None


def test_is_stale() -> None:
    assert not is_stale(3, 5, None)
    assert not is_stale(3, 5, 2)
    assert is_stale(3, 6, 2)


@given(st.lists(st.floats(0.05, 10), min_size=1, max_size=5), st.integers(50, 400))
def test_pick_env_follows_rates(rates: list[float], rounds: int) -> None:
    credit = [0.0] * len(rates)
    picks = Counter(pick_env(credit, rates, [True] * len(rates)) for _ in range(rounds))
    total = sum(rates)
    for i, r in enumerate(rates):
        assert abs(picks[i] - rounds * r / total) <= len(rates)  # smooth WRR stays within a few picks


def test_pick_env_skips_ineligible() -> None:
    credit = [0.0, 0.0]
    assert {pick_env(credit, [1.0, 1.0], [False, True]) for _ in range(5)} == {1}
    assert pick_env(credit, [1.0, 1.0], [False, False]) is None


def test_tasks_from_list_function_and_cycle() -> None:
    ts = [Task(str(i), f"p{i}") for i in range(3)]
    once = Tasks(ts)
    assert [once.next_task() for _ in range(4)] == [*ts, None]
    cyc = Tasks(ts, cycle=True)
    assert [cyc.next_task() for _ in range(5)] == [*ts, *ts[:2]]
    made = Tasks(lambda i: Task(f"t{i}", "p"))
    assert [t.id for t in (made.next_task(), made.next_task()) if t] == ["t0", "t1"]


def test_curriculum_moves_up_and_down_by_mean_score() -> None:
    levels = [Tasks(lambda i, lv=lv: Task(f"L{lv}-{i}", "p")) for lv in range(3)]
    cur = Curriculum(levels, window=4, promote=0.75, demote=0.25)
    for _ in range(4):
        task = cur.next_task()
        assert task is not None and task.id.startswith("L0")
        cur.report(task, 1.0)
    assert cur.level == 1
    old = cur.next_task()
    for _ in range(4):
        task = cur.next_task()
        assert task is not None
        cur.report(task, 0.0)
    assert cur.level == 0
    assert old is not None
    cur.report(old, 1.0)  # a group started at the old level does not move the new one
    assert cur.level == 0
    with pytest.raises(ValueError, match="demote < promote"):
        Curriculum(levels, promote=0.2, demote=0.5)


def test_parse_completion_takes_ids_from_the_server() -> None:
    logprobs = {"tokens": ["token_id:5", "token_id:7"], "token_logprobs": [-0.5, -1.25]}
    body = {"choices": [{"text": "hi", "finish_reason": "length", "logprobs": logprobs}]}
    out = parse_completion(body)
    assert (out.token_ids, out.logprobs, out.text, out.finish_reason) == ([5, 7], [-0.5, -1.25], "hi", "length")
    body["choices"][0]["logprobs"]["tokens"] = ["hi", "!"]
    with pytest.raises(InferenceError, match="return_tokens_as_token_ids"):
        parse_completion(body)
    with pytest.raises(InferenceError, match="missing"):
        parse_completion({"choices": [{"text": "x"}]})


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), "x", True])
def test_parse_completion_refuses_a_logprob_that_is_not_a_finite_number(bad: object) -> None:
    body = {"choices": [{"logprobs": {"tokens": ["token_id:5", "token_id:7"], "token_logprobs": [-0.5, bad]}}]}
    with pytest.raises(InferenceError, match="position 1: not a finite number"):
        parse_completion(body)


def test_parse_completion_refuses_more_tokens_than_asked() -> None:
    body = {"choices": [{"logprobs": {"tokens": ["token_id:5"] * 3, "token_logprobs": [-0.5] * 3}}]}
    assert len(parse_completion(body, 3).token_ids) == 3
    with pytest.raises(InferenceError, match="3 tokens in a completion asked for at most 2"):
        parse_completion(body, 2)


@given(st.lists(st.tuples(st.integers(0, 2), st.booleans()), max_size=80))
def test_curriculum_with_repeated_ids_reports_every_handout_once(ops: list[tuple[int, bool]]) -> None:
    """Ids repeat: every handout is remembered apart, so a report or discard never loses another's."""
    levels = [Tasks(lambda i, lv=lv: Task(f"t{i % 2}", f"L{lv}")) for lv in range(3)]
    cur = Curriculum(levels, window=2, promote=0.5, demote=0.1)
    out: list[Task] = []
    for k, report in ops:
        if k == 0 or not out:
            task = cur.next_task()
            assert task is not None
            out.append(task)
        elif report:
            cur.report(out.pop(0), 1.0)
        else:
            cur.discard(out.pop())
        assert sum(map(len, cur._level_of.values())) == len(out)


def test_curriculum_moves_on_when_a_level_runs_out() -> None:
    cur = Curriculum([Tasks([Task(f"L{lv}-{i}", "p") for i in range(2)]) for lv in range(3)], window=4)
    ids = [t.id for t in iter(cur.next_task, None)]
    assert ids == ["L0-0", "L0-1", "L1-0", "L1-1", "L2-0", "L2-1"] and cur.level == 2
    cur = Curriculum([Tasks([Task(f"L{lv}-{i}", "p") for i in range(2)]) for lv in range(3)], window=1)
    first = cur.next_task()
    assert first is not None
    cur.report(first, 1.0)
    cur.report(cur.next_task() or first, 1.0)  # level 1 done scoring: promoted to 2
    assert cur.level == 2
    rest = [t.id for t in iter(cur.next_task, None)]
    assert rest == ["L2-0", "L2-1", "L1-1", "L0-1"], "the top runs out: the nearest level below that has tasks"
