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
) -> str | None:
    """Why this env should not start another group now, or None.

    - the server has no room for another group of this env (`queue_capacity_groups` == 0): a submit would
      only earn a 503;
    - with `max_staleness`: batches take this env's sequences at its share of the weights (`env_weight`),
      so a group started now is consumed after this env's queued groups and the ones this runner has in
      flight for it (`pending_seqs`): about `(queued + pending + G) / (batch_size * share)` steps after the
      trainer's current step. If that is more than `max_staleness` steps after the weights generating it
      (`policy_step`), it would arrive stale (and the server would drop it).
    """
    if status.queue_capacity_groups is not None and status.queue_capacity_groups <= 0:
        return QUEUE_FULL
    if max_staleness is not None and batch_size > 0:
        per_step = max(1, int(batch_size * min(1.0, status.env_weight)))
        ahead = status.self_queue_size * group_size + pending_seqs + group_size
        consumed_at = status.current_step + (ahead - 1) // per_step
        if consumed_at - policy_step > max_staleness:
            return AHEAD
    return None


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
