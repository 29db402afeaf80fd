"""What /status and /status-env answer, computed from a transaction's counts (no scan of the queue)."""

from __future__ import annotations

import time

from api.ingest.queue_limits import QueueLimits, capacity_groups
from api.producers.stored import shown_producers
from api.rollouts.txns import open_groups_txn
from api.run import state, stats
from api.run.state import EnvRecord, RunState
from api.store.base import QueueCounts, Txn
from api.tasks.service import views_txn
from api.wire.schema import EnvStatus, Status

MIN_ENV_WEIGHT = 0.01
"""Floor of `env_weight` in /status-env, as in Atropos: no env is told to stop producing entirely."""


def status_txn(txn: Txn, known: RunState | None = None) -> Status:
    """/status: the step, what is queued, why no batch can be formed, what was dropped."""
    run = state.load(txn, known)
    total = sum(txn.counts().values(), QueueCounts())
    held = sum(txn.held.counts().values(), QueueCounts())
    kept = state.load_kept(txn, run)
    holding, released = stats.holds(txn, run, time.time())
    return Status(
        current_step=run.step if run.registration else 0,
        queue_size=total.groups,
        queued_sequences=total.seqs,
        queued_tokens=total.tokens,
        queued_bytes=total.bytes,
        committed_step=kept.committed if run.registration else 0,
        kept_batches=len(kept.sizes),
        kept_bytes=kept.bytes,
        held_groups=held.groups,
        held_sequences=held.seqs,
        held_tokens=held.tokens,
        held_bytes=held.bytes,
        blocked_reason=state.load_blocked(txn),
        dropped=state.load_dropped(txn),
        passed_over=txn.get_counts(stats.PASSED_OVER),
        smaller_batches=txn.get_counts(stats.SMALLER).get("", 0),
        trimmed_batches=txn.get_counts(stats.TRIMMED_BATCHES).get("", 0),
        trimmed_sequences=txn.get_counts(stats.TRIMMED),
        stale_tokens_masked=txn.get_counts(stats.STALE_MASKED),
        min_share_holds=holding,
        min_share_releases=released,
        tasks=views_txn(txn),
        rollouts=open_groups_txn(txn),
    )


def capped(status: Status, max_datasets: int, max_producers: int) -> Status:
    """/status with at most `max_datasets` datasets (the first by name) and `max_producers` producers (live ones
    first, then the oldest), each list's total beside it: its size is bounded however many a run has."""
    return status.model_copy(
        update={
            "tasks": status.tasks[:max_datasets],
            "tasks_total": len(status.tasks),
            "producers": shown_producers(status.producers, max_producers),
            "producers_total": len(status.producers),
        }
    )


_TOTALS: dict[object, tuple[float, float]] = {}
"""The last env list's totals, by its version: every env polls /status-env, and the list changes rarely."""


def _connected_totals(run: RunState) -> tuple[float, float]:
    """The connected envs' summed weight (scaled by their max_token_length, as Atropos does) and minimum shares."""
    key = (run.envs_at, id(run.envs), len(run.envs))
    if key not in _TOTALS:
        connected = [e for e in run.envs if e.connected]
        weight = sum(e.max_token_length * max(0.0, e.weight) for e in connected)
        _TOTALS.clear()
        _TOTALS[key] = (weight, sum(e.min_batch_allocation or 0.0 for e in connected))
    return _TOTALS[key]


def env_status(
    run: RunState,
    env: EnvRecord,
    counts: dict[int, QueueCounts],
    held: dict[int, QueueCounts],
    limits: QueueLimits,
    blocked: str | None = None,
) -> EnvStatus:
    """/status-env as Atropos computes it, from per-env counts instead of a scan of the queue."""
    total_weight, min_total = _connected_totals(run)
    weight = env.max_token_length * env.weight / total_weight if total_weight > 0 else 1.0
    batch_size = run.registration.batch_size if run.registration else 0
    group_size = max(1, env.group_size)
    self_seqs = counts.get(env.env_id, QueueCounts()).seqs
    others = 0
    for env_id, c in counts.items():
        if env_id == env.env_id:
            continue
        other = run.env(env_id)
        reserved = int(batch_size * (other.min_batch_allocation or 0.0)) if other and other.connected else 0
        others += max(0, c.seqs - reserved)
    sizes = [e.group_size for env_id, c in counts.items() if c.items and (e := run.env(env_id)) is not None]
    stored = dict(counts)
    for env_id, c in held.items():  # side buffers count against the limits
        stored[env_id] = stored.get(env_id, QueueCounts()) + c
    capacity = capacity_groups(stored, env, limits)
    return EnvStatus(
        current_step=run.step,
        queue_size=(self_seqs + others) // group_size,
        unallocated_fraction=max(0.0, 1.0 - min_total),
        self_queue_size=self_seqs // group_size,
        max_group_size=max([1, *sizes]),
        env_weight=max(MIN_ENV_WEIGHT, weight),
        queue_capacity_groups=capacity,
        queued_sequences=sum(c.seqs for c in counts.values()),
        blocked_reason=blocked,
    )
