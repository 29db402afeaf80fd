"""`Timeouts`, and the `RolloutRunner` keywords it and the policy objects replace: still accepted for one
release, each with a DeprecationWarning that names its new form (rollout_client/runner/timeouts.py, deprecated.py)."""

from __future__ import annotations

import math
import warnings
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_client import FailurePolicy, RecyclePolicy, RolloutRunner, ScriptedPolicy, Tasks, Timeouts
from rollout_client.examples import Arithmetic, arithmetic_script, arithmetic_task
from rollout_client.runner.deprecated import FAILURES, RECYCLE, TIMEOUTS

FIELDS = [f.name for f in fields(Timeouts)]


def runner(**kw: Any) -> RolloutRunner:
    return RolloutRunner(
        "http://127.0.0.1:9", [(Arithmetic(), Tasks(arithmetic_task))], ScriptedPolicy(arithmetic_script), **kw
    )


def test_the_defaults_are_the_runners_old_ones() -> None:
    t = Timeouts()
    defaults = (t.turn, t.rollout, t.group, t.release, t.pause, t.shutdown, t.inference_outage)
    assert defaults == (600.0, 1800.0, 3600.0, 30.0, 60.0, 10.0, 600.0)
    assert t.submit_linger == 0.002, "a few ms: groups finishing together share a /scored_data_list"
    r = runner()
    assert r.timeouts == t and r.limits == t.limits()
    assert (r.failures.max_error_rate, r.failures.error_window, r.failures.quarantine_after) == (0.5, 32, 3)
    assert r.recycle == RecyclePolicy()


@given(st.sampled_from(FIELDS), st.floats(allow_nan=True, allow_infinity=True))
def test_a_timeout_is_a_number_of_seconds_at_least_zero(name: str, value: float) -> None:
    if math.isnan(value) or value < 0:
        with pytest.raises(ValueError, match=f"Timeouts.{name}"):
            Timeouts(**{name: value})
    else:
        t = Timeouts(**{name: value})
        assert getattr(t, name) == value


def test_limits_carry_the_rollout_bounds_and_the_servers_token_limit() -> None:
    limits = Timeouts(turn=1.0, rollout=2.0, release=None).limits(4096)
    bounds = (limits.token_limit, limits.turn_timeout, limits.rollout_timeout, limits.release_timeout)
    assert bounds == (4096, 1.0, 2.0, None)


def test_the_new_form_is_taken_as_given_without_warnings() -> None:
    t, f, r = Timeouts(group=5.0), FailurePolicy(max_error_rate=None), RecyclePolicy(max_groups=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        made = runner(timeouts=t, failures=f, recycle=r)
    assert made.timeouts is t and made.failures is f and made.recycle is r


@pytest.mark.parametrize("old", sorted(TIMEOUTS))
def test_each_old_timeout_keyword_still_works_and_says_what_replaces_it(old: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{old}=.*timeouts=Timeouts\({TIMEOUTS[old]}=") as caught:
        made = runner(**{old: 0.25})
    assert caught[0].filename == __file__, "the warning points at the caller"
    assert made.timeouts == Timeouts(**{TIMEOUTS[old]: 0.25})


@pytest.mark.parametrize(("old", "value"), [("max_error_rate", None), ("error_window", 4), ("quarantine_after", 7)])
def test_each_old_failure_keyword_still_works_and_says_what_replaces_it(old: str, value: int | None) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{old}=.*failures=FailurePolicy\({FAILURES[old]}="):
        made = runner(**{old: value})
    assert getattr(made.failures, FAILURES[old]) == value


@pytest.mark.parametrize(("old", "value"), [("recycle_after_groups", 3), ("max_worker_rss_bytes", 1 << 30)])
def test_each_old_recycling_keyword_still_works_and_says_what_replaces_it(old: str, value: int) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{old}=.*recycle=RecyclePolicy\({RECYCLE[old]}="):
        made = runner(**{old: value})
    assert getattr(made.recycle, RECYCLE[old]) == value


def test_old_keywords_combine_and_validate_as_before() -> None:
    with pytest.warns(DeprecationWarning):
        made = runner(group_timeout=None, shutdown_timeout=2.0, max_error_rate=0.4, error_window=10)
    assert made.timeouts == Timeouts(group=None, shutdown=2.0)
    assert (made.failures.max_error_rate, made.failures.error_window) == (0.4, 10)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="recycle_after_groups"):
        runner(recycle_after_groups=0)


def test_an_old_keyword_beside_its_new_form_or_an_unknown_one_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="timeouts= or the old turn_timeout"):
        runner(timeouts=Timeouts(), turn_timeout=1.0)
    with pytest.raises(TypeError, match="failures= or the old error_window"):
        runner(failures=FailurePolicy(), error_window=3)
    with pytest.raises(TypeError, match="unexpected keyword arguments: group_timout"):
        runner(group_timout=1.0)
