"""api.ingest.queue_limits: the room the queue limits leave an env (/status-env's queue_capacity_groups), and what
one group may hold in a run."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.errors import Unavailable
from api.ingest.queue_limits import QueueLimits, capacity_groups, group_limits
from api.run.state import RunState
from api.store.base import QueueCounts
from api.wire.schema import Registration
from tests.factories import registration
from tests.unit.views.test_views_status import ENVS, counts


@given(
    st.integers(0, 50),
    st.integers(0, 50),
    st.none() | st.integers(1, 100),
    st.none() | st.integers(1, 100_000),
    st.none() | st.integers(1, 60),
    st.none() | st.integers(1, 60_000),
)
def test_capacity_is_what_every_limit_still_admits(
    a: int, b: int, max_groups: int | None, max_tokens: int | None, env_groups: int | None, env_tokens: int | None
) -> None:
    limits = QueueLimits(max_groups, max_tokens, env_groups, env_tokens, max_bytes=None, max_env_bytes=None)
    room = capacity_groups(counts(a, b), ENVS[0], limits)
    if limits == QueueLimits(None, None, None, None, None, None):
        assert room is None
        return
    assert room is not None and room >= 0
    total_groups, total_tokens = a + b, 400 * a + 800 * b
    avg = 400  # a's groups take 400 tokens each (its queued average, or 4 x 512 before it has any)
    avg = avg if a else 4 * 512
    # `room` more groups of a's average size fit under every limit, and one more would not fit under one.
    fits = [
        max_groups is None or total_groups + room <= max(max_groups, total_groups),
        max_tokens is None or total_tokens + room * avg <= max(max_tokens, total_tokens),
        env_groups is None or a + room <= max(env_groups, a),
        env_tokens is None or 400 * a + room * avg <= max(env_tokens, 400 * a),
    ]
    assert all(fits)


def test_bytes_bound_the_room_once_an_env_has_queued_groups() -> None:
    """Groups of 4 x 100 tokens with 1 MB of metadata each: the byte limit, not the token limit, decides."""
    queued = {0: QueueCounts(3, 3, 12, 1200, 3 << 20)}
    limits = QueueLimits(max_tokens=100_000, max_bytes=10 << 20)
    assert capacity_groups(queued, ENVS[0], limits) == 7
    assert capacity_groups({}, ENVS[0], limits) == 100_000 // (4 * 512)  # no group of its yet: tokens decide


def test_a_group_holds_at_most_a_batch_and_the_operators_cap() -> None:
    run = RunState(Registration.model_validate(registration(batch_size=32, max_token_len=100)), 0, True, ENVS)
    assert group_limits(run, QueueLimits()).max_group_seqs == 32
    assert group_limits(run, QueueLimits(max_group_seqs=8)).max_group_seqs == 8
    assert group_limits(run, QueueLimits()).max_token_len == 100


def test_before_a_trainer_registers_a_group_has_no_limits_yet() -> None:
    """503 with the operator's Retry-After: the group may be right once a trainer registers."""
    with pytest.raises(Unavailable) as exc:
        group_limits(RunState(None, 0, False, []), QueueLimits(retry_after=7.0))
    assert exc.value.headers == {"Retry-After": "7"}
