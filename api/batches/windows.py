"""What formation reads of each env's queue before planning (`take_window`: bounded by what any batch could use,
the stale items set aside on the way).
Pure functions over plain data; no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from api.store.items import ItemMeta


@dataclass(frozen=True, slots=True)
class Window:
    items: list[ItemMeta]
    stale: list[ItemMeta]
    more: bool = False
    """The read stopped at a bound, not at the queue's end (more may be queued)."""


def take_window(
    head: Iterable[ItemMeta],
    *,
    min_step: int | None,
    max_seqs: int,
    max_tokens: int | None = None,
    max_items: int | None = None,
) -> Window:
    """Read an env's queue from the head until it holds enough fresh items for any batch; set stale ones aside.

    Reads `max_seqs` sequences' worth of fresh items (or `max_tokens` tokens' worth, or `max_items` items),
    plus the stale items met on the way, which are to be dropped.
    """
    items: list[ItemMeta] = []
    stale: list[ItemMeta] = []
    seqs = tokens = 0
    for meta in head:
        if min_step is not None and meta.policy_step < min_step:
            stale.append(meta)
            continue
        items.append(meta)
        seqs += meta.seqs
        tokens += meta.tokens
        if (
            seqs >= max_seqs
            or (max_tokens is not None and tokens >= max_tokens)
            or (max_items is not None and len(items) >= max_items)
        ):
            return Window(items, stale, more=True)
    return Window(items, stale)
