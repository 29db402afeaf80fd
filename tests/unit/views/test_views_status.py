"""api.views.status: /status-env as Atropos computes it, from per-env counts."""

from __future__ import annotations

from api.ingest.queue_limits import QueueLimits
from api.run.state import EnvRecord, RunState
from api.store.base import QueueCounts
from api.views.status import MIN_ENV_WEIGHT, env_status
from api.wire.schema import Registration
from tests.factories import registration

ENVS = [EnvRecord(0, "a", "a_0", 2.0, 4, 512, 0.25), EnvRecord(1, "b", "b_0", 1.0, 8, 512, None)]
RUN = RunState(Registration.model_validate(registration(batch_size=32)), 5, True, ENVS)


def counts(a_groups: int, b_groups: int) -> dict[int, QueueCounts]:
    return {
        0: QueueCounts(a_groups, a_groups, 4 * a_groups, 400 * a_groups),
        1: QueueCounts(b_groups, b_groups, 8 * b_groups, 800 * b_groups),
    }


def test_env_status_counts_others_beyond_their_reserved_share() -> None:
    """Another env's sequences count against this env's queue only beyond the share reserved for it."""
    status = env_status(RUN, ENVS[1], counts(3, 2), {}, QueueLimits())
    assert status.current_step == 5 and status.self_queue_size == 2
    assert status.queue_size == (16 + max(0, 12 - 8)) // 8  # a's 12 sequences less its 8 reserved (32 * 0.25)
    assert status.queued_sequences == 16 + 12, "every env's, reserved or not: what the batch being formed holds"
    assert status.unallocated_fraction == 0.75 and status.max_group_size == 8
    assert status.env_weight == 1 / 3
    assert status.queue_capacity_groups == (2**28 - 2800) // 800  # the default token bound, b's 800-token groups
    assert (
        env_status(
            RUN, ENVS[1], counts(3, 2), {}, QueueLimits(None, None, None, None, None, None)
        ).queue_capacity_groups
        is None
    )


def test_a_disconnected_env_no_longer_weighs_or_reserves() -> None:
    envs = [EnvRecord(0, "a", "a_0", 2.0, 4, 512, 0.25, connected=False), ENVS[1]]
    status = env_status(RunState(RUN.registration, 5, True, envs), envs[1], counts(3, 2), {}, QueueLimits())
    assert status.env_weight == 1.0 and status.unallocated_fraction == 1.0 and status.queue_size == (16 + 12) // 8


def test_zero_weight_is_floored() -> None:
    envs = [EnvRecord(0, "a", "a_0", 0.0, 4, 512, None), ENVS[1]]
    assert (
        env_status(RunState(RUN.registration, 5, True, envs), envs[0], {}, {}, QueueLimits()).env_weight
        == MIN_ENV_WEIGHT
    )
