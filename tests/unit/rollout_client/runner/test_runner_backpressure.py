"""The runner's backpressure state alone: status reads corrected for what the runner did since."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from api.wire.schema import EnvStatus
from rollout_client.runner.backpressure import Backpressure
from rollout_client.runner.pacing import AHEAD, QUEUE_FULL, pause_reason


def status(step: int, queued: int = 0, room: int | None = None, weight: float = 1.0) -> EnvStatus:
    return EnvStatus(
        current_step=step,
        queue_size=queued,
        unallocated_fraction=1.0,
        self_queue_size=queued,
        max_group_size=4,
        env_weight=weight,
        queue_capacity_groups=room,
    )


def test_nothing_is_held_before_the_first_read_and_each_env_is_judged_alone() -> None:
    bp = Backpressure([4, 2], max_staleness=1)
    bp.batch_size = 8
    assert bp.refresh([(0, 4)], policy_step=0) == [None, None]
    assert bp.observed([status(3), status(1, room=0)], bp.mark()) == 3, "the trainer's step"
    assert bp.refresh([], policy_step=2) == [None, QUEUE_FULL]
    assert bp.refresh([], policy_step=1) == [AHEAD, QUEUE_FULL]


def test_what_other_envs_have_in_flight_fills_the_batch_being_formed() -> None:
    """Env 1's group of 8 in flight completes the batch of 8 that env 0's queue of 4 leaves short: env 0 is no
    longer needed by it, and what it would start now falls into the next step, past a bound of 0."""
    bp = Backpressure([4, 8], max_staleness=0)
    bp.batch_size = 8
    reads = [status(0, queued=1, weight=0.5), status(0, weight=0.5)]
    bp.observed([read.model_copy(update={"queued_sequences": 4}) for read in reads], bp.mark())
    assert bp.refresh([], policy_step=0) == [None, None]
    assert bp.refresh([(1, 8)], policy_step=0) == [AHEAD, AHEAD]


def test_acks_count_as_pending_until_a_read_made_after_them() -> None:
    """A read taken after an ack includes it in the queue; one taken before (or during) it does not."""
    bp = Backpressure([4], max_staleness=0)
    bp.batch_size = 8  # 8 sequences a step: two groups of 4 are consumed at the current step
    before = bp.mark()
    bp.acked(0, 4)
    bp.observed([status(0)], before)  # the read may have missed the ack
    assert bp.refresh([(0, 4)], policy_step=0) == [AHEAD], "4 acked + 4 in flight + 4 new: into the next step"
    assert bp.refresh([], policy_step=0) == [None]
    bp.observed([status(0, queued=1)], bp.mark())  # a later read shows the acked group queued
    assert bp.refresh([], policy_step=0) == [None]


@given(
    st.lists(st.integers(1, 8), min_size=1, max_size=3).flatmap(
        lambda sizes: st.tuples(
            st.just(sizes),
            st.lists(st.tuples(st.integers(0, len(sizes) - 1), st.integers(0, 40)), max_size=6),  # acks
            st.lists(st.integers(0, len(sizes) - 1), max_size=6),  # envs of the groups in flight
        )
    ),
    st.integers(0, 5),
    st.integers(0, 10),
    st.integers(0, 64),
    st.none() | st.integers(0, 4),
)
def test_each_env_is_judged_with_everything_not_in_its_read(
    case: tuple[list[int], list[tuple[int, int]], list[int]], split: int, step: int, batch: int, staleness: int | None
) -> None:
    """Acks before the mark are in the read; acks after it and groups in flight are pending, env by env, and
    all envs' together for the batch being formed."""
    sizes, acks, flying = case
    bp = Backpressure(sizes, staleness)
    bp.batch_size = batch
    for env, n in acks[:split]:
        bp.acked(env, n)
    mark = bp.mark()
    for env, n in acks[split:]:
        bp.acked(env, n)
    reads = [status(step, queued=i) for i in range(len(sizes))]
    bp.observed(reads, mark)
    held = bp.refresh([(env, sizes[env]) for env in flying], policy_step=0)
    pending = [sum(n for env, n in acks[split:] if env == i) + sizes[i] * flying.count(i) for i in range(len(sizes))]
    for i, read in enumerate(reads):
        want = pause_reason(
            read,
            batch_size=batch,
            group_size=sizes[i],
            policy_step=0,
            max_staleness=staleness,
            pending_seqs=pending[i],
            pending_all=sum(pending),
        )
        assert held[i] == want
