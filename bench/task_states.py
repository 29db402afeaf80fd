"""What a task's `served` state costs the views and the trainer's acknowledgement (docs/tasks-fates.md): a run in
commit mode whose trainer reads `--ahead` batches past its last commit, each batch of `--per-batch` tasks' groups,
through the ASGI app on one store. Reported: the milliseconds of a `GET /tasks` (the datasets' views) and of a
`GET /tasks/rows` page while those batches are served and not acknowledged, then of the `POST /commit` that
acknowledges them all (the median of `--rounds` rounds, each round a fresh window of `--ahead` batches).

    python -m bench.task_states [--store sqlite|memory] [--ahead 8] [--per-batch 64] [--rounds 5] [--views 50]

Figures are noisy on a shared machine: compare the rows of one run, or runs made one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from api.app import create_app
from api.config.settings import Settings
from tests.factories import env, group, registration

GROUP = 2
"""Sequences a group: a batch of `per_batch` tasks holds `GROUP * per_batch` sequences."""


async def timed(n: int, call: Callable[[], Awaitable[httpx.Response]]) -> float:
    """The median milliseconds of `n` calls."""
    spent = []
    for _ in range(n):
        start = time.perf_counter()
        reply = await call()
        spent.append((time.perf_counter() - start) * 1000)
        reply.raise_for_status()
    return statistics.median(spent)


async def run(store: str, ahead: int, per_batch: int, rounds: int, views: int) -> dict[str, float]:
    settings = Settings(store=store, max_read_ahead_batches=ahead + 1, task_max_leases_per_producer=per_batch)
    app = create_app(settings)
    out: dict[str, list[float]] = {"tasks": [], "rows": [], "commit": []}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            reg = registration(batch_size=GROUP * per_batch, acknowledge="commit")
            (await c.post("/register", json=reg)).raise_for_status()
            await c.get("/batch", params={"step": 0})
            (await c.post("/register-env", json=env(group_size=GROUP))).raise_for_status()
            size = ahead * per_batch * rounds
            spec: dict[str, Any] = {"name": "d", "env": "math", "tasks": [], "last": False}
            (await c.post("/tasks/datasets", json=spec)).raise_for_status()
            page = settings.task_page_size
            for first in range(0, size, page):
                tasks = list(range(first, min(size, first + page)))
                body = {"dataset": "d", "first": first, "tasks": tasks, "last": first + page >= size}
                (await c.post("/tasks/pages", json=body)).raise_for_status()
            step = 0
            for _ in range(rounds):
                for _ in range(ahead):
                    leased = await c.post("/tasks/lease", json={"dataset": "d", "producer_id": "p", "n": per_batch})
                    for x in leased.json()["leases"]:
                        body = group(GROUP, length=4, seed=x["index"], group_id=x["token"])
                        (await c.post("/scored_data", json=body)).raise_for_status()
                    assert (await c.get("/batch", params={"step": step})).json()["batch"] is not None
                    step += 1
                rows: dict[str, str | int] = {"dataset": "d", "limit": per_batch}
                out["tasks"].append(await timed(views, partial(c.get, "/tasks")))
                out["rows"].append(await timed(views, partial(c.get, "/tasks/rows", params=rows)))
                out["commit"].append(await timed(1, partial(c.post, "/commit", json={"step": step})))
            counts = (await c.get("/tasks")).json()[0]["counts"]
            assert counts == {"trained": size}, counts
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", choices=["sqlite", "memory"], default="sqlite")
    parser.add_argument("--ahead", type=int, default=8)
    parser.add_argument("--per-batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--views", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = "memory://" if args.store == "memory" else f"sqlite:///{Path(tmp) / 'bench.db'}"
        got = asyncio.run(run(url, args.ahead, args.per_batch, args.rounds, args.views))
    print(f"{args.store}: {args.ahead} batches of {args.per_batch} tasks served and not acknowledged")
    print(f"  GET /tasks       {got['tasks']:8.2f} ms")
    print(f"  GET /tasks/rows  {got['rows']:8.2f} ms  ({args.per_batch} rows)")
    print(f"  POST /commit     {got['commit']:8.2f} ms  (acknowledges {args.ahead * args.per_batch} tasks)")


if __name__ == "__main__":
    main()
