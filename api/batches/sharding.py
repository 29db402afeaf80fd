"""Splitting one batch among data-parallel ranks. Pure: no I/O.

Every rank computes its own share of batch N from the same stored batch, so no rank broadcasts and no
rank waits for another. Shares are balanced by compute (tokens, or the sum of squared lengths when
attention dominates) and keep groups whole where that stays balanced.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import numpy as np

from api.batches.trim import cut
from api.wire.records import GroupRecord

Cost = Literal["tokens", "squared"]

BALANCE_TOLERANCE = 0.10
"""Whole groups are kept when the busiest rank carries at most this much more than an even share."""

Pick = tuple[int, np.ndarray | None]
"""(group index, sequence indices within the group), or None for the whole group."""


def _cost(lengths: np.ndarray, cost: Cost) -> np.ndarray:
    lengths = lengths.astype(np.float64)
    return lengths if cost == "tokens" else lengths * lengths


def _lpt(costs: Sequence[float], world_size: int) -> tuple[list[list[int]], list[float]]:
    """Longest processing time first: each job to the least-loaded rank. Deterministic under ties."""
    heap = [(0.0, rank) for rank in range(world_size)]
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        load, rank = heapq.heappop(heap)
        shares[rank].append(job)
        heapq.heappush(heap, (load + costs[job], rank))
    loads = [0.0] * world_size
    for load, rank in heap:
        loads[rank] = load
    return shares, loads


def shard(group_lengths: Sequence[np.ndarray], world_size: int, cost: Cost = "tokens") -> list[list[Pick]]:
    """Each rank's picks: every sequence goes to exactly one rank."""
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    per_seq = [_cost(lengths, cost) for lengths in group_lengths]
    total = float(sum(c.sum() for c in per_seq))
    group_shares, loads = _lpt([float(c.sum()) for c in per_seq], world_size)
    even = total / world_size
    balanced = all(group_shares) and max(loads) <= even * (1 + BALANCE_TOLERANCE)
    if balanced:
        return [[(g, None) for g in sorted(share)] for share in group_shares]
    flat = [(g, i) for g, c in enumerate(per_seq) for i in range(len(c))]
    seq_shares, _ = _lpt([float(per_seq[g][i]) for g, i in flat], world_size)
    out: list[list[Pick]] = []
    for share in seq_shares:
        by_group: dict[int, list[int]] = {}
        for job in sorted(share):
            g, i = flat[job]
            by_group.setdefault(g, []).append(i)
        out.append([(g, np.asarray(idx)) for g, idx in sorted(by_group.items())])
    return out


def subset(rec: GroupRecord, seqs: np.ndarray) -> GroupRecord:
    """The group restricted to some of its sequences (`trim.cut`), with the whole group's scores, so that a rank
    can still normalise advantages over the whole group."""
    part = cut(rec, seqs)
    return replace(part, meta={**part.meta, "group_scores": rec.scores.tolist()})


def rank_share(records: Sequence[GroupRecord], rank: int, world_size: int, cost: Cost = "tokens") -> list[GroupRecord]:
    """The records rank `rank` of `world_size` trains on."""
    picks = shard([r.lengths for r in records], world_size, cost)[rank]
    return [records[g] if seqs is None else subset(records[g], seqs) for g, seqs in picks]
