"""Trained means acknowledged (docs/tasks.md: with commit mode, the cursor follows the committed step). A task's
row turns `trained` with its step when its batch is formed; the batch is trained only once the trainer
acknowledged it (commit mode: `POST /commit`; next mode: asking for a later batch). Until then the views call it
`served`. Derived when read, from the kept window (the ledger's step rows from the committed mark to the
next step, bounded by the read-ahead), so the stores keep nothing more for it. A batch served again
after a trainer's crash is the same step, so a `served` task becomes `trained` in that step, never twice."""

from __future__ import annotations

import orjson

from api.run.kept import Kept
from api.run.state import KEPT_KEY, STEP_KEY
from api.store.base import Txn
from api.store.tasks import TaskRow
from api.tasks import leases as tl

SERVED = "served"
"""Shown for a `trained` row whose batch is served and not acknowledged yet (never stored)."""


def marks(txn: Txn) -> tuple[int, int]:
    """(the committed mark, the next step to form): batches in between are served and not acknowledged."""
    raw_step = txn.get_value(STEP_KEY)
    step = 0 if raw_step is None else int(orjson.loads(raw_step))
    raw = txn.get_value(KEPT_KEY)
    return (step if raw is None else Kept.from_json(orjson.loads(raw)).committed), step


def unacknowledged(txn: Txn) -> dict[str, int]:
    """Per dataset, its tasks `trained` in a batch served and not acknowledged: what the kept window holds."""
    mark, step = marks(txn)
    if mark >= step:
        return {}
    ids = [i for row in txn.ledger.steps(mark, step - 1) for i in row.group_ids]
    out: dict[str, int] = {}
    for r in txn.tasks.by_ledger(ids) if ids else []:
        if _served(r, mark):
            out[r.dataset] = out.get(r.dataset, 0) + 1
    return out


def _served(r: TaskRow, mark: int) -> bool:
    return r.state == tl.TRAINED and r.step is not None and r.step >= mark


def state_of(r: TaskRow, mark: int) -> str:
    """A row's state as views show it."""
    return SERVED if _served(r, mark) else r.state


def split(counts: dict[str, int], served: int) -> dict[str, int]:
    """Tallies with `served` of the `trained` ones shown apart."""
    if not served:
        return counts
    out = dict(counts)
    out[tl.TRAINED] = out.get(tl.TRAINED, 0) - served
    out[SERVED] = served
    return {k: v for k, v in out.items() if v}
