"""Long-poll wake-up latency across PostgreSQL replicas: how long after one replica acknowledged the group
that completes a batch does a trainer long-polling another replica have that batch?

Two `rollbuf serve` processes on one database. Each round, a trainer long-polls replica A for the next
step (`?step=N&wait=30`); once it waits, an env posts the group that completes the batch to replica B (or,
for reference, to A itself). Latency: from the env's 200 to the trainer's reply, both seen by this process.
Without LISTEN/NOTIFY a replica would only notice on its 0.5 s re-check (250 ms on average).

    python -m bench.replicas [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench import pg
from bench.servers import rollbuf, serve

GROUP = 4
SETTLE_S = 0.05
"""Time given to the trainer's request to start waiting before the env posts (a benchmark, not a test)."""


def _group(env_id: int, i: int) -> dict[str, Any]:
    return {
        "tokens": [[1, 2, 3, i % 1000]] * GROUP,
        "masks": [[-100, 2, 3, i % 1000]] * GROUP,
        "scores": [1.0, 0.0, 1.0, 0.0],
        "env_id": env_id,
        "group_id": f"wake-{i}",
    }


def measure(poll_url: str, post_url: str, env_id: int, step: int, rounds: int) -> tuple[list[float], int]:
    """Latencies (s) of `rounds` batches, starting at `step`; the next step."""
    out = []
    with httpx.Client(base_url=poll_url, timeout=60) as trainer, httpx.Client(base_url=post_url, timeout=60) as env:
        for _ in range(rounds):
            got: dict[str, Any] = {}

            def poll(step: int = step, got: dict[str, Any] = got) -> None:
                r = trainer.get("/batch", params={"step": step, "wait": 30})
                got["t"] = time.perf_counter()
                got["batch"] = r.json()["batch"]

            t = threading.Thread(target=poll)
            t.start()
            time.sleep(SETTLE_S)
            r = env.post("/scored_data", json=_group(env_id, step))
            posted = time.perf_counter()
            r.raise_for_status()
            t.join()
            assert got["batch"], "the long-poll ended without the batch"
            out.append(got["t"] - posted)
            step += 1
    return out, step


def run(rounds: int = 40) -> list[dict[str, Any]]:
    if not pg.available():
        return []
    results = []
    with tempfile.TemporaryDirectory() as tmp, pg.database() as url:
        a_cmd, b_cmd = rollbuf(url, Path(tmp) / "a.log"), rollbuf(url, Path(tmp) / "b.log")
        with serve(*a_cmd, Path(tmp) / "a.log") as a, serve(*b_cmd, Path(tmp) / "b.log") as b:
            with httpx.Client(base_url=a.url, timeout=30) as c:
                reg = {
                    "wandb_group": "b",
                    "wandb_project": "b",
                    "batch_size": GROUP,
                    "max_token_len": 64,
                    "checkpoint_dir": "c",
                    "save_checkpoint_interval": 0,
                    "starting_step": 0,
                    "num_steps": 10**6,
                }
                c.post("/register", json=reg).raise_for_status()
                c.get("/batch", params={"step": 0}).raise_for_status()
                env = {"max_token_length": 64, "desired_name": "wake", "weight": 1.0, "group_size": GROUP}
                env_id = c.post("/register-env", json=env).json()["env_id"]
            step = 0
            for name, post_url in (("other replica", b.url), ("same replica", a.url)):
                lat, step = measure(a.url, post_url, env_id, step, rounds)
                lat.sort()
                results.append(
                    {
                        "bench": "wakeup",
                        "store": "postgresql",
                        "posted_to": name,
                        "rounds": rounds,
                        "median_ms": round(statistics.median(lat) * 1e3, 2),
                        "p90_ms": round(lat[int(0.9 * (len(lat) - 1))] * 1e3, 2),
                        "max_ms": round(lat[-1] * 1e3, 2),
                    }
                )
    return results


def report(results: list[dict[str, Any]]) -> str:
    rows = [r for r in results if r.get("bench") == "wakeup"]
    if not rows:
        return ""
    lines = ["long-poll wake-up, PostgreSQL replicas (env's 200 to the trainer's batch, ms):"]
    lines += [
        f"  posted to the {r['posted_to']:13}: median {r['median_ms']}, p90 {r['p90_ms']}, max {r['max_ms']}"
        for r in rows
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=40)
    print(report(run(ap.parse_args().rounds)))
