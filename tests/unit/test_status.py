"""api.status and api.limits: /status-env as Atropos computes it, from per-env counts, and the room left."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from api.limits import QueueLimits, capacity_groups
from api.schema import Registration
from api.state import EnvRecord, RunState
from api.status import MIN_ENV_WEIGHT, env_status
from api.store.base import QueueCounts
from tests.factories import registration

ENVS = [EnvRecord(0, "a", "a_0", 2.0, 4, 512, 0.25), EnvRecord(1, "b", "b_0", 1.0, 8, 512, None)]
RUN = RunState(Registration.model_validate(registration(batch_size=32)), 5, True, ENVS)


def counts(a_groups: int, b_groups: int) -> dict[int, QueueCounts]:
    return {0: QueueCounts(a_groups, a_groups, 4 * a_groups, 400 * a_groups),
            1: QueueCounts(b_groups, b_groups, 8 * b_groups, 800 * b_groups)}  # fmt: skip


def test_env_status_counts_others_beyond_their_reserved_share() -> None:
    """Another env's sequences count against this env's queue only beyond the share reserved for it."""
    status = env_status(RUN, ENVS[1], counts(3, 2), QueueLimits())
    assert status.current_step == 5 and status.self_queue_size == 2
    assert status.queue_size == (16 + max(0, 12 - 8)) // 8  # a's 12 sequences less its 8 reserved (32 * 0.25)
    assert status.unallocated_fraction == 0.75 and status.max_group_size == 8
    assert status.env_weight == 1 / 3 and status.queue_capacity_groups is None


def test_a_disconnected_env_no_longer_weighs_or_reserves() -> None:
    envs = [EnvRecord(0, "a", "a_0", 2.0, 4, 512, 0.25, connected=False), ENVS[1]]
    status = env_status(RunState(RUN.registration, 5, True, envs), envs[1], counts(3, 2), QueueLimits())
    assert status.env_weight == 1.0 and status.unallocated_fraction == 1.0 and status.queue_size == (16 + 12) // 8


def test_zero_weight_is_floored() -> None:
    envs = [EnvRecord(0, "a", "a_0", 0.0, 4, 512, None), ENVS[1]]
    assert (
        env_status(RunState(RUN.registration, 5, True, envs), envs[0], {}, QueueLimits()).env_weight == MIN_ENV_WEIGHT
    )


@given(st.integers(0, 50), st.integers(0, 50), st.none() | st.integers(1, 100), st.none() | st.integers(1, 100_000),
       st.none() | st.integers(1, 60), st.none() | st.integers(1, 60_000))  # fmt: skip
def test_capacity_is_what_every_limit_still_admits(
    a: int, b: int, max_groups: int | None, max_tokens: int | None, env_groups: int | None, env_tokens: int | None
) -> None:
    limits = QueueLimits(max_groups, max_tokens, env_groups, env_tokens)
    room = capacity_groups(counts(a, b), ENVS[0], limits)
    if limits == QueueLimits():
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
