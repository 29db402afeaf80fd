"""Pure decisions of the runner: when to hold production back, what is too stale, which env goes next."""

from __future__ import annotations

from collections.abc import Sequence

from api.wire.schema import EnvStatus

QUEUE_FULL = "queue_full"
AHEAD = "ahead_of_trainer"
DRAINING = "draining"
"""A drain env (`on_new_weights="drain"`) while a weight sync is pending."""


def pause_reason(
    status: EnvStatus,
    *,
    batch_size: int,
    group_size: int,
    policy_step: int,
    max_staleness: int | None,
    pending_seqs: int = 0,
    pending_all: int | None = None,
) -> str | None:
    """Why this env should not start another group now, or None.

    - the server has no room for another group of this env (`queue_capacity_groups` == 0): a submit would
      only earn a 503;
    - with `max_staleness`: the group would be consumed (`steps_to_consume` steps after the trainer's current
      step) more than `max_staleness` steps after the weights generating it (`policy_step`), so the server
      would drop it as stale. `pending_seqs` are this env's sequences this runner has in flight or acknowledged
      since the status was read, `pending_all` those of all its envs (default: `pending_seqs`, one env).
    """
    if status.queue_capacity_groups is not None and status.queue_capacity_groups <= 0:
        return QUEUE_FULL
    if max_staleness is not None and batch_size > 0:
        steps = steps_to_consume(
            status,
            batch_size=batch_size,
            group_size=group_size,
            pending_seqs=pending_seqs,
            pending_all=pending_seqs if pending_all is None else pending_all,
        )
        if status.current_step + steps - policy_step > max_staleness:
            return AHEAD
    return None


def steps_to_consume(
    status: EnvStatus, *, batch_size: int, group_size: int, pending_seqs: int, pending_all: int
) -> int:
    """About how many batches after the one being formed a group of this env started now is consumed.

    0 while the queue (every env's sequences, `queued_sequences`, and everything this runner has pending)
    holds less than a batch: the batch being formed still lacks sequences, and this group can be among them.
    Holding it back then could leave that batch unformed for good: every env of a runner judged late while
    the trainer waits for the sequences they would send, and no new weights come without a batch. Past that
    the later of two estimates: the whole queue and what is pending taken in order (`// batch_size`), and
    this env's queued and pending groups taken at its share of each batch (`env_weight`), since batches mix
    envs by weight and a fast env's surplus waits for its share.
    """
    queued = status.queued_sequences
    if queued is None:  # a server that does not say (Atropos): the queue in this env's groups, rounded down
        queued = max(status.queue_size, status.self_queue_size) * group_size
    before = queued + pending_all
    if before < batch_size:
        return 0
    per_step = max(1, int(batch_size * min(1.0, status.env_weight)))
    own = status.self_queue_size * group_size + pending_seqs + group_size
    return max(before // batch_size, (own - 1) // per_step)


def is_stale(group_step: int, trainer_step: int, max_staleness: int | None) -> bool:
    """A group generated with weights of `group_step` is useless once the trainer is further ahead than this."""
    return max_staleness is not None and trainer_step - group_step > max_staleness


def pick_env(credit: list[float], rates: Sequence[float], eligible: Sequence[bool]) -> int | None:
    """Smooth weighted round-robin over eligible envs (updates `credit` in place); None if none is eligible.

    `rates` are groups per round: weight / group_size, so each env's sequences follow its weight.
    """
    live = [i for i, ok in enumerate(eligible) if ok and rates[i] > 0]
    if not live:
        return None
    total = sum(rates[i] for i in live)
    for i in live:
        credit[i] += rates[i]
    best = max(live, key=lambda i: credit[i])
    credit[best] -= total
    return best
