"""What the task routes do (docs/tasks.md): `Tasks`, one operation a route, each one store transaction over
api/tasks/leases.py (and records.py, totals.py), bounded by the task settings; a dataset file is read a page per
transaction, never whole."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from api.config.settings import Settings
from api.errors import Conflict, InvalidData, NotFound
from api.owners import ANYONE, Actor
from api.run.printable import check_printable
from api.store.base import Store, Txn
from api.store.tasks import TaskRow
from api.tasks import leases as tl
from api.tasks import records as task_records
from api.tasks import totals as task_totals
from api.tasks.files import TaskFile, resolve
from api.tasks.records import Dataset
from api.wire import tasks as wire


def view_of(d: Dataset) -> wire.DatasetView:
    """A dataset as the views show it: its tallies as stored, those at 0 left out."""
    counts = {k: v for k, v in d.counts.items() if v}
    return wire.DatasetView(
        name=d.name,
        env=d.env,
        size=d.size,
        sealed=d.sealed,
        epochs=d.epochs,
        order=d.order,
        levels=d.levels,
        level_sizes=d.level_sizes or None,
        seed=d.seed,
        max_retries=d.max_retries,
        epoch=d.epoch,
        position=d.position,
        counts=counts,
        done=d.done,
    )


def views_txn(txn: Txn, actor: Actor = ANYONE) -> list[wire.DatasetView]:
    """Every dataset's view that `actor` may see (nothing read in runs without one)."""
    if txn.get_value(task_records.ANY_KEY) is None:
        return []
    out = []
    for name in txn.tasks.dataset_names():
        record = txn.tasks.get_dataset(name)
        if record is not None and actor.may((d := Dataset.of(record)).owner):
            out.append(view_of(d))
    return out


def task_view(r: TaskRow) -> wire.TaskView:
    return wire.TaskView(
        dataset=r.dataset,
        epoch=r.epoch,
        index=r.index,
        state=r.state,
        leases=r.leases,
        producer=r.producer,
        expires_at=r.expires_at,
        retries=r.retries,
        ledger_id=r.ledger_id,
        step=r.step,
        reason=r.reason,
        updated_at=r.updated_at,
    )


def _texts(tasks: list[Any], settings: Settings, where: str) -> list[str]:
    if len(tasks) > settings.task_page_size:
        raise InvalidData(("body", where), f"at most {settings.task_page_size} tasks a page (task_page_size)")
    try:
        check_printable({where: tasks})
    except InvalidData as exc:
        raise exc.at("body") from None
    texts = [json.dumps(t, separators=(",", ":")) for t in tasks]
    for i, text in enumerate(texts):
        if len(text.encode()) > settings.task_max_bytes:
            raise InvalidData(("body", where, i), f"over {settings.task_max_bytes} bytes (task_max_bytes)")
    return texts


def _same(d: Dataset, spec: wire.DatasetSpec) -> bool:
    return (d.env, d.epochs, d.seed, d.order, d.max_retries, d.levels, d.level_key) == (
        spec.env,
        spec.epochs,
        spec.seed,
        spec.order,
        spec.max_retries,
        spec.levels,
        spec.level_key,
    )


