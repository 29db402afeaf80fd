"""A dataset's record (its spec, cursor and tallies: one JSON row) and the moves that change it: a function that
moves tasks reads each record it touches once (`Moves`), moves rows through api/tasks/states.py with the record's
tallies and held leases along (`moved`), and writes each record once at its end."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from api.errors import NotFound
from api.owners import Actor
from api.store.base import Txn
from api.store.tasks import TaskRow
from api.tasks import states
from api.tasks.states import LEASED, SUBMITTED, WAITING

EVENTS = ("expired", "retried", "late")
"""Counted, not states: leases that ended unheartbeated, tasks offered again under the retry policy, groups that
came on a lease their task no longer had (their task was already submitted)."""


ANY_KEY = "tasks:any"
"""A named value set once a dataset exists: the hooks cost nothing in runs without one."""


_WEIGHTED_DEFAULTS: dict[str, object] = {"levels": None, "level_key": "level", "level_sizes": {}, "taken": {}}
"""The weighted order's fields, left out of a record while at their defaults (a server that predates them reads
the records of the other orders as it wrote them)."""


@dataclass(slots=True)
class Dataset:
    """A dataset's record: what it was registered with, its cursor and its tallies."""

    name: str
    size: int = 0
    """Tasks stored so far (indices 0..size-1)."""
    sealed: bool = True
    """All its tasks are stored: the cursor may end an epoch. A dataset posted in pages is sealed by its last."""
    epochs: int | None = 1
    """None: forever."""
    seed: int = 0
    order: str = "sequential"
    max_retries: int = 0
    """Times a dropped or failed task is offered again (0: counted and moved on)."""
    env: str | None = None
    levels: dict[str, float] | None = None
    """A weighted order's curriculum: each level's weight (api/tasks/order.py)."""
    level_key: str = "level"
    """A weighted order: the field of a task (a JSON object) that names its level."""
    level_sizes: dict[str, int] = field(default_factory=dict)
    """A weighted order: tasks stored per level (a level's tasks are stored by rank under `level_store`)."""
    epoch: int = 0
    position: int = 0
    """The cursor: the next position of `epoch`'s order to hand out."""
    taken: dict[str, int] = field(default_factory=dict)
    """A weighted order: tasks of each level handed out by the cursor this epoch."""
    next_seq: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    """Tasks per state (STATES) and events (EVENTS)."""
    held: dict[str, int] = field(default_factory=dict)
    """Leases held per producer."""
    owner: str | None = None
    """The key that registered it (None without keys): only that key's env role adds to it, leases from it and
    sees it (`api.owners`)."""

    def to_json(self) -> str:
        out = {f.name: getattr(self, f.name) for f in fields(self)}  # not asdict: no deep copies
        for name, default in _WEIGHTED_DEFAULTS.items():
            if out[name] == default:
                del out[name]  # a dataset of another order keeps the record it had before weighted orders
        return json.dumps(out, separators=(",", ":"))

    @staticmethod
    def of(text: str) -> Dataset:
        return Dataset(**json.loads(text))

    @property
    def exhausted(self) -> bool:
        """Every epoch handed out and nothing leased or waiting: what is left to come is the fate of its submitted
        groups (queued, or held), of which a dropped one may still be offered again under `max_retries`."""
        last = self.epochs is not None and self.epoch >= self.epochs - 1 and self.position >= self.size
        return self.sealed and last and not any(self.counts.get(s) for s in (LEASED, WAITING))

    @property
    def done(self) -> bool:
        """Exhausted, and nothing submitted: every task trained, dropped or failed (docs/tasks.md, "The end of a
        dataset")."""
        return self.exhausted and not self.counts.get(SUBMITTED)


class Moves:
    """The dataset records one function changed, written once at its end."""

    def __init__(self, txn: Txn) -> None:
        self.txn = txn
        self.sets: dict[str, Dataset] = {}

    def get(self, name: str) -> Dataset | None:
        if name not in self.sets:
            text = self.txn.tasks.get_dataset(name)
            if text is None:
                return None
            self.sets[name] = Dataset.of(text)
        return self.sets[name]

    def write(self) -> None:
        for d in self.sets.values():
            self.txn.tasks.put_dataset(d.name, d.to_json())


def moved(d: Dataset, row: TaskRow, new: TaskRow) -> TaskRow:
    """`new`, a move of `row` (api/tasks/states.py), with its dataset's tallies and held leases moved along: a
    move to the front takes the place `d.next_seq` gave it, and a task offered again counts as retried."""
    d.counts = states.counted(d.counts, row.state, new.state)
    if row.state == LEASED and row.producer is not None:
        left = d.held.get(row.producer, 0) - 1
        if left > 0:
            d.held[row.producer] = left
        else:
            d.held.pop(row.producer, None)
    if new.state == LEASED and new.producer is not None:
        d.held[new.producer] = d.held.get(new.producer, 0) + 1
    if new.state == WAITING:
        d.next_seq = max(d.next_seq, new.seq + 1)
        if new.retries > row.retries:
            count(d, "retried")
    return new


def count(d: Dataset, event: str, n: int = 1) -> None:
    d.counts[event] = d.counts.get(event, 0) + n


def dataset(moves: Moves, name: str, actor: Actor, loc: tuple[str | int, ...] = ("body", "dataset")) -> Dataset:
    """The dataset `actor` acts on: 404 if there is none of that name, or another key's (answered alike)."""
    d = moves.get(name)
    unknown = NotFound(f"no dataset {name!r}", loc=loc)
    if d is None:
        raise unknown
    actor.check(d.owner, "dataset", unknown)
    return d


def dropped(d: Dataset, row: TaskRow, reason: str, step: int | None, now: float) -> TaskRow:
    """A submitted task whose group was dropped: offered again while its retries last, else dropped."""
    return moved(d, row, states.drop(row, reason, step, now, max_retries=d.max_retries, seq=d.next_seq))
