"""The end of a run fed by datasets (docs/tasks.md, "The end of a dataset"): whether anything more can arrive for
the trainer. Once nothing can, the groups queued short of a batch are the run's tail and are decided under the
trainer's policy (served as a last smaller batch, or left out by a trainer of exact batch sizes), and once those are
decided too the run is finished: the trainer is told that no batch will come.

`judge` and `is_finished` are the pure decisions over plain records; `read` and `finished` read them in a store
transaction (a run without datasets reads one named value and nothing else).

Nothing more can arrive when the run has a dataset, every dataset is exhausted (every epoch handed out, nothing
leased or waiting: what is left is the fate of the groups acknowledged), and every connected env is either fed by a
dataset (an env of its name sent a group under a task lease, or a dataset was registered naming it) or cannot send:
producers heartbeat for it and none of them is live. A free env that no producer heartbeats for (an Atropos
handler) may always send, as for `stall_reason` (api/producers/live.py). Groups posted without an env (`env_id:
null`) are not a source that can be judged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from api.producers.stored import load_producers
from api.run.state import RunState
from api.store.base import Txn
from api.tasks import fates as task_fates
from api.tasks import records as task_records
from api.tasks.records import Dataset


@dataclass(frozen=True, slots=True)
class DatasetEnd:
    """A dataset as the end of the run judges it."""

    name: str
    exhausted: bool
    """Every epoch handed out, nothing leased or waiting (`Dataset.exhausted`)."""
    done: bool
    """Exhausted and nothing submitted: every task trained, dropped or failed."""


@dataclass(frozen=True, slots=True)
class Source:
    """A connected env as the end of the run judges it."""

    name: str
    fed: bool
    """A dataset feeds it: it can send only what the datasets hand out."""
    watched: bool
    """Some producer heartbeats for it (a handler that never does may send whenever)."""
    live: bool
    """One of those producers is live."""


@dataclass(frozen=True, slots=True)
class Ending:
    """Whether anything more can arrive for the trainer."""

    final: bool
    """Nothing can: what is queued is the run's tail (its last batches, or left out under exact batch sizes)."""
    why_not: str | None = None
    """What may still arrive, in words; None when final, and in a run without datasets (it ends by the trainer's
    own step count)."""


NO_DATASETS = Ending(False)


def judge(datasets: Sequence[DatasetEnd], sources: Sequence[Source]) -> Ending:
    """Whether anything more can arrive: never final without a dataset; final once every dataset is exhausted and
    no connected env can send other than what the datasets handed out."""
    if not datasets:
        return NO_DATASETS
    going = [d.name for d in datasets if not d.exhausted]
    if going:
        return Ending(False, f"dataset(s) {', '.join(map(repr, going))} still hand out tasks or hold leases")
    free = [s for s in sources if not s.fed and (s.live or not s.watched)]
    if free:
        said = [f"{s.name!r} ({'a live producer' if s.live else 'no producer heartbeats for it'})" for s in free[:5]]
        more = f" and {len(free) - 5} more" if len(free) > 5 else ""
        return Ending(False, f"env(s) fed by no dataset may still send: {', '.join(said)}{more}")
    return Ending(True)


def is_finished(ending: Ending, datasets: Sequence[DatasetEnd], queued: int, held: int) -> bool:
    """No batch will come: nothing can arrive, every dataset is done (its tail decided) and no group is queued or
    held in a side buffer."""
    return ending.final and all(d.done for d in datasets) and queued == 0 and held == 0


def _datasets(txn: Txn) -> list[Dataset]:
    out = []
    for name in txn.tasks.dataset_names():
        record = txn.tasks.get_dataset(name)
        if record is not None:
            out.append(Dataset.of(record))
    return out


def read(txn: Txn, run: RunState, now: float, gone_after: float) -> tuple[Ending, list[DatasetEnd]]:
    """`judge` over the store: the datasets, and, once they are all exhausted, the connected envs, which of them
    sent groups under task leases (`task_fates.FED_KEY`, by env name: every producer of an env registers its own) and
    the producers heartbeating for them (live within `gone_after` s of `now`)."""
    if txn.get_value(task_records.ANY_KEY) is None:
        return NO_DATASETS, []
    records = _datasets(txn)
    datasets = [DatasetEnd(d.name, d.exhausted, d.done) for d in records]
    if not datasets or not all(d.exhausted for d in datasets):
        return judge(datasets, []), datasets
    fed = {env.desired_name for e in task_fates.fed_envs(txn) if (env := run.env(e)) is not None}
    fed |= {d.env for d in records if d.env is not None}
    table = load_producers(txn).values()
    sources = []
    for env in run.envs:
        if not env.connected:
            continue
        watchers = [p for p in table if env.env_id in p.env_ids]
        named = env.desired_name in fed or env.wandb_name in fed
        sources.append(Source(env.wandb_name, named, bool(watchers), any(p.live(now, gone_after) for p in watchers)))
    return judge(datasets, sources), datasets


def finished(txn: Txn, ending: Ending) -> bool:
    """`is_finished` over the store (the datasets read again: deciding the tail changed them)."""
    if not ending.final:
        return False
    datasets = [DatasetEnd(d.name, d.exhausted, d.done) for d in _datasets(txn)]
    queued = sum(c.items for c in txn.counts().values())
    held = sum(c.items for c in txn.held.counts().values())
    return is_finished(ending, datasets, queued, held)
