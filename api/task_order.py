"""The order a dataset's tasks are handed out in, one epoch at a time: position -> task index, in O(1) time and
memory, so that a cursor over 10M tasks is two integers and no permutation is ever materialised.

Shuffled epochs use a keyed Feistel permutation of the next power of four at or above the size, walked in a cycle
until it lands inside the dataset (on average under four steps): a bijection of [0, size) that depends on
(seed, epoch) only, so every replica and every restart computes the same order.
"""

from __future__ import annotations

import hashlib

SEQUENTIAL = "sequential"
SHUFFLED = "shuffled"
ORDERS = (SEQUENTIAL, SHUFFLED)
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


def task_at(order: str, seed: int, epoch: int, position: int, size: int) -> int:
    """The index of the task handed out `position`-th in `epoch` of a dataset of `size` tasks."""
    if not 0 <= position < size:
        raise ValueError(f"position {position} is outside a dataset of {size} tasks")
    if order == SEQUENTIAL or size == 1:
        return position
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    key = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=16).digest()
    x = position
    while True:  # cycle walking: a permutation of [0, 4**half) restricted to [0, size) stays one
        x = _feistel(key, x, half)
        if x < size:
            return x
