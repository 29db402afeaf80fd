"""Rollout scheduling: slot use with long-tail rollouts, and worker balance with large groups, against a real
rollbuf server process. One side of `python -m bench.runner --scheduling [--base DIR]`, which runs it in
turns against this checkout and another (its `rollout_client` first on PYTHONPATH); it prints one JSON line.

- long tail: G=8, 32 slots, in the runner's process; a rollout waits 20 ms / u (u uniform in [0.02, 1],
  so 20 ms to 1 s, median 40 ms): rollouts/s, and every 10 ms the rollouts running (counted by the env)
  against the slots held (`stats.in_flight`) and against all 32. Twice: scored per group (the rollouts run
  and are scored together) and scored per rollout (`scores_each_rollout`, scheduled one by one).
- G=64 on 2 workers (64 slots, one group at a time): a rollout is 2 x (10 ms CPU + 10 ms wait); rollouts/s
  (rollouts that ended in the window) and each worker's idle share (the time no rollout ran in it, from the
  rollouts' own start and end times). The env scores each rollout alone (`scores_each_rollout`), which a
  checkout without it ignores.

    python bench/scheduling.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.servers import register_trainer, rollbuf, serve
from rollout_client import RolloutRunner, ScriptedPolicy, Session, Task, Tasks
from rollout_client.examples import Arithmetic, arithmetic_script, arithmetic_task, busy
from rollout_client.policy import stable_unit

MEASURE_S = 6.0
SAMPLE_S = 0.01
RUNNING = {"now": 0}


@dataclass
class LongTail(Arithmetic):
    name: str = "long_tail"
    group_size: int = 8
    scores_each_rollout: bool = True

    async def rollout(self, task: Task, session: Session) -> None:
        RUNNING["now"] += 1
        try:
            u = max(0.02, stable_unit("tail", session.seed or 0))
            await asyncio.sleep(0.02 / u)
            await super().rollout(task, session)
        finally:
            RUNNING["now"] -= 1


@dataclass
class Heavy(Arithmetic):
    name: str = "heavy"
    group_size: int = 64
    scores_each_rollout: bool = True
    log: str = ""

    async def rollout(self, task: Task, session: Session) -> None:
        t0 = time.monotonic()
        for _ in range(2):
            busy(0.01)
            await asyncio.sleep(0.01)
        await super().rollout(task, session)
        with open(self.log, "a") as f:  # one short line per rollout: appends from several processes stay whole
            f.write(f"{os.getpid()} {t0} {time.monotonic()}\n")


def _union(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by `spans`."""
    total, end = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


async def _measure(runner: RolloutRunner, size: int, sample: Any = None) -> tuple[float, float, float, Any]:
    run = asyncio.create_task(runner.run())
    while runner.stats.accepted == 0 and not run.done():
        await asyncio.sleep(0.05)
    a0, t0 = runner.stats.accepted, time.monotonic()
    samples = []
    while time.monotonic() - t0 < MEASURE_S:
        if sample is not None:
            samples.append(sample())
        await asyncio.sleep(SAMPLE_S)
    a1, t1 = runner.stats.accepted, time.monotonic()
    runner.stop()
    await run
    return (a1 - a0) * size / (t1 - t0), t0, t1, samples


async def long_tail(url: str, per_rollout: bool) -> dict[str, Any]:
    env = LongTail(name=f"long_tail_{int(per_rollout)}", scores_each_rollout=per_rollout)
    runner = RolloutRunner(url, [(env, Tasks(arithmetic_task))], ScriptedPolicy(arithmetic_script), max_in_flight=32)
    rate, _, _, samples = await _measure(runner, 8, lambda: (RUNNING["now"], runner.stats.in_flight))
    held = [r / h for r, h in samples if h > 0]
    return {
        "rollouts_per_s": round(rate, 1),
        "running_of_held": round(sum(held) / max(1, len(held)), 3),
        "running_of_slots": round(sum(r for r, _ in samples) / max(1, len(samples)) / 32, 3),
    }


async def two_workers(url: str, log: Path) -> dict[str, Any]:
    env = Heavy(log=str(log))
    runner = RolloutRunner(
        url, [(env, Tasks(arithmetic_task))], ScriptedPolicy(arithmetic_script), max_in_flight=64, num_workers=2
    )
    _, t0, t1, _ = await _measure(runner, 64)
    spans: dict[str, list[tuple[float, float]]] = {}
    for line in log.read_text().splitlines():
        pid, a, b = line.split()
        spans.setdefault(pid, []).append((float(a), float(b)))
    ended = sum(t0 <= b <= t1 for s in spans.values() for _, b in s)
    rate = ended / (t1 - t0)  # rollouts, not groups x 64: a 6 s window holds only a few groups
    idle = sorted(1 - _union(s, t0, t1) / (t1 - t0) for s in spans.values())
    idle += [1.0] * max(0, 2 - len(idle))  # a worker that never ran a rollout was idle throughout
    return {
        "rollouts_per_s": round(rate, 1),
        "worker_idle": [round(x, 3) for x in idle],
        "mean_idle": round(sum(idle) / len(idle), 3),
    }


async def main_async(url: str, tmp: Path) -> dict[str, Any]:
    register_trainer(url)
    return {
        "long_tail": await long_tail(url, True),
        "long_tail_group": await long_tail(url, False),
        "g64_2_workers": await two_workers(url, tmp / "spans.log"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        name, cmd, port = rollbuf("memory://", Path(tmp) / "r.log")
        with serve(name, cmd, port, Path(tmp) / "r.log") as target:
            result = asyncio.run(main_async(target.url, Path(tmp)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
