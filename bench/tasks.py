"""Task leases per second (docs/tasks.md): leasing must cost the same per task at 1k and at millions of
tasks. For each store and dataset size: the dataset loaded (tasks/s), then `--leases` leases taken one per
transaction by 1 / 8 / 32 concurrent producers, each lease's group acknowledged (its task submitted) in its own
transaction as ingest would; leases/s, and per shuffled and sequential order. Through the store, without HTTP.

`--source file` registers the dataset as the server does from a JSONL file under `task_files_dir`
(api/tasks/service.py's `Tasks.register`: one open file, a page per transaction), and the process's resident memory
(VmRSS, this process is the server here) is reported after the store opened, after the load and after the
leases: on SQLite and PostgreSQL it stays flat whatever the dataset's size (the memory store keeps the tasks in
memory, by design).

    python -m bench.tasks [--sizes 1000 1000000] [--stores memory sqlite postgresql] [--leases 2000]
                          [--source pages|file] [--producers 1 8 32]

Figures are noisy on a shared machine: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from api.config.settings import Settings
from api.store import Store, make_store
from api.store.base import QUEUED, LedgerGroup, Txn
from api.tasks import fates as task_fates
from api.tasks import leases as tl
from api.tasks import records as task_records
from api.tasks.records import Dataset
from api.tasks.service import Tasks
from api.wire.tasks import DatasetSpec

PAGE = 10_000


def store_url(kind: str, tmp: Path, name: str, stack: contextlib.ExitStack) -> str:
    if kind == "memory":
        return "memory://"
    if kind == "sqlite":
        return f"sqlite:///{tmp / f'{name}.db'}"
    from tests import pg

    return pg.url_of(stack.enter_context(pg.database()), schema="bench_tasks")


def rss_mb() -> float:
    """This process's resident memory now (MiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_jsonl(path: Path, size: int) -> None:
    with path.open("w") as f:
        for first in range(0, size, PAGE):
            f.write("".join(f'{{"q":{i}}}\n' for i in range(first, min(size, first + PAGE))))


async def load_file(store: Store, size: int, order: str, tmp: Path) -> float:
    path = tmp / f"tasks-{size}.jsonl"
    if not path.exists():
        write_jsonl(path, size)
    settings = Settings(store="memory://", task_files_dir=tmp)
    spec = DatasetSpec(name="d", order=order, epochs=None, path=path.name)
    started = time.perf_counter()
    view = await Tasks(store).register(settings, spec)
    assert view.size == size and view.sealed, view
    return size / (time.perf_counter() - started)


async def load(store: Store, size: int, order: str) -> float:
    started = time.perf_counter()
    await store.transact(lambda txn: tl.register(txn, Dataset(name="d", sealed=False, order=order, epochs=None)))
    for first in range(0, size, PAGE):
        page = [f'{{"q":{i}}}' for i in range(first, min(size, first + PAGE))]
        last = first + PAGE >= size
        await store.transact(partial(tl.add_tasks, name="d", first=first, data=page, last=last))
    return size / (time.perf_counter() - started)


async def lease_loop(store: Store, producers: int, leases: int) -> float:
    ids = itertools.count(1)
    left = [leases]

    async def producer(name: str) -> None:
        while left[0] > 0:
            left[0] -= 1
            got = await store.transact(lambda txn: tl.lease(txn, "d", name, 1, time.time(), 300.0, 1024))
            rows = [
                LedgerGroup(
                    id=next(ids),
                    env_id=0,
                    group_id=x.token,
                    handler=None,
                    acked_at=time.time(),
                    policy_step=0,
                    seqs=1,
                    tokens=1,
                    bytes=1,
                    score_mean=0,
                    score_min=0,
                    score_max=0,
                    score_std=0,
                    fate=QUEUED,
                )
                for x in got
            ]

            def ack(txn: Txn, rows: list[LedgerGroup] = rows) -> None:
                task_fates.on_acknowledged(txn, rows)

            await store.transact(ack)

    started = time.perf_counter()
    await asyncio.gather(*(producer(f"p{i}") for i in range(producers)))
    return leases / (time.perf_counter() - started)


async def run(
    stores: list[str], sizes: list[int], leases: int, orders: list[str], source: str, counts: list[int]
) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, size, order in itertools.product(stores, sizes, orders):
            stack = contextlib.ExitStack()
            store = make_store(store_url(kind, Path(tmp), f"{size}-{order}", stack))
            try:
                await store.transact(lambda txn: txn.get_value(task_records.ANY_KEY))  # opened (PostgreSQL: connected)
                row: dict[str, Any] = {"store": kind, "tasks": size, "order": order, "source": source}
                row["rss_mb_open"] = round(rss_mb())
                loaded = await (
                    load_file(store, size, order, Path(tmp)) if source == "file" else load(store, size, order)
                )
                row["load_tasks_per_s"] = round(loaded)
                row["rss_mb_loaded"] = round(rss_mb())
                for producers in counts:  # a count given twice (1 8 32 1): the later figure under `_again`
                    key = f"leases_per_s_{producers}"
                    row[key + "_again" if key in row else key] = round(await lease_loop(store, producers, leases))
                row["rss_mb_leased"] = round(rss_mb())
                print(json.dumps(row), flush=True)
                out.append(row)
            finally:
                await store.close()
                stack.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 1_000_000])
    ap.add_argument("--stores", nargs="+", default=["memory", "sqlite"])
    ap.add_argument("--orders", nargs="+", default=["shuffled"])
    ap.add_argument("--leases", type=int, default=2000)
    ap.add_argument("--source", choices=["pages", "file"], default="pages")
    ap.add_argument("--producers", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    asyncio.run(run(args.stores, args.sizes, args.leases, args.orders, args.source, args.producers))


if __name__ == "__main__":
    main()
