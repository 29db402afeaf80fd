"""What one key's datasets hold (how many, and the bytes of their tasks), kept as named values as they change,
so that a key's bounds (`task_max_datasets_per_key`, `task_max_bytes_per_key`) cost one read."""

from __future__ import annotations

import json
from dataclasses import dataclass

from api.store.base import Txn
from api.tasks.records import ANY_KEY, Dataset

KEY_TOTALS = "tasks:key:"
"""Named values, one per key (its name after the colon; none after it without keys): the datasets it registered
and the bytes of their tasks (`KeyTotals`), kept as they change, so that a key's bounds cost one read."""


TASK_ROW_BYTES = 64
"""What a task costs the store beside its text (its row and index entry), counted against the key's bytes: a
dataset of empty tasks is not free."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """What `add_tasks` may store: a dataset's tasks (`task_max_dataset_size`) and a key's task bytes
    (`task_max_bytes_per_key`); None: no bound."""

    dataset_size: int | None = None
    key_bytes: int | None = None


NO_BOUNDS = Bounds()
"""No bound on what `add_tasks` stores (a caller without settings, such as a test of the moves)."""


@dataclass(frozen=True, slots=True)
class KeyTotals:
    """What one key's datasets hold: how many, and the bytes of their tasks (text and `TASK_ROW_BYTES` each)."""

    datasets: int = 0
    bytes: int = 0


def key_totals(txn: Txn, owner: str | None) -> KeyTotals:
    """The totals of the key `owner` (None: a keyless server's datasets). A store from before they were kept
    counts its datasets once, at the first registration or page after (their bytes count from then on)."""
    raw = txn.get_value(KEY_TOTALS + (owner or ""))
    if raw is not None:
        datasets, size = json.loads(raw)
        return KeyTotals(int(datasets), int(size))
    if txn.get_value(ANY_KEY) is None:
        return KeyTotals()
    mine = 0
    for name in txn.tasks.dataset_names():
        record = txn.tasks.get_dataset(name)
        if record is not None and Dataset.of(record).owner == owner:
            mine += 1
    return KeyTotals(datasets=mine)


def put_totals(txn: Txn, owner: str | None, totals: KeyTotals) -> None:
    txn.set_value(KEY_TOTALS + (owner or ""), json.dumps([totals.datasets, totals.bytes]))
