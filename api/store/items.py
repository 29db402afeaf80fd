"""What the service and its pure planners know of a queued item, apart from any store.

`ItemMeta` is read from a store's queue head and decided on by batch formation (`api/batches/planner.py`), which is
pure: it lives here so that the planner imports no store type.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ItemMeta:
    """What batch formation needs to know of a queued item, without its payload."""

    item_id: int
    """Increases with every append over the whole store: FIFO order within an env."""
    seqs: int
    tokens: int
    policy_step: int
