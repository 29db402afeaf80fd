"""What waiting trainers cost: a server's CPU while 2,000 `GET /batch?wait=` long-polls wait and nothing
changes, and ingest groups/s with them waiting against without (a long-poll that re-ran a write
transaction every 0.5 s would cost 0.7-0.8 of a core and make ingest 30-120x slower).

Run: `python -m bench.long_polls [--polls 2000] [--base DIR]`; with `--base`, that checkout's server is
measured too, in turns. Figures are noisy on a shared machine: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.http import cpu_seconds
from bench.servers import ROOT, rollbuf, serve

IDLE_S = 10.0
WARMUP_S = 20.0
INGEST_S = 6.0


def group(seed: int) -> bytes:
    tokens = [[(seed * 7 + i * 13 + j) % 30000 for j in range(256)] for i in range(8)]
    return json.dumps(
        {"tokens": tokens, "masks": tokens, "scores": [float(i % 2) for i in range(8)], "env_id": 0}
    ).encode()


async def _hold(port: int, n: int) -> list[asyncio.StreamWriter]:
    """n connections, each sending a long-poll for the next batch and not reading the answer yet."""
    writers = []
    for _ in range(n):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /batch?wait=600 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        writers.append(writer)
    await asyncio.gather(*(w.drain() for w in writers))
    return writers


async def _until_waiting(url: str, polls: int) -> float:
    """Seconds until every long-poll has had its first try and waits (the server's gauge says so); a server
    without the gauge (an earlier release) gets WARMUP_S."""
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        while time.monotonic() - start < WARMUP_S:
            text = (await c.get("/metrics")).text
            line = next((x for x in text.splitlines() if x.startswith("rollbuf_waiting_long_polls ")), None)
            if line is not None and float(line.split()[1]) >= polls:
                break
            await asyncio.sleep(0.2)
    return time.monotonic() - start


async def _ingest(url: str, seconds: float) -> float:
    bodies = [group(s) for s in range(32)]
    done = 0
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:

        async def client(k: int) -> None:
            nonlocal done
            i = k
            while time.monotonic() < deadline:
                r = await c.post("/scored_data", content=bodies[i % 32], headers={"Content-Type": "application/json"})
                r.raise_for_status()
                done += 1
                i += 8

        start = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(8)))
    return done / (time.monotonic() - start)


async def measure(url: str, port: int, pid: int, polls: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url) as c:
        reg = {
            "wandb_group": "b",
            "wandb_project": "b",
            "batch_size": 64,
            "max_token_len": 4096,
            "checkpoint_dir": "c",
            "save_checkpoint_interval": 10,
            "starting_step": 0,
            "num_steps": 10,
        }
        (await c.post("/register", json=reg)).raise_for_status()
        await c.get("/batch")
        for name, share in (("e", None), ("silent", 0.5)):  # half of each batch waits for an env that never sends:
            await c.post(
                "/register-env",
                json={
                    "max_token_length": 4096,
                    "desired_name": name,
                    "weight": 1.0,
                    "group_size": 8,
                    "min_batch_allocation": share,
                },
            )
    alone = await _ingest(url, INGEST_S)  # so no batch forms, and the long-polls keep waiting
    writers = await _hold(port, polls)
    settled = await _until_waiting(url, polls)
    cpu = cpu_seconds(pid)
    await asyncio.sleep(IDLE_S)  # the measured interval: nothing changes
    idle_cpu = (cpu_seconds(pid) - cpu) / IDLE_S
    with_polls = await _ingest(url, INGEST_S)
    for w in writers:
        w.close()
    return {
        "polls": polls,
        "settled_s": round(settled, 1),
        "idle_cpu_cores": round(idle_cpu, 3),
        "ingest_groups_per_s_alone": round(alone, 1),
        "ingest_groups_per_s_with_polls": round(with_polls, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--base", type=Path, help="another checkout, measured too")
    args = parser.parse_args()
    sides = [("after", ROOT)] + ([("before", args.base)] if args.base else [])
    with tempfile.TemporaryDirectory() as tmp:
        for side, root in sides:
            name, cmd, port = rollbuf(f"sqlite:///{tmp}/{side}.db", Path(tmp) / f"{side}.log")
            cmd += ["--max-batch-wait", "600"]
            if side == "after":
                cmd += ["--max-connections", str(args.polls + 100)]
            with serve(name, cmd, port, Path(tmp) / f"{side}.log", cwd=root) as target:
                result = asyncio.run(measure(target.url, port, target.pid, args.polls))
            print(json.dumps({"bench": "long-polls", "side": side, **result}), flush=True)


if __name__ == "__main__":
    main()
