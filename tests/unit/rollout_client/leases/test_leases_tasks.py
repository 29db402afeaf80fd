"""The decisions a producer makes about its leased tasks, alone: how a group without a score ends its task (failed
with the producer's reason, bounded to what the server stores, or handed back untried), which failures are the
task's, when a lease counts as lost (its end passed without a heartbeat, on this process's monotonic clock), and a
409 on a leased group read as a lost lease."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from api.wire.tasks import REASON_MAX
from rollout_client import Curriculum, Task
from rollout_client.errors import GroupTimeout, InferenceError, Rejected
from rollout_client.leases.tasks import LEASE_KEY, Deadlines, bounded_reason
from rollout_client.runner.runner import UNTRIED, lease_refused, task_failure
from rollout_client.tasks import ended_unscored


def leased(token: str = "tok") -> Task:
    return Task("t", "1+1", "2", {LEASE_KEY: token})


@given(st.text(max_size=2 * REASON_MAX))
def test_a_reason_is_cut_to_what_the_server_stores(reason: str) -> None:
    cut = bounded_reason(reason)
    assert len(cut) <= REASON_MAX
    if len(reason) <= REASON_MAX:
        assert cut == reason
    else:
        assert cut[:-1] == reason[: REASON_MAX - 1] and cut.endswith("\u2026")


def test_a_lease_ends_on_the_monotonic_clock_and_lapses_once() -> None:
    held = Deadlines()
    held.extend("a", expires_at=1_000.0 + 20, wall=1_000.0, mono=50.0)  # 20 s left when the reply came
    held.extend("b", expires_at=1_000.0 + 5, wall=1_000.0, mono=50.0)
    assert held.tokens() == ["a", "b"] and "a" in held and len(held) == 2
    assert held.lapsed(54.9) == []
    assert held.lapsed(55.0) == ["b"], "its end passed without a heartbeat: lost"
    assert "b" not in held and held.lapsed(100.0) == ["a"] and len(held) == 0
    held.extend("c", expires_at=2_000.0 + 2, wall=2_000.0, mono=10.0)
    held.extend("c", expires_at=2_003.0 + 2, wall=2_003.0, mono=13.0)  # a heartbeat moved its end
    assert held.lapsed(14.0) == [] and held.lapsed(15.0) == ["c"]
    assert not held.drop("c"), "lapsed: forgotten already"


def test_only_failures_of_the_task_s_own_rollout_fail_it() -> None:
    assert task_failure(ValueError("boom")) == "env_error: ValueError: boom"
    assert task_failure(GroupTimeout("too long")) == "group_timeout: GroupTimeout: too long"
    unreachable = InferenceError("connection refused", transport=True)
    assert task_failure(unreachable) is UNTRIED, "an inference outage is not the task's fault"
    assert task_failure(InferenceError("bad request", status=400)) == "inference_error: InferenceError: bad request"


def test_a_409_on_a_leased_group_is_a_lost_lease() -> None:
    assert lease_refused(leased(), Rejected(409, "the lease lapsed", None))
    assert not lease_refused(leased(), Rejected(422, "tokens: bad", None)), "a bad group is rejected"
    assert not lease_refused(Task("t", "1+1"), Rejected(409, "reused id", None)), "no lease to lose"


class Source:
    def __init__(self, *methods: str) -> None:
        self.calls: list[tuple[str, Any]] = []
        for name in methods:
            setattr(self, name, lambda task, *why, name=name: self.calls.append((name, (task.id, *why))))

    def next_task(self) -> Task | None:
        return None

    def report(self, task: Task, mean_score: float) -> None:
        pass


def test_a_source_hears_failed_or_untried_and_falls_back_to_discard() -> None:
    task = leased()
    full = Source("fail", "hand_back", "discard")
    ended_unscored(full, task, "env_error: boom")
    ended_unscored(full, task, UNTRIED)
    assert full.calls == [("fail", ("t", "env_error: boom")), ("hand_back", ("t",))]
    plain = Source("discard")
    ended_unscored(plain, task, "env_error: boom")
    ended_unscored(plain, task, UNTRIED)
    assert plain.calls == [("discard", ("t",)), ("discard", ("t",))]
    ended_unscored(Source(), task, UNTRIED)  # a source that does not want to know


def test_a_curriculum_passes_each_ending_to_the_level_the_task_came_from() -> None:
    low, high = Source("fail", "hand_back", "discard"), Source("discard")
    tasks = iter([Task("a", "p"), Task("b", "p"), Task("c", "p")])
    low.next_task = lambda: next(tasks, None)  # type: ignore[method-assign]
    curriculum = Curriculum([low, high])
    a, b, c = curriculum.next_task(), curriculum.next_task(), curriculum.next_task()
    assert a is not None and b is not None and c is not None
    curriculum.fail(a, "rejected: 422")
    curriculum.hand_back(b)
    curriculum.discard(c)
    curriculum.hand_back(a)  # its level is forgotten: nothing to tell
    assert low.calls == [("fail", ("a", "rejected: 422")), ("hand_back", ("b",)), ("discard", ("c",))]
    assert high.calls == []
