"""How the runner counts each group that ends (rollout_client/runner/accounting.py), alone: one bucket per group,
the failure policy consulted, the mean score over the last groups stored."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from api.wire.schema import ScoredData
from rollout_client.errors import InferenceError, Rejected, TurnTimeout
from rollout_client.group import GroupOutcome
from rollout_client.runner.accounting import SCORE_WINDOW, Tally
from rollout_client.runner.failures import FailurePolicy
from rollout_client.runner.stats import RunnerStats


def scored(scores: list[float]) -> ScoredData:
    return ScoredData(tokens=[[1, 2]] * len(scores), masks=[[-100, 2]] * len(scores), scores=scores)


def tally(**policy: object) -> Tally:
    return Tally(["a", "b"], RunnerStats(), FailurePolicy(**policy))  # type: ignore[arg-type]


EVENTS = st.lists(st.sampled_from(["failed", "skipped", "produced", "rejected", "stored", "duplicate"]), max_size=40)


@given(EVENTS)
def test_every_group_is_counted_in_exactly_one_bucket(events: list[str]) -> None:
    t = tally(max_error_rate=None, quarantine_after=None)
    for k, event in enumerate(events):
        if event == "failed":
            assert t.failed(k % 2, f"t{k}", f"g{k}", TurnTimeout("slow")) is None
        elif event == "skipped":
            assert t.finished(0, GroupOutcome(None, "no_variance"), 4) is None
        elif event == "rejected":
            t.rejected(0, f"g{k}", Rejected(422, "too long"))
        else:
            assert t.finished(1, GroupOutcome(scored([1.0, 0.0])), 4) is not None
            if event != "produced":
                t.stored(1, f"t{k}", scored([1.0, 0.0]), duplicate=event == "duplicate")
    s = t.stats
    ends = s.failed_total + s.skipped["no_variance"] + s.skipped["rejected"] + s.accepted + s.duplicates
    assert ends == len(events) - events.count("produced") and s.accepted == sum(s.accepted_by_env.values())
    assert s.produced == sum(e in ("produced", "stored", "duplicate") for e in events)
    assert s.partial_groups == s.produced, "two sequences of a group of four: survivors"


def test_a_task_that_keeps_failing_is_quarantined_and_the_error_rate_ends_the_run() -> None:
    t = tally(max_error_rate=0.5, error_window=4, quarantine_after=2)
    assert t.failed(0, "t1", "g1", TurnTimeout("slow")) is None
    assert t.failed(0, "t1", "g2", TurnTimeout("slow")) is None
    assert t.stats.quarantined == {"a": {"t1"}} and t.failures.is_quarantined(0, "t1")
    t.stored(0, "t2", scored([1.0]), duplicate=False)
    stop = t.failed(1, "t3", "g4", TurnTimeout("slow"))
    assert stop is not None and "75% of the last 4 groups failed" in stop and "'turn_timeout': 2" in stop
    assert t.stats.failed == {"a": {"turn_timeout": 2}, "b": {"turn_timeout": 1}}
    assert t.stats.last_error["b"] == "TurnTimeout: slow" and t.stats.error_rate == 0.75


def test_an_inference_outage_blames_neither_the_task_nor_the_rate() -> None:
    t = tally(max_error_rate=0.0, error_window=1, quarantine_after=1)
    assert t.failed(0, "t1", "g1", InferenceError("refused", transport=True)) is None
    assert t.stats.failed_total == 1 and t.stats.error_rate == 0.0 and not t.failures.is_quarantined(0, "t1")


def test_rejections_in_a_row_end_the_run() -> None:
    t = tally()
    stops = [t.rejected(0, f"g{k}", Rejected(422, "no")) for k in range(10)]
    assert stops[:9] == [None] * 9 and stops[9] == "10 groups in a row rejected by the server"


def test_the_mean_score_is_over_the_last_groups_stored() -> None:
    t = tally()
    for k in range(SCORE_WINDOW + 10):
        assert t.stored(0, f"t{k}", scored([float(k), float(k) + 1.0]), duplicate=False) == k + 0.5
    last = [k + 0.5 for k in range(10, SCORE_WINDOW + 10)]
    assert t.stats.mean_score == {"a": sum(last) / len(last)}
