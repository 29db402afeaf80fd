"""Task leases per second (issue 39, docs/tasks.md): leasing must cost the same per task at 1k and at millions of
tasks. For each store and dataset size: the dataset loaded in pages (tasks/s), then `--leases` leases taken one
per transaction by 1 / 8 / 32 concurrent producers, each lease's group acknowledged (its task submitted) in its own
transaction as ingest would; leases/s, and per shuffled and sequential order. Through the store, without HTTP.

    python -m bench.tasks [--sizes 1000 1000000] [--stores memory sqlite postgresql] [--leases 2000]

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

from api import task_leases as tl
from api.store import Store, make_store
from api.store.base import QUEUED, LedgerGroup, Txn

PAGE = 10_000


def store_url(kind: str, tmp: Path, name: str, stack: contextlib.ExitStack) -> str:
    if kind == "memory":
        return "memory://"
    if kind == "sqlite":
        return f"sqlite:///{tmp / f'{name}.db'}"
    from tests import pg

    return pg.url_of(stack.enter_context(pg.database()), schema="bench_tasks")


async def load(store: Store, size: int, order: str) -> float:
    started = time.perf_counter()
    await store.transact(lambda txn: tl.register(txn, tl.Dataset(name="d", sealed=False, order=order, epochs=None)))
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
                tl.on_acknowledged(txn, rows)

            await store.transact(ack)

    started = time.perf_counter()
    await asyncio.gather(*(producer(f"p{i}") for i in range(producers)))
    return leases / (time.perf_counter() - started)


async def run(stores: list[str], sizes: list[int], leases: int, orders: list[str]) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, size, order in itertools.product(stores, sizes, orders):
            stack = contextlib.ExitStack()
            store = make_store(store_url(kind, Path(tmp), f"{size}-{order}", stack))
            try:
                loaded = await load(store, size, order)
                row: dict[str, Any] = {"store": kind, "tasks": size, "order": order, "load_tasks_per_s": round(loaded)}
                for producers in (1, 8, 32):
                    row[f"leases_per_s_{producers}"] = round(await lease_loop(store, producers, leases))
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
    args = ap.parse_args()
    asyncio.run(run(args.stores, args.sizes, args.leases, args.orders))


if __name__ == "__main__":
    main()
