"""The operator's limits on what the queue and one group may hold, and how a run's registration narrows them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from api.config.groups import part, setting
from api.errors import Unavailable
from api.ingest.side_buffer import SideLimits
from api.ingest.validation import GroupLimits
from api.run.state import EnvRecord, RunState
from api.store.base import QueueCounts


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """Backpressure: beyond these, submissions get 503 + Retry-After and nothing is stored. Each field takes
    the setting it names (`api.config.groups`), and its default."""

    max_groups: int | None = setting("max_queue_groups")
    max_tokens: int | None = setting("max_queue_tokens")
    max_env_groups: int | None = setting("max_env_queue_groups")
    max_env_tokens: int | None = setting("max_env_queue_tokens")
    max_bytes: int | None = setting("max_queue_bytes")
    max_env_bytes: int | None = setting("max_env_queue_bytes")
    max_group_seqs: int = setting("max_group_seqs")
    retry_after: float = setting("retry_after")
    side: SideLimits = part(SideLimits)
    """Each env's side buffer; what it holds also counts against the limits above."""


def group_limits(run: RunState, limits: QueueLimits) -> GroupLimits:
    """What one group may hold in this run; 503 before a trainer registered (handlers retry 5xx)."""
    if run.registration is None:
        raise Unavailable("no trainer has registered yet: POST /register first", limits.retry_after)
    return GroupLimits(
        max_token_len=run.registration.max_token_len,
        max_group_seqs=min(run.registration.batch_size, limits.max_group_seqs),
        max_group_tokens=run.registration.max_batch_tokens,
    )


def capacity_groups(counts: dict[int, QueueCounts], env: EnvRecord, limits: QueueLimits) -> int | None:
    """Groups of this env the queue limits still admit (None: unlimited); /status-env's queue_capacity_groups."""
    total = sum(counts.values(), QueueCounts())
    mine = counts.get(env.env_id, QueueCounts())
    room: list[int] = []
    if limits.max_groups is not None:
        room.append(limits.max_groups - total.groups)
    if limits.max_env_groups is not None:
        room.append(limits.max_env_groups - mine.groups)
    # Tokens a group of this env takes: its queued average, or before it has any, the most it could take.
    avg_tokens = mine.tokens / mine.groups if mine.groups else env.group_size * env.max_token_length
    avg_bytes = mine.bytes / mine.groups if mine.groups else None
    if avg_bytes:  # before an env has queued anything, its group's size in bytes is unknown: tokens decide
        if limits.max_bytes is not None:
            room.append(math.floor((limits.max_bytes - total.bytes) / avg_bytes))
        if limits.max_env_bytes is not None:
            room.append(math.floor((limits.max_env_bytes - mine.bytes) / avg_bytes))
    if avg_tokens > 0:
        if limits.max_tokens is not None:
            room.append(math.floor((limits.max_tokens - total.tokens) / avg_tokens))
        if limits.max_env_tokens is not None:
            room.append(math.floor((limits.max_env_tokens - mine.tokens) / avg_tokens))
    return max(0, min(room)) if room else None
