"""Pure decisions made per group at ingest: the trainer's group filters, and the side buffer's release."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from api.wire.schema import Registration

ZERO_VARIANCE = "zero_variance"
SCORE_RANGE = "score_range"
STALE = "stale"


def filter_reason(scores: np.ndarray, registration: Registration) -> str | None:
    """Why the trainer asked not to see this group, or None to keep it."""
    if registration.drop_zero_variance and scores.size > 0 and bool(np.all(scores == scores[0])):
        return ZERO_VARIANCE
    if registration.min_score is None and registration.max_score is None:  # no mean to compute (numpy's is µs)
        return None
    mean = float(scores.mean()) if scores.size else 0.0
    if registration.min_score is not None and mean < registration.min_score:
        return SCORE_RANGE
    if registration.max_score is not None and mean > registration.max_score:
        return SCORE_RANGE
    return None


def release_from_buffer(sizes: Sequence[int], target: int) -> list[int] | None:
    """Indices of buffered partial groups that add up to exactly `target`, oldest preferred; None if none do.

    Subset sum over a small buffer with bitsets: reach[i] holds the sums reachable with the first i groups.
    """
    mask = (1 << (target + 1)) - 1
    reach = [1]
    for size in sizes:
        reach.append((reach[-1] | (reach[-1] << size)) & mask)
    if not (reach[-1] >> target) & 1:
        return None
    picked: list[int] = []
    s = target
    for i in range(len(sizes), 0, -1):
        if (reach[i - 1] >> s) & 1:
            continue
        picked.append(i - 1)
        s -= sizes[i - 1]
    return sorted(picked)
