"""When a worker is replaced: after a MemoryError, after N groups, above an RSS cap."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_client.recycling import MAX_GROUPS, MEMORY_ERROR, RSS, RecyclePolicy, rss_bytes


@given(st.none() | st.integers(1, 100), st.none() | st.integers(1, 10**10), st.integers(0, 200),
       st.none() | st.integers(0, 10**11), st.booleans())  # fmt: skip
def test_the_reason_follows_the_rules(
    max_groups: int | None, cap: int | None, done: int, rss: int | None, memory_error: bool
) -> None:
    reason = RecyclePolicy(max_groups, cap).reason(done, rss, memory_error)
    if memory_error:
        assert reason == MEMORY_ERROR
    elif max_groups is not None and done >= max_groups:
        assert reason == MAX_GROUPS
    elif cap is not None and rss is not None and rss > cap:
        assert reason == RSS
    else:
        assert reason is None


def test_no_rule_never_recycles_but_a_memory_error_does() -> None:
    policy = RecyclePolicy()
    assert policy.reason(10**9, 10**15) is None
    assert policy.reason(0, None, memory_error=True) == MEMORY_ERROR


@pytest.mark.parametrize("kw", [{"max_groups": 0}, {"max_rss_bytes": 0}])
def test_settings_out_of_range_are_refused(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        RecyclePolicy(**kw)


def test_rss_of_this_process_is_read() -> None:
    n = rss_bytes()
    assert n is not None and n > 1 << 20
