"""A task follows its group's fate: the hooks the ledger calls where it records a group's fate, in the same
transaction (api/ledger/recorder.py). A group sent under a task's lease marks its task submitted, served with its
step, trained when the trainer acknowledges that step, or dropped (offered again while its retries last). Each
costs the rows it touches: the groups of a step come from its ledger row, their tasks by ledger id."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

from api.store import base as fates
from api.store.base import LedgerGroup, Txn
from api.tasks import states
from api.tasks.records import ANY_KEY, Moves, count, dropped, moved
from api.tasks.states import DROPPED
from api.tasks.tokens import parse_token

FED_KEY = "tasks:fed"
"""A named value: the env ids that sent a group under a task lease (a JSON list), so that the end of a run tells an
env fed by datasets from a free one, which may send for as long as it is live (api/tasks/ending.py). A named value,
not a field of the dataset records, which a server of an earlier release reads as it wrote them."""


def on_acknowledged(txn: Txn, rows: Sequence[LedgerGroup]) -> None:
    """Groups just acknowledged (their ledger rows): those sent under a lease mark their task submitted (or, when
    dropped at once, dropped). A group on a lease that expired takes its task back unless another group has it."""
    leased = [(r, p) for r in rows if r.group_id is not None and (p := parse_token(r.group_id)) is not None]
    if not leased or txn.get_value(ANY_KEY) is None:
        return
    _feeding(txn, {r.env_id for r, _ in leased})
    moves = Moves(txn)
    now = rows[0].acked_at
    for ledger_row, token in leased:
        name, key = token.dataset, (token.epoch, token.index)
        d = moves.get(name)
        row = txn.tasks.rows(name, [key]).get(key) if d else None
        if d is None or row is None or not states.may("submit", row):
            if d is not None:
                count(d, "late")
            continue
        row = moved(d, row, states.submit(row, ledger_row.id, now))
        if ledger_row.fate == fates.DROPPED:
            row = dropped(d, row, ledger_row.reason or DROPPED, ledger_row.step, now)
        txn.tasks.put_rows([row])
    moves.write()


def fed_envs(txn: Txn) -> set[int]:
    """The env ids that sent a group under a task lease (`FED_KEY`)."""
    raw = txn.get_value(FED_KEY)
    return set() if raw is None else set(json.loads(raw))


def _feeding(txn: Txn, env_ids: set[int]) -> None:
    """Record that these envs sent groups under task leases: written only when one is new (once per env)."""
    known = fed_envs(txn)
    if not env_ids <= known:
        txn.set_value(FED_KEY, json.dumps(sorted(known | env_ids)))


def on_decided(txn: Txn, ids: Sequence[int], fate: str, *, step: int, reason: str | None, now: float) -> None:
    """Groups served in batch `step` or dropped (`reason`) at it: their tasks follow (served until the trainer
    acknowledges the step: `on_trained`)."""
    if not ids or fate not in (fates.SERVED, fates.DROPPED) or txn.get_value(ANY_KEY) is None:
        return
    rows = txn.tasks.by_ledger(ids)
    if not rows:
        return
    moves = Moves(txn)
    out = []
    for row in rows:
        d = moves.get(row.dataset)
        if d is None or not states.may("serve" if fate == fates.SERVED else "drop", row):
            continue
        if fate == fates.SERVED:
            out.append(moved(d, row, states.serve(row, step, now)))
        else:
            out.append(dropped(d, row, reason or DROPPED, step, now))
    txn.tasks.put_rows(out)
    moves.write()


def on_trained(txn: Txn, first: int, before: int, now: float) -> None:
    """The trainer acknowledged the batches of steps `first` to `before - 1` (the committed mark moved): their
    served tasks are trained, in their steps. Costs the ledger's rows of those steps and their tasks' rows: the
    groups of each step come from its ledger row, their tasks by ledger id."""
    if before <= first or txn.get_value(ANY_KEY) is None:
        return
    ids = [i for row in txn.ledger.steps(first, before - 1) for i in row.group_ids]
    rows = txn.tasks.by_ledger(ids) if ids else []
    moves = Moves(txn)
    out = []
    for row in rows:
        d = moves.get(row.dataset)
        if d is not None and states.may("acknowledge", row) and row.step is not None and first <= row.step < before:
            out.append(moved(d, row, states.acknowledge(row, now)))
    if out:
        txn.tasks.put_rows(out)
        moves.write()


def on_requeued(txn: Txn, old_id: int, new_id: int) -> None:
    """A held group released under a new ledger id: its task follows it."""
    if txn.get_value(ANY_KEY) is None:
        return
    rows = txn.tasks.by_ledger([old_id])
    txn.tasks.put_rows([replace(r, ledger_id=new_id) for r in rows])
