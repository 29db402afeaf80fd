"""Per-request cost against the number of registered envs: ingest groups/s, `/status-env` and `/batch` latency,
and the time one more registration takes, with 10 envs and with many: a transaction that parsed the
whole env list made ingest 6x slower at 3,705 envs and each registration take 34 ms.

Each store starts empty, envs are registered through the API (8 registrations at once), then 8 clients post
groups of 8 x 256 tokens to env 0 for a fixed time. Run: `python -m bench.envs [--envs 10 10000] [--store
sqlite memory postgresql]`; figures are noisy on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from bench import pg
from bench.servers import rollbuf, serve

CLIENTS = 8
SECONDS = 8.0
PROBES = 50


def group(env_id: int, seed: int) -> dict[str, Any]:
    tokens = [[(seed * 7 + i * 13 + j) % 30000 for j in range(256)] for i in range(8)]
    return {"tokens": tokens, "masks": tokens, "scores": [float(i % 2) for i in range(8)], "env_id": env_id}


async def _register(c: httpx.AsyncClient, n: int) -> float:
    """Register envs until there are `n`; the mean seconds of the last 50 registrations."""
    sem = asyncio.Semaphore(8)
    last: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            start = time.perf_counter()
            r = await c.post(
                "/register-env",
                json={"max_token_length": 4096, "desired_name": f"env{i % 97}", "weight": 1.0, "group_size": 8},
            )
            r.raise_for_status()
            if i >= n - PROBES:
                last.append(time.perf_counter() - start)

    await asyncio.gather(*(one(i) for i in range(n)))
    return sum(last) / len(last)


async def _latency(c: httpx.AsyncClient, path: str, params: dict[str, Any]) -> float:
    start = time.perf_counter()
    for _ in range(PROBES):
        (await c.get(path, params=params)).raise_for_status()
    return (time.perf_counter() - start) / PROBES


async def _ingest(c: httpx.AsyncClient) -> float:
    bodies = [json.dumps(group(0, s)).encode() for s in range(32)]
    deadline = time.monotonic() + SECONDS
    done = 0

    async def client(k: int) -> None:
        nonlocal done
        i = k
        while time.monotonic() < deadline:
            r = await c.post(
                "/scored_data", content=bodies[i % len(bodies)], headers={"Content-Type": "application/json"}
            )
            r.raise_for_status()
            done += 1
            i += CLIENTS

    start = time.monotonic()
    await asyncio.gather(*(client(k) for k in range(CLIENTS)))
    return done / (time.monotonic() - start)


async def measure(url: str, n_envs: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        (
            await c.post(
                "/register",
                json={
                    "wandb_group": "b",
                    "wandb_project": "b",
                    "batch_size": 64,
                    "max_token_len": 4096,
                    "checkpoint_dir": "c",
                    "save_checkpoint_interval": 10,
                    "starting_step": 0,
                    "num_steps": 10**6,
                },
            )
        ).raise_for_status()
        await c.get("/batch")
        registration = await _register(c, n_envs)
        status_env = await _latency(c, "/status-env", {"env_id": 0})
        groups_per_s = await _ingest(c)
        batch = await _latency(c, "/batch", {})
    return {
        "envs": n_envs,
        "ingest_groups_per_s": round(groups_per_s, 1),
        "register_ms": round(registration * 1000, 2),
        "status_env_ms": round(status_env * 1000, 2),
        "batch_ms": round(batch * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[10, 10_000])
    parser.add_argument("--store", nargs="+", default=["sqlite"], choices=["sqlite", "memory", "postgresql"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for store in args.store:
            for n in args.envs:
                with ExitStack() as stack:
                    url = {
                        "sqlite": f"sqlite:///{tmp}/{store}-{n}.db",
                        "memory": "memory://",
                        "postgresql": stack.enter_context(pg.database()) if store == "postgresql" else "",
                    }[store]
                    name, cmd, port = rollbuf(url, Path(tmp) / "server.log")
                    target = stack.enter_context(serve(name, cmd, port, Path(tmp) / "server.log"))
                    result = asyncio.run(measure(target.url, n))
                    print(json.dumps({"bench": "envs", "store": store, **result}), flush=True)


if __name__ == "__main__":
    main()
