"""When a worker is replaced: after a MemoryError, after N groups, above an RSS cap."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_client.workers.recycling import MEMORY_ERROR, RSS, RecyclePolicy, rss_bytes


@given(st.none() | st.integers(1, 10**10), st.none() | st.integers(0, 10**11), st.booleans())
def test_the_workers_own_reason_follows_the_rules(cap: int | None, rss: int | None, memory_error: bool) -> None:
    reason = RecyclePolicy(max_groups=1, max_rss_bytes=cap).reason(rss, memory_error)
    if memory_error:
        assert reason == MEMORY_ERROR
    elif cap is not None and rss is not None and rss > cap:
        assert reason == RSS
    else:
        assert reason is None, "groups are counted by the pool, never here"


@given(st.none() | st.integers(1, 100), st.integers(0, 200))
def test_a_worker_is_spent_once_max_groups_were_placed_on_it(max_groups: int | None, placed: int) -> None:
    assert RecyclePolicy(max_groups).spent(placed) == (max_groups is not None and placed >= max_groups)


def test_no_rule_never_recycles_but_a_memory_error_does() -> None:
    policy = RecyclePolicy()
    assert policy.reason(10**15) is None and not policy.spent(10**9)
    assert policy.reason(None, memory_error=True) == MEMORY_ERROR


@pytest.mark.parametrize("kw", [{"max_groups": 0}, {"max_rss_bytes": 0}])
def test_settings_out_of_range_are_refused(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        RecyclePolicy(**kw)


def test_rss_of_this_process_is_read() -> None:
    n = rss_bytes()
    assert n is not None and n > 1 << 20