@dataclass(slots=True)
class Tasks:
    """The tasks' flow: one operation a route, each one store transaction (a dataset file, one a page). The
    settings are the request's (`task_*`, `ledger`), so the bounds a route enforces are the server's."""

    store: Store
    changed: Callable[[], None] = lambda: None
    """Called when a task ends without a group: its dataset may end, and a waiting trainer may get the run's
    tail (`Wakeups.changed`)."""
    _reading: dict[str, asyncio.Task[Dataset]] = field(default_factory=dict)
    """The dataset files this process reads now, by dataset: a registration sent again waits for its reading
    instead of starting another."""

    async def register(self, settings: Settings, spec: wire.DatasetSpec, actor: Actor = ANYONE) -> wire.DatasetView:
        """Register a dataset (a retry of the same registration is answered as the first was); its first page, or
        its file a page at a time. A file is read by one registration at a time, so that its tasks are stored once
        however often a client that gave up waiting sends it again: a retry in this process waits for the reading
        under way, one in another process (a worker, a replica) gets a 409 saying how far it got; one after a
        reader that died goes on where it stopped."""
        if spec.path is not None and spec.tasks is not None:
            raise InvalidData(("body", "path"), "give either path or tasks, not both")
        if not settings.ledger:
            raise Conflict("tasks follow their groups through the ledger: this server runs with ledger off")
        source = resolve(settings.task_files_dir, spec.path) if spec.path is not None else None
        first = _texts(spec.tasks or [], settings, "tasks")
        new = Dataset(
            name=spec.name,
            sealed=False,
            epochs=spec.epochs,
            seed=spec.seed,
            order=spec.order,
            max_retries=spec.max_retries,
            env=spec.env,
            levels=spec.levels,
            level_key=spec.level_key,
            owner=actor.owner,
        )

        def begin(txn: Txn) -> Dataset:
            record = txn.tasks.get_dataset(spec.name)
            if record is not None:
                old = Dataset.of(record)
                if old.owner != actor.owner:
                    raise Conflict(
                        f"the dataset name {spec.name!r} is another key's: names are unique across "
                        "keys (a lease token names its dataset); choose another",
                        loc=("body", "name"),
                    )
                if not _same(old, spec):
                    raise Conflict(f"dataset {spec.name!r} is registered already, differently")
                return old
            tl.register(txn, new, settings.task_max_datasets_per_key)
            if spec.tasks is not None:
                return tl.add_tasks(txn, spec.name, 0, first, last=spec.last, bounds=_bounds(settings))
            return new

        d = await self.store.transact(begin)
        if source is None or d.sealed:
            return view_of(d)
        reading = self._reading
        task = reading.get(spec.name)
        if task is None:
            task = asyncio.get_running_loop().create_task(_read_file(self.store, settings, spec.name, source, actor))
            reading[spec.name] = task
            task.add_done_callback(partial(_read, reading, spec.name))
        return view_of(await asyncio.shield(task))  # a client that gives up leaves the reading to go on

    async def add_page(self, settings: Settings, page: wire.TaskPage, actor: Actor = ANYONE) -> wire.DatasetView:
        texts = _texts(page.tasks, settings, "tasks")
        bounds = _bounds(settings)
        d = await self.store.transact(
            lambda txn: tl.add_tasks(txn, page.dataset, page.first, texts, last=page.last, actor=actor, bounds=bounds)
        )
        return view_of(d)

    async def lease(self, settings: Settings, req: wire.LeaseRequest, actor: Actor = ANYONE) -> wire.LeaseReply:
        n = min(req.n, settings.task_page_size)
        now = time.time()

        def fn(txn: Txn) -> tuple[list[tl.Lease], bool]:
            leases = tl.lease(
                txn,
                req.dataset,
                req.producer_id,
                n,
                now,
                settings.task_lease_s,
                settings.task_max_leases_per_producer,
                actor,
                settings.task_lease_max_bytes,
            )
            record = txn.tasks.get_dataset(req.dataset)
            return leases, record is not None and Dataset.of(record).done

        leases, done = await self.store.transact(fn)
        return wire.LeaseReply(
            leases=[
                wire.LeasedTask(
                    token=x.token, epoch=x.epoch, index=x.index, task=json.loads(x.data), expires_at=x.expires_at
                )
                for x in leases
            ],
            done=done,
        )

    async def heartbeat(self, settings: Settings, tokens: list[str], actor: Actor = ANYONE) -> wire.TaskHeartbeatReply:
        now = time.time()
        out = await self.store.transact(lambda txn: tl.heartbeat(txn, tokens, now, settings.task_lease_s, actor))
        return wire.TaskHeartbeatReply(expires_at=out)

    async def fail(self, body: wire.TaskFailure, actor: Actor = ANYONE) -> wire.TaskFailureReply:
        now = time.time()
        accepted = await self.store.transact(lambda txn: tl.give_up(txn, body.token, body.reason, now, actor))
        if accepted:
            self.changed()  # a task failed may end its dataset: a waiting trainer may get the run's tail
        return wire.TaskFailureReply(accepted=accepted)

    async def datasets(
        self, actor: Actor = ANYONE, *, after: str | None = None, limit: int | None = None
    ) -> list[wire.DatasetView]:
        """The datasets `actor` sees, by name: those named after `after`, at most `limit` of them (all: None)."""
        views = sorted(await self.store.read(lambda txn: views_txn(txn, actor)), key=lambda v: v.name)
        return [v for v in views if after is None or v.name > after][:limit]

    async def rows(
        self, settings: Settings, name: str, after: tuple[int, int], limit: int, actor: Actor = ANYONE
    ) -> wire.TaskRows:
        limit = max(1, min(limit, settings.task_page_size))

        def fn(txn: Txn) -> list[TaskRow]:
            record = txn.tasks.get_dataset(name)
            unknown = NotFound(f"no dataset {name!r}", loc=("query", "dataset"))
            if record is None:
                raise unknown
            actor.check(Dataset.of(record).owner, "dataset", unknown)
            return txn.tasks.scan(name, after, limit)

        found = await self.store.read(fn)
        nxt = (found[-1].epoch, found[-1].index) if len(found) == limit else None
        return wire.TaskRows(tasks=[task_view(r) for r in found], next=nxt)


def _read(reading: dict[str, asyncio.Task[Dataset]], name: str, task: asyncio.Task[Dataset]) -> None:
    if reading.get(name) is task:
        del reading[name]
    if not task.cancelled():
        task.exception()  # seen here: a reading whose every client gave up logs no "never retrieved"


async def _read_file(store: Store, settings: Settings, name: str, source: Path, actor: Actor) -> Dataset:
    """Read dataset `name`'s file into the store from where its stored tasks end, a page per transaction, under a
    claim (`tl.claim_reading`) that keeps any other registration from reading it meanwhile."""
    reader = secrets.token_hex(8)
    d = await store.transact(lambda txn: tl.claim_reading(txn, name, reader, time.time(), actor))
    if d.sealed:
        return d
    try:
        opened = await asyncio.to_thread(TaskFile, source, d.size, settings.task_page_size, settings.task_max_bytes)
        with opened:  # one open file, read on from where the stored tasks end: O(1) per page
            while not d.sealed:
                page = await asyncio.to_thread(opened.next_page)
                last = len(page) < settings.task_page_size
                d = await store.transact(_adding(name, d.size, page, last, actor, settings, reader))
    except Exception:
        with contextlib.suppress(Exception):  # the claim lapses by itself if the store cannot be reached now
            await store.transact(lambda txn: tl.release_reading(txn, name, reader))
        raise
    return d


def _bounds(settings: Settings) -> task_totals.Bounds:
    return task_totals.Bounds(settings.task_max_dataset_size, settings.task_max_bytes_per_key)


def _adding(
    name: str, first: int, page: list[str], last: bool, actor: Actor, settings: Settings, reader: str
) -> Callable[[Txn], Dataset]:
    return lambda txn: tl.add_tasks(
        txn,
        name,
        first,
        page,
        last=last,
        where=("body", "path"),
        actor=actor,
        bounds=_bounds(settings),
        reading=(reader, time.time()),
    )
