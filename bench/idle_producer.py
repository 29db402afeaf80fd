"""What an idle producer costs the server: requests a minute, by route, of a RolloutRunner with nothing to do.

One env that posts each rollout (`posts_each_rollout`, G=16) and a task source that hands out nothing, against a
real server (memory store) with no group open anywhere: the runner reads `/status-env` every `poll_interval`,
heartbeats every sixth of `producer_gone_after`, and asks for sibling slots (`POST /rollouts/lease`) only when a
heartbeat's reply says some may be due. Counted from the server's /metrics over `--seconds`, after the first
heartbeat's reply.

    .venv/bin/python -m bench.idle_producer [--seconds 60] [--poll-interval 0.2]

Not part of `make bench` (a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.servers import rollbuf, serve
from rollout_client import RolloutRunner, ScriptedPolicy, Task
from rollout_client.examples import arithmetic_script
from tests.factories import registration
from tests.per_rollout_producer import Slow


class Nothing:
    """A task source with nothing to hand out: the producer stays idle."""

    async def anext_task(self) -> Task | None:
        await asyncio.Event().wait()
        return None

    def next_task(self) -> Task | None:
        raise AssertionError("anext_task is used")

    def report(self, task: Task, mean_score: float) -> None:
        pass


def requests(url: str) -> Counter[str]:
    """Requests the server answered so far, by method and route (the server's /metrics)."""
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == "rollbuf_request_duration_seconds_count":
                out[f"{s.labels['method']} {s.labels['route']}"] += int(s.value)
    return out


async def measure(url: str, seconds: float, poll_interval: float) -> dict[str, float]:
    with httpx.Client(base_url=url) as c:
        c.post("/register", json=registration(batch_size=16)).raise_for_status()
        c.get("/batch")
    runner = RolloutRunner(
        url, [(Slow(), Nothing())], ScriptedPolicy(arithmetic_script), max_in_flight=16, poll_interval=poll_interval
    )
    run = asyncio.create_task(runner.run())
    try:
        while requests(url)["POST /producers/heartbeat"] < 2:  # the first reply taken in
            await asyncio.sleep(0.1)
        before, t0 = requests(url), time.monotonic()
        await asyncio.sleep(seconds)
        after, elapsed = requests(url), time.monotonic() - t0
    finally:
        runner.stop()
        await run
    return {k: (after[k] - before[k]) * 60 / elapsed for k in sorted(after) if "/metrics" not in k}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--poll-interval", type=float, default=0.2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        name, cmd, port = rollbuf("memory://", Path(tmp) / "server.log")
        with serve(name, cmd, port, Path(tmp) / "server.log") as target:
            rates = asyncio.run(measure(target.url, args.seconds, args.poll_interval))
    for route, per_minute in rates.items():
        if per_minute:
            print(f"{route:32s} {per_minute:8.1f} a minute")
    print(f"{'all':32s} {sum(rates.values()):8.1f} a minute")


if __name__ == "__main__":
    main()
