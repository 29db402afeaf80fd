"""What holding a group in the side buffer costs as the buffer grows: groups of 7 x 256 tokens posted one after
another to an env of group size 8 (they never add up to it), with the latency of the first and the last 50
submissions, and the SQLite write-ahead log's size at the end (a side buffer kept as one blob that each
submission reads and rewrites takes latency from 5.6 to 70 ms over 600 groups, and writes 5.4 GB of WAL in 17 s).

Run: `python -m bench.side_buffer [--groups 600] [--store sqlite memory postgresql]`. The side buffer's own
bound is raised for the run (`ROLLBUF_SIDE_BUFFER_MAX_GROUPS`), so that every group is held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from bench import pg
from bench.servers import rollbuf, serve

WINDOW = 50


def group(seed: int) -> bytes:
    tokens = [[(seed * 7 + i * 13 + j) % 30000 for j in range(256)] for i in range(7)]
    body = {"tokens": tokens, "masks": tokens, "scores": [float(i % 2) for i in range(7)], "env_id": 0}
    return json.dumps(body).encode()


async def measure(url: str, n: int, wal: Path | None) -> dict[str, Any]:
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
        (
            await c.post(
                "/register-env",
                json={"max_token_length": 4096, "desired_name": "short", "weight": 1.0, "group_size": 8},
            )
        ).raise_for_status()
        bodies = [group(s) for s in range(32)]
        took: list[float] = []
        wal_max = 0
        start = time.monotonic()
        for i in range(n):
            t0 = time.perf_counter()
            r = await c.post("/scored_data", content=bodies[i % 32], headers={"Content-Type": "application/json"})
            took.append(time.perf_counter() - t0)
            r.raise_for_status()
            assert r.json()["status"] == "buffered", r.text
            if wal is not None and wal.exists():
                wal_max = max(wal_max, wal.stat().st_size)
        seconds = time.monotonic() - start
        status = (await c.get("/status")).json()
    first, last = took[:WINDOW], took[-WINDOW:]
    return {
        "groups": n,
        "seconds": round(seconds, 2),
        "first_ms": round(1000 * sum(first) / len(first), 2),
        "last_ms": round(1000 * sum(last) / len(last), 2),
        "wal_max_mb": round(wal_max / 1e6, 1),
        "held_groups": status.get("held_groups"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=600)
    parser.add_argument("--store", nargs="+", default=["sqlite"], choices=["sqlite", "memory", "postgresql"])
    args = parser.parse_args()
    os.environ["ROLLBUF_SIDE_BUFFER_MAX_GROUPS"] = str(args.groups)
    os.environ["ROLLBUF_SIDE_BUFFER_MAX_BYTES"] = str(1 << 40)
    with tempfile.TemporaryDirectory() as tmp:
        for store in args.store:
            with ExitStack() as stack:
                db = Path(tmp) / "side.db"
                url = {
                    "sqlite": f"sqlite:///{db}",
                    "memory": "memory://",
                    "postgresql": stack.enter_context(pg.database()) if store == "postgresql" else "",
                }[store]
                name, cmd, port = rollbuf(url, Path(tmp) / "server.log")
                target = stack.enter_context(serve(name, cmd, port, Path(tmp) / "server.log"))
                wal = Path(f"{db}-wal") if store == "sqlite" else None
                result = asyncio.run(measure(target.url, args.groups, wal))
                print(json.dumps({"bench": "side_buffer", "store": store, **result}), flush=True)


if __name__ == "__main__":
    main()
