"""Queued groups whose payloads the store lost (`PayloadLost`: a SQLite segment's bytes missing after a power
loss under `synchronous=NORMAL`, docs/stores.md): dropped and counted as `payload_lost`, so formation goes on
with the rest, as it would had the power loss taken their commits too, instead of failing every /batch that
picks them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

from api.errors import RollbufError
from api.ledger.recorder import Recorder
from api.run import state
from api.run.state import RunState
from api.store.base import PayloadLost, Store, Txn

T = TypeVar("T")
log = logging.getLogger("rollbuf")

PAYLOAD_LOST = "payload_lost"
"""Drop reason (`/status`'s `dropped`, the ledger's `reason`): the group's payload was lost by the store."""


class BatchLost(RollbufError):
    """A kept batch asked for again whose groups' payloads were lost since it was formed: it cannot be served
    as it was first served, and a different batch under the same step would break exactly-once."""

    status_code = 500
    code = "internal"


def drop_lost_txn(
    txn: Txn, item_ids: Sequence[int], known: RunState | None, books: Recorder, now: float
) -> dict[str, list[int]]:
    """Drop those of `item_ids` still queued, their payloads unread (`Txn.drop_lost`); their ids by env name."""
    run = state.load(txn, known)
    dropped: dict[str, list[int]] = {}
    for env_id, items in txn.drop_lost(item_ids).items():
        name = run.env_name(env_id)
        ids = [meta.item_id for meta, _ in items]
        books.lost(txn, name, PAYLOAD_LOST, ids, step=run.step, at=now)
        dropped[name] = ids
    return dropped


def kept_batch_lost(step: int, exc: PayloadLost) -> BatchLost:
    """The error a trainer gets for kept batch `step` with lost payloads: what is lost, and how to move on."""
    return BatchLost(
        f"batch {step} cannot be served again: the payloads of its items {list(exc.item_ids)} were lost by the store "
        f"since it was formed ({exc}); its groups are gone: acknowledge the batch to move on (POST /commit with "
        f"step {step + 1}, or ask for batch {step + 1})"
    )


async def dropping_lost(store: Store, fn: Callable[[Txn], T], known: RunState | None, books: Recorder) -> T:
    """`store.transact(fn)` for a function that forms a batch: when it picks groups whose payloads are lost,
    they are dropped (logged, counted) in a transaction of their own and `fn` runs again, over the rest (each
    round drops at least one queued group, so this ends); the error itself when none of them is queued."""
    while True:
        try:
            return await store.transact(fn)
        except PayloadLost as exc:
            drop = partial(drop_lost_txn, item_ids=exc.item_ids, known=known, books=books, now=time.time())
            dropped = await store.transact(drop)
            if not dropped:
                raise
            log.error("payloads lost, their groups dropped (counted as %s), by env: %s; %s", PAYLOAD_LOST, dropped, exc)
