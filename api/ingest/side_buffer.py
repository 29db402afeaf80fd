"""Pure decisions of the side buffer, where groups whose size is not their env's `group_size` wait until held
groups add up to it (Atropos's mixed-size buffering): which held groups expire, which are released together,
and whether one more fits. The store holds one row per group (`Txn.hold`); `api/ingest/submit.py` applies these."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from api.config.groups import setting
from api.run.filters import release_from_buffer
from api.store.base import HeldMeta, QueueCounts

EXPIRED = "side_buffer_expired"
"""The reason counted (`dropped`) for held groups dropped at `ttl`."""


@dataclass(frozen=True, slots=True)
class SideLimits:
    """What one env's side buffer may hold. Past `max_groups` or `max_bytes` a group that would be held is
    refused with 503 + Retry-After (nothing acknowledged is dropped for room); after `ttl` seconds a held group
    is dropped and counted: its sizes may never add up (a handler that lost one rollout of every group)."""

    max_groups: int | None = setting("side_buffer_max_groups")
    max_bytes: int | None = setting("side_buffer_max_bytes")
    ttl: float | None = setting("side_buffer_ttl_s")

    def sweep_every(self) -> float | None:
        """Seconds between two sweeps of every env's side buffer for expired groups (ingest also expires an env's
        own at once): a tenth of the ttl, within [1 s, 60 s]."""
        return None if self.ttl is None else min(60.0, max(1.0, self.ttl / 10))


def expired(held: Sequence[HeldMeta], now: float, limits: SideLimits) -> list[HeldMeta]:
    """The held groups older than the ttl, oldest first."""
    if limits.ttl is None:
        return []
    cutoff = now - limits.ttl
    return [h for h in held if h.held_at <= cutoff]


def to_release(held: Sequence[HeldMeta], new_seqs: int, target: int) -> list[int] | None:
    """Positions among `held` plus the new group (position `len(held)`) that make up exactly `target` sequences
    together, oldest preferred; None: hold the new group too."""
    return release_from_buffer([*(h.meta.seqs for h in held), new_seqs], target)


def full(held: QueueCounts, adding: QueueCounts, limits: SideLimits) -> str | None:
    """Why holding `adding` more would pass the limits (None: it fits)."""
    if limits.max_groups is not None and held.groups + adding.groups > limits.max_groups:
        return f"holds {held.groups} groups; the limit (side_buffer_max_groups) is {limits.max_groups}"
    if limits.max_bytes is not None and held.bytes + adding.bytes > limits.max_bytes:
        return f"holds {held.bytes} bytes; the limit (side_buffer_max_bytes) is {limits.max_bytes}"
    return None
