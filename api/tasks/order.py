"""The order a dataset's tasks are handed out in, one epoch at a time: position -> task index, in O(1) time and
memory, so that a cursor over 10M tasks is two integers and no permutation is ever materialised.

Shuffled epochs use a keyed Feistel permutation of the next power of four at or above the size, walked in a cycle
until it lands inside the dataset (on average under four steps): a bijection of [0, size) that depends on
(seed, epoch) only, so every replica and every restart computes the same order.

Weighted epochs follow a curriculum: each task has a level, each level a weight. The level of position p is drawn
by a number fixed by (seed, epoch, p), among the levels with tasks left in the epoch, in proportion to their
weights; within its level the task is the next of that level's own shuffled order (the Feistel permutation keyed
by (seed, epoch, level)). Heavier levels are so handed out sooner, and every task still once per epoch. The cursor
keeps, beside its position, how many tasks of each level it took this epoch (a few integers), and the store a
level's tasks by rank: position -> task in O(levels) time, no order materialised either.
"""

from __future__ import annotations

import hashlib

SEQUENTIAL = "sequential"
SHUFFLED = "shuffled"
WEIGHTED = "weighted"
ORDERS = (SEQUENTIAL, SHUFFLED, WEIGHTED)
POSITIONAL = (SEQUENTIAL, SHUFFLED)
"""Orders computed from the position alone (`task_at`); a weighted one also needs the tasks' levels."""
_ROUNDS = 4


def _round(key: bytes, r: int, value: int, bits: int) -> int:
    digest = hashlib.blake2b(value.to_bytes(8, "little"), digest_size=8, key=key + bytes([r])).digest()
    return int.from_bytes(digest, "little") & ((1 << bits) - 1)


def _feistel(key: bytes, x: int, half: int) -> int:
    mask = (1 << half) - 1
    left, right = x >> half, x & mask
    for r in range(_ROUNDS):
        left, right = right, left ^ _round(key, r, right, half)
    return (left << half) | right


def task_at(order: str, seed: int, epoch: int, position: int, size: int, level: str | None = None) -> int:
    """The index of the task handed out `position`-th in `epoch` of a dataset of `size` tasks (with `level`: the
    rank within that level of a weighted order, among its `size` tasks)."""
    if not 0 <= position < size:
        raise ValueError(f"position {position} is outside a dataset of {size} tasks")
    if order == SEQUENTIAL or size == 1:
        return position
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    salt = "" if level is None else f":{level}"
    key = hashlib.blake2b(f"{seed}:{epoch}{salt}".encode(), digest_size=16).digest()
    x = position
    while True:  # cycle walking: a permutation of [0, 4**half) restricted to [0, size) stays one
        x = _feistel(key, x, half)
        if x < size:
            return x


def _unit(seed: int, epoch: int, position: int) -> float:
    """A number in [0, 1) fixed by (seed, epoch, position)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{position}".encode(), digest_size=8, person=b"level").digest()
    return (int.from_bytes(digest, "little") >> 11) / (1 << 53)


def level_at(seed: int, epoch: int, position: int, weights: dict[str, float], left: dict[str, int]) -> str:
    """The level of the task handed out `position`-th in `epoch` of a weighted order: drawn among the levels with
    tasks `left` in the epoch, in proportion to their `weights` (at least one level must have tasks left)."""
    live = sorted(level for level, n in left.items() if n > 0 and weights.get(level, 0) > 0)
    if not live:
        raise ValueError("no level has tasks left in this epoch")
    draw = _unit(seed, epoch, position) * sum(weights[level] for level in live)
    for level in live:
        draw -= weights[level]
        if draw < 0:
            return level
    return live[-1]  # rounding at the very top


def weighted_at(
    seed: int, epoch: int, position: int, weights: dict[str, float], sizes: dict[str, int], taken: dict[str, int]
) -> tuple[str, int]:
    """(level, rank within the level) of the task handed out `position`-th in `epoch`, given the tasks of each
    level (`sizes`) and those of each level already handed out this epoch (`taken`); the caller counts it taken."""
    left = {level: sizes.get(level, 0) - taken.get(level, 0) for level in weights}
    level = level_at(seed, epoch, position, weights, left)
    return level, task_at(SHUFFLED, seed, epoch, taken.get(level, 0), sizes[level], level)
